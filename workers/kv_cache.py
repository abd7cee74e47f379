"""KV cache manager: fixed-size KV blocks carved out of one contiguous pool tensor.

The interface is TensorRT-LLM's (PyTorch backend ``KVCacheManager``, its KV cache manager
documentation): ``prepare_resources`` / ``update_resources`` /
``free_resources`` for the step loop, ``get_max_resource_count`` /
``get_needed_resource_to_completion`` for the capacity scheduler, ``get_batch_cache_indices`` /
``get_buffers`` / ``get_num_free_blocks`` for the attention backend and the transfer path.

Pool layout (``docs/architecture.md``, "KV cache pool")::

    pool[num_layers, num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]
                                 ^ 0 = K (after RoPE), 1 = V

    byte offset of (layer, block) = ((layer * num_blocks) + block) * layout.block_bytes_per_layer

A request owns an ordered list of block ids, its *block table*: token at position ``p`` lives in
block ``table[p // tokens_per_block]`` at offset ``p % tokens_per_block``. Blocks are handed out
from a FIFO free list, so a freed block is reused only after every block freed before it.

A block may sit in several block tables at once (:meth:`KVCacheManager.fork`: the ``n`` choices
of one request share their prompt's full blocks, as vLLM's parallel sampling does). Each block
has a reference count; :meth:`KVCacheManager.free` drops one reference per table entry and a
block returns to the free list when its count reaches zero. Shared blocks are read-only by
contract: a sequence only ever writes positions past its shared prefix.

Every block has a *generation*, bumped each time it is allocated and each time it returns to the
free list, so ``(block id, generation)`` names one allocation: the prefill worker records the
generations of parked blocks and refuses to send a block whose generation moved (freed, maybe
reallocated) before its transfer starts (``pdserve.workers.parking``, fencing).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Protocol

import torch

from pdserve.errors import CapacityError
from pdserve.protocol import KVLayout

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class KVDemand(Protocol):
    """One scheduled sequence as :meth:`KVCacheManager.prepare_resources` sees it."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_kv_tokens_after_step(self) -> int:
        """Tokens whose K/V the request's blocks must hold once this step's forward has run."""
        ...


def blocks_for_tokens(num_tokens: int, tokens_per_block: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // tokens_per_block)


def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    """How many blocks (across all layers) fit in ``budget_bytes`` bytes of pool."""
    return budget_bytes // (layout.block_bytes_per_layer * layout.num_layers)


class KVCacheManager:
    """Owns the KV pool tensor and the block tables of the requests that hold blocks.

    Thread-safety: every method may be called from any thread (one internal lock). The pool's
    *contents* are not guarded: the engine thread writes K/V of running requests during a
    forward, while other threads may read or write the blocks of requests they own (parked
    blocks being sent, reserved blocks being filled by a transfer). A block id is never handed to
    two owners at once, so those accesses never overlap.

    Raises :class:`CapacityError` when an allocation does not fit in the free blocks; a failed
    allocation allocates nothing.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if num_blocks <= 0:
            raise CapacityError(
                f"KV cache budget holds no block of {layout.block_bytes_per_layer * layout.num_layers}"
                " bytes; raise kv_cache_bytes or num_blocks"
            )
        self.layout = layout
        self.num_blocks = num_blocks
        self.tokens_per_block = layout.tokens_per_block
        # Zero-filled rather than empty: attention reads padded (masked) slots of the block
        # table, and a NaN bit pattern there would survive the zero attention weight.
        self.pool = torch.zeros(
            (
                layout.num_layers,
                num_blocks,
                2,
                layout.tokens_per_block,
                layout.num_kv_heads,
                layout.head_dim,
            ),
            dtype=_TORCH_DTYPES[layout.dtype],
            device=device,
        )
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._refs: list[int] = [0] * num_blocks
        self._generation: list[int] = [0] * num_blocks

    # --- allocation ----------------------------------------------------------------------------

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return blocks_for_tokens(num_tokens, self.tokens_per_block)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow ``request_id``'s block table so that it holds ``num_tokens`` tokens and return a
        copy of the whole table (a no-op when the last block still has room). Raises
        :class:`CapacityError` (allocating nothing) when the free blocks do not suffice."""
        with self._lock:
            table = self._tables.setdefault(request_id, [])
            missing = self.blocks_for_tokens(num_tokens) - len(table)
            if missing > len(self._free):
                if not table:
                    del self._tables[request_id]
                raise CapacityError(
                    f"KV cache exhausted: request {request_id} needs {missing} more blocks, "
                    f"{len(self._free)} of {self.num_blocks} free"
                )
            table.extend(self._take(missing))
            return list(table)

    def _take(self, count: int) -> list[int]:
        """Pop ``count`` free blocks (the caller checked there are enough; lock held)."""
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._generation[block] += 1
            self._refs[block] = 1
        return blocks

    def can_allocate(self, num_blocks: int, watermark: int = 0) -> bool:
        """True when ``num_blocks`` more blocks can be allocated leaving ``watermark`` free."""
        with self._lock:
            return num_blocks + watermark <= len(self._free)

    def free(self, request_id: str) -> list[int]:
        """Drop ``request_id``'s block table: one reference per block; returns the ids that went
        back to the free list (those no other table shares). Idempotent: an unknown request frees
        nothing. The caller must know that nothing still reads or writes those blocks (no forward
        in flight, no transfer landing)."""
        with self._lock:
            released = []
            for block in self._tables.pop(request_id, []):
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._generation[block] += 1
                    released.append(block)
            self._free.extend(released)
            return released

    def fork(self, src_id: str, dst_id: str, num_shared_tokens: int) -> list[int] | None:
        """Give ``dst_id`` a block table that shares ``src_id``'s blocks up to the last full
        block before position ``num_shared_tokens`` and holds a private copy of the block that
        contains that position (so ``dst_id`` may write position ``num_shared_tokens`` on)::

            src: | b0 | b1 | b2 (partial) |        num_shared_tokens = 2 * tpb + 3
            dst: | b0 | b1 | b2' = copy of b2 |    b0, b1 shared (refcount 2)

        ``src_id`` must hold at least ``num_shared_tokens`` tokens. Returns ``dst_id``'s table,
        or None (nothing allocated) when no free block is left for the copy. The copy runs on
        the pool's device; the caller must know that no forward writes ``src_id``'s blocks
        meanwhile. Raises ValueError when ``dst_id`` already holds blocks or ``src_id`` holds too
        few."""
        tpb = self.tokens_per_block
        shared, private = divmod(num_shared_tokens, tpb)
        with self._lock:
            src = self._tables.get(src_id, [])
            if dst_id in self._tables:
                raise ValueError(f"{dst_id} already holds KV blocks")
            if len(src) < shared + (1 if private else 0):
                raise ValueError(f"{src_id} holds fewer than {num_shared_tokens} tokens")
            if private and not self._free:
                return None
            table = src[:shared]
            for block in table:
                self._refs[block] += 1
            if private:
                (copy,) = self._take(1)
                self.pool[:, copy] = self.pool[:, src[shared]]
                table = table + [copy]
            self._tables[dst_id] = table
            return list(table)

    def generations(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        """Current generation of each block (bumped at every allocation and every free): equal
        generations at two moments mean the block stayed with one owner in between. Raises
        IndexError for an id outside the pool."""
        ids = list(block_ids)
        if ids and min(ids) < 0:
            raise IndexError(f"negative KV block id in {ids}")
        with self._lock:
            return tuple(self._generation[b] for b in ids)

    def block_table(self, request_id: str) -> list[int]:
        """Copy of ``request_id``'s block table (empty when it holds no blocks)."""
        with self._lock:
            return list(self._tables.get(request_id, ()))

    def num_allocated(self, request_id: str) -> int:
        """Blocks ``request_id`` holds now."""
        with self._lock:
            return len(self._tables.get(request_id, ()))

    def holders(self) -> list[str]:
        """Request ids that hold blocks (for leak checks and load reports)."""
        with self._lock:
            return list(self._tables)

    # --- the seed's BaseResourceManager interface ----------------------------------------------

    def prepare_resources(self, demands: Iterable[KVDemand]) -> None:
        """Before a step's forward: allocate blocks so that each scheduled request can hold its
        K/V after the step (a whole prompt chunk in the context phase, one token in the
        generation phase; nothing happens while the last block has room). Raises
        :class:`CapacityError`; requests allocated before the failing one keep their blocks."""
        for demand in demands:
            self.allocate(demand.request_id, demand.num_kv_tokens_after_step)

    def update_resources(self, demands: Iterable[KVDemand]) -> None:
        """After a step's forward. Nothing to do without prefix caching; a hash index of full
        blocks would be updated here."""
        del demands

    def free_resources(self, request_id: str) -> list[int]:
        """A request finished: recycle its blocks (alias of :meth:`free`)."""
        return self.free(request_id)

    def get_max_resource_count(self) -> int:
        """Total number of KV blocks in the pool (the capacity scheduler's budget)."""
        return self.num_blocks

    def get_needed_resource_to_completion(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        """Blocks a request needs to run to completion.

        The K/V of every token fed to the model is cached: the prompt and each generated token
        except the last (it is sampled, never fed), i.e. ``num_prompt_tokens + max_new_tokens - 1``
        tokens. A prefill-only leg (one token) therefore needs exactly the prompt's blocks.
        """
        return self.blocks_for_tokens(num_prompt_tokens + max(max_new_tokens, 1) - 1)

    def get_batch_cache_indices(self, request_ids: Iterable[str]) -> dict[str, list[int]]:
        """Block table (list of block ids, in token order) of each request."""
        with self._lock:
            return {rid: list(self._tables.get(rid, ())) for rid in request_ids}

    def get_buffers(self, layer: int) -> torch.Tensor:
        """``pool[layer]``: a view ``[num_blocks, 2, tokens_per_block, num_kv_heads, head_dim]``
        sharing storage with :attr:`pool`."""
        return self.pool[layer]

    def get_num_free_blocks(self) -> int:
        """Blocks on the free list now (shared blocks count once, as used)."""
        with self._lock:
            return len(self._free)

    # --- transfer helpers ------------------------------------------------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the K/V of ``block_ids``: ``[num_layers, len(block_ids), 2, tpb, kvh, hd]``."""
        return self.pool[:, block_ids].clone()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (shaped as :meth:`read_blocks` returns) into ``block_ids``."""
        self.pool[:, block_ids] = data.to(self.pool.dtype)
