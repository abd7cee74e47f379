"""KV cache manager: fixed-size KV blocks carved out of one contiguous pool tensor.

The interface is TensorRT-LLM's (PyTorch backend ``KVCacheManager``, its KV cache manager
documentation): ``prepare_resources`` / ``update_resources`` /
``free_resources`` for the step loop, ``get_max_resource_count`` /
``get_needed_resource_to_completion`` for the capacity scheduler, ``get_batch_cache_indices`` /
``get_buffers`` / ``get_num_free_blocks`` for the attention backend and the transfer path.

Pool layout (``docs/architecture/workers.md``, "KV cache manager")::

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

Prefix cache (TensorRT-LLM's KV cache block reuse, vLLM's automatic prefix caching; hashes in
:mod:`pdserve.workers.kv.prefix_cache`). Once a forward has written a *full* block, the block is
registered in an index ``hash -> block id`` under its chained hash (:meth:`update_resources`).
A registered block whose reference count drops to zero is not freed: it joins an *evictable*
LRU with its contents. A new sequence takes references on its longest cached prefix of full
blocks (:meth:`acquire_prefix`) and computes only the rest; at least one token is always left
to compute, so the prefill produces logits. Allocation takes blocks from the free list first,
then evicts the least recently freed cached block (dropping it from the index)::

    free list (never cached, FIFO) -> LRU of evictable cached blocks (oldest first)

Blocks a request frees go to the LRU in reverse table order, so a sequence's tail is evicted
before its prefix. :meth:`get_num_free_blocks` counts free *plus evictable* blocks: both can be
allocated at once, so every capacity check (admission, watermark, reservation) treats a cached
block no one holds as free. ``prefix_caching=False`` disables lookups and registration (every
freed block goes to the free list, as before).

Every block has a *generation*, bumped each time it is allocated (a free block or an evicted
cached one) and each time it returns to the free list, so ``(block id, generation)`` names one
allocation of its contents: a cached block keeps its generation while it sits in the LRU and
while later prefix hits share it (its K/V does not change), and an eviction bumps it. The
prefill worker records the generations of parked blocks and refuses to send a block whose
generation moved (freed, maybe reallocated) before its transfer starts
(``pdserve.workers.roles.parking``, fencing).
"""

from __future__ import annotations

import shutil
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from pdserve.block_hash import BlockHasher, TokenBlocks
from pdserve.errors import CapacityError
from pdserve.protocol import KVLayout
from pdserve.workers.kv.prefix_cache import PrefixCacheStats, PrefixCounters

KV_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""``KVLayout.dtype`` name -> the pool's torch dtype."""


class KVCacheListener(Protocol):
    """Observer of the prefix cache's index (KV events, KV cache connector tiers).

    Both methods are called with the manager's lock held, on whatever thread changed the
    index (usually the engine thread): they must be quick and must not call back into the
    manager. ``hashes[i]`` names the K/V of block ``block_ids[i]`` of :attr:`KVCacheManager.pool`.
    """

    def blocks_stored(self, hashes: list[int], block_ids: list[int]) -> None:
        """Full blocks whose K/V was just indexed under ``hashes`` (a later request may reuse
        them)."""
        ...

    def blocks_evicted(self, hashes: list[int], block_ids: list[int]) -> None:
        """Cached blocks about to be reallocated: dropped from the index. Their K/V is still
        intact during the call (a tier may copy it now) and is overwritten soon after."""
        ...


class KVTokenListener(Protocol):
    """Observer of stored blocks that wants their tokens too (vLLM's ``BlockStored`` event:
    :mod:`pdserve.workers.kv.zmq_events`). Called as :class:`KVCacheListener` is."""

    def blocks_stored_tokens(
        self, hashes: list[int], parent: int | None, tokens: list[int]
    ) -> None:
        """A run of consecutive full blocks indexed now: their hashes in token order, the hash
        of the block before the first (None: it starts the sequence) and their tokens
        (``len(hashes) * tokens_per_block``)."""
        ...


class KVDemand(Protocol):
    """One scheduled sequence as :meth:`KVCacheManager.prepare_resources` sees it."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_kv_tokens_after_step(self) -> int:
        """Tokens whose K/V the request's blocks must hold once this step's forward has run."""
        ...


class KVUpdate(KVDemand, Protocol):
    """A scheduled sequence as :meth:`KVCacheManager.update_resources` sees it: also its tokens
    and block hashes (``seq``), so the blocks the forward filled can be registered."""

    @property
    def seq(self) -> TokenBlocks: ...


def blocks_for_tokens(num_tokens: int, tokens_per_block: int) -> int:
    """Number of blocks that hold ``num_tokens`` tokens (ceiling division)."""
    return -(-num_tokens // tokens_per_block)


def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    """How many blocks (across all layers) fit in ``budget_bytes`` bytes of pool."""
    return budget_bytes // layout.block_bytes


SHM_DIR = Path("/dev/shm")
"""Where torch's shared-memory tensors live on Linux (a tensor parallel pool)."""


def _check_shared_memory(nbytes: int) -> None:
    """Raise CapacityError when ``SHM_DIR`` cannot hold ``nbytes`` (containers get 64 MiB by
    default; a write past it would kill the worker with SIGBUS, not raise)."""
    if not SHM_DIR.is_dir():
        return
    free = shutil.disk_usage(SHM_DIR).free
    if free < nbytes:
        raise CapacityError(
            f"a tensor parallel KV pool of {nbytes / 2**20:.0f} MiB lives in shared memory, but "
            f"{SHM_DIR} has {free / 2**20:.0f} MiB free: lower kv_cache.budget_mb "
            "(--kv-cache-mb) or give the container more shared memory (docker --shm-size, "
            "compose shm_size, a memory-backed emptyDir at /dev/shm in Kubernetes)"
        )


class KVCacheManager:
    """Owns the KV pool tensor and the block tables of the requests that hold blocks.

    Thread-safety: every method may be called from any thread (one internal lock). The pool's
    *contents* are not guarded: the engine thread writes K/V of running requests during a
    forward, while other threads may read or write the blocks of requests they own (parked
    blocks being sent, reserved blocks being filled by a transfer). A block id is never handed to
    two owners at once, so those accesses never overlap.

    Raises :class:`CapacityError` when an allocation does not fit in the free blocks; a failed
    allocation allocates nothing.

    ``prefix_caching`` (default on): keep registered full blocks after their request ends and
    share them with later requests (see the module docstring); ``hasher`` hashes this pool's
    blocks (model identity, KV dtype, tokens per block of ``layout``).
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str | torch.device = "cpu",
        *,
        prefix_caching: bool = True,
    ):
        if num_blocks <= 0:
            raise CapacityError(
                f"KV cache budget holds no block of {layout.block_bytes} bytes; raise "
                "kv_cache.budget_mb (--kv-cache-mb) or kv_cache.num_blocks"
            )
        self.layout = layout
        self.num_blocks = num_blocks
        self.tokens_per_block = layout.tokens_per_block
        # Zero-filled rather than empty: attention reads padded (masked) slots of the block
        # table, and a NaN bit pattern there would survive the zero attention weight.
        shard = (
            layout.num_layers,
            num_blocks,
            2,
            layout.tokens_per_block,
            layout.kv_heads_per_rank,
            layout.head_dim,
        )
        ranks = (layout.tp_size,) if layout.tp_size > 1 else ()
        shared = bool(ranks) and torch.device(device).type == "cpu"
        if shared:
            _check_shared_memory(num_blocks * layout.block_bytes)
        self.pool = torch.zeros((*ranks, *shard), dtype=KV_DTYPES[layout.dtype], device=device)
        if shared:
            self.pool.share_memory_()  # the tensor parallel ranks write their shards in place
        self._blocks: tuple[slice, ...] = (slice(None),) * (len(ranks) + 1)  # index up to blocks
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._refs: list[int] = [0] * num_blocks
        self._generation: list[int] = [0] * num_blocks
        self.prefix_caching = prefix_caching
        self.hasher = BlockHasher(layout.model, layout.dtype, layout.tokens_per_block)
        self.counters = PrefixCounters()
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._index: dict[int, int] = {}  # block hash -> block id (K/V written)
        self._block_hash: list[int | None] = [None] * num_blocks
        self._registered: dict[str, int] = {}  # request id -> leading table blocks registered
        self._evictions = 0
        self._listeners: list[KVCacheListener] = []
        self._token_listeners: list[KVTokenListener] = []

    def add_listener(self, listener: KVCacheListener) -> None:
        """Call ``listener`` on every later store into and eviction from the prefix index."""
        with self._lock:
            self._listeners.append(listener)

    def add_token_listener(self, listener: KVTokenListener) -> None:
        """Call ``listener`` with the tokens of every later run of blocks stored by a
        :meth:`register` that names its sequence."""
        with self._lock:
            self._token_listeners.append(listener)

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
            available = len(self._free) + len(self._evictable)
            if missing > available:
                if not table:
                    del self._tables[request_id]
                raise CapacityError(
                    f"KV cache exhausted: request {request_id} needs {missing} more blocks, "
                    f"{available} of {self.num_blocks} free"
                )
            table.extend(self._take(missing))
            return list(table)

    def _take(self, count: int) -> list[int]:
        """Pop ``count`` free blocks, evicting least recently used cached blocks once the free
        list is empty (the caller checked there are enough; lock held)."""
        blocks: list[int] = []
        evicted: list[int] = []
        evicted_hashes: list[int] = []
        for _ in range(count):
            if self._free:
                blocks.append(self._free.popleft())
                continue
            block, _ = self._evictable.popitem(last=False)
            digest = self._block_hash[block]
            if digest is not None and self._index.get(digest) == block:
                del self._index[digest]
                evicted.append(block)
                evicted_hashes.append(digest)
            self._block_hash[block] = None
            self._evictions += 1
            blocks.append(block)
        if evicted:
            for listener in self._listeners:
                listener.blocks_evicted(evicted_hashes, evicted)
        for block in blocks:
            self._generation[block] += 1
            self._refs[block] = 1
        return blocks

    def can_allocate(self, num_blocks: int, watermark: int = 0) -> bool:
        """True when ``num_blocks`` more blocks can be allocated leaving ``watermark`` free
        (evictable cached blocks count as free)."""
        with self._lock:
            return num_blocks + watermark <= len(self._free) + len(self._evictable)

    def free(self, request_id: str) -> list[int]:
        """Drop ``request_id``'s block table: one reference per block; returns the ids no table
        holds any more (those no other table shares): registered ones join the evictable LRU
        with their contents and generation (tail first, so the prefix outlives the tail),
        the others go back to the free list. Idempotent: an unknown request frees nothing. The
        caller must know that nothing still reads or writes those blocks (no forward in flight,
        no transfer landing)."""
        with self._lock:
            released = []
            self._registered.pop(request_id, None)
            for block in self._tables.pop(request_id, []):
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    released.append(block)
            for block in released:
                if self._block_hash[block] is None:
                    self._generation[block] += 1
                    self._free.append(block)
            for block in reversed(released):
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
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
            if private and not (self._free or self._evictable):
                return None
            table = src[:shared]
            for block in table:
                self._refs[block] += 1
            if private:
                (copy,) = self._take(1)
                self.pool[self._at(copy)] = self.pool[self._at(src[shared])]
                table = table + [copy]
            self._tables[dst_id] = table
            self._registered[dst_id] = min(shared, self._registered.get(src_id, 0))
            return list(table)

    # --- prefix cache ----------------------------------------------------------------------------

    def _cacheable_blocks(self, block_hashes: list[int], num_tokens: int) -> list[int]:
        """Leading cached blocks of ``block_hashes``, at most up to the last full block boundary
        strictly below ``num_tokens`` (one token is always left to compute; lock held)."""
        if not self.prefix_caching:
            return []
        limit = min(len(block_hashes), max(num_tokens - 1, 0) // self.tokens_per_block)
        blocks = []
        for digest in block_hashes[:limit]:
            block = self._index.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def match_prefix(self, block_hashes: list[int], num_tokens: int) -> tuple[list[int], int]:
        """Longest cached prefix of a sequence of ``num_tokens`` tokens whose full blocks hash
        to ``block_hashes`` (:class:`~pdserve.workers.kv.prefix_cache.BlockHasher`): ``(block ids,
        cached tokens)``, a multiple of ``tokens_per_block`` below ``num_tokens``. Takes no
        reference and leaves the LRU alone (a peek; see :meth:`acquire_prefix`)."""
        with self._lock:
            blocks = self._cacheable_blocks(block_hashes, num_tokens)
            return blocks, len(blocks) * self.tokens_per_block

    def acquire_prefix(self, request_id: str, block_hashes: list[int], num_tokens: int) -> int:
        """Start ``request_id``'s block table with its longest cached prefix (as
        :meth:`match_prefix` finds it), taking a reference on each block (an evictable block
        leaves the LRU); returns the cached tokens, whose K/V the request must not compute.
        Returns 0 (and takes nothing) when prefix caching is off, nothing matches, or the
        request already holds blocks. The caller counts the lookup
        (``counters.record_query``) once the request is admitted; :meth:`free` undoes this."""
        with self._lock:
            if request_id in self._tables:
                return 0
            blocks = self._cacheable_blocks(block_hashes, num_tokens)
            if not blocks:
                return 0
            for block in blocks:
                if self._refs[block] == 0:
                    del self._evictable[block]
                self._refs[block] += 1
            self._tables[request_id] = blocks
            self._registered[request_id] = len(blocks)
            return len(blocks) * self.tokens_per_block

    def register(
        self,
        request_id: str,
        block_hashes: list[int],
        num_computed_tokens: int,
        seq: TokenBlocks | None = None,
    ) -> int:
        """Index ``request_id``'s full blocks whose K/V is written (the first
        ``num_computed_tokens`` tokens) under ``block_hashes`` (one hash per full block, in
        token order). A block is indexed once; a hash already indexed (another request computed
        the same prefix) leaves this request's block uncached. Returns how many blocks were
        indexed now. No-op when prefix caching is off. ``seq``: the sequence, whose tokens the
        token listeners get."""
        if not self.prefix_caching:
            return 0
        with self._lock:
            table = self._tables.get(request_id, [])
            done = self._registered.get(request_id, 0)
            full = min(num_computed_tokens // self.tokens_per_block, len(block_hashes), len(table))
            stored: list[int] = []
            stored_hashes: list[int] = []
            positions: list[int] = []
            for i in range(done, full):
                block, digest = table[i], block_hashes[i]
                if self._block_hash[block] is None and digest not in self._index:
                    self._index[digest] = block
                    self._block_hash[block] = digest
                    stored.append(block)
                    stored_hashes.append(digest)
                    positions.append(i)
            if full > done:
                self._registered[request_id] = full
            if stored:
                for listener in self._listeners:
                    listener.blocks_stored(stored_hashes, stored)
                if seq is not None and self._token_listeners:
                    self._tell_tokens(block_hashes, positions, seq)
            return len(stored)

    def _tell_tokens(self, hashes: list[int], positions: list[int], seq: TokenBlocks) -> None:
        """The token listeners get each run of consecutive stored positions (lock held)."""
        tpb = self.tokens_per_block
        start = 0
        for k in range(1, len(positions) + 1):
            if k < len(positions) and positions[k] == positions[k - 1] + 1:
                continue
            first, n = positions[start], k - start
            parent = hashes[first - 1] if first > 0 else None
            tokens = seq.token_slice(first * tpb, n * tpb)
            for listener in self._token_listeners:
                listener.blocks_stored_tokens(hashes[first : first + n], parent, tokens)
            start = k

    def cached_hashes(self) -> list[int]:
        """Every block hash in the prefix index now (held or evictable), in no order: a KV
        event publisher's snapshot."""
        with self._lock:
            return list(self._index)

    def prefix_stats(self) -> PrefixCacheStats:
        """Snapshot of the prefix cache counters and occupancy."""
        c = self.counters
        with self._lock:
            cached, evictable, evictions = len(self._index), len(self._evictable), self._evictions
        return PrefixCacheStats(
            c.queries, c.query_tokens, c.hit_tokens, cached, evictable, evictions
        )

    def generations(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        """Current generation of each block (bumped at every allocation, including the
        reallocation of an evicted cached block, and every return to the free list): equal
        generations at two moments mean the block's contents stayed the same in between (one
        owner, or a cached block shared by prefix hits). Raises IndexError for an id outside the
        pool."""
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

    def update_resources(self, demands: Iterable[KVUpdate]) -> None:
        """After a step's forward: register the full blocks the forward completed (hashing
        them into ``demand.seq.block_hashes`` as needed) so later requests can reuse them.
        Nothing happens without prefix caching."""
        if not self.prefix_caching:
            return
        for demand in demands:
            computed = demand.num_kv_tokens_after_step
            hashes = self.hasher.extend(demand.seq, computed)
            self.register(demand.request_id, hashes, computed, demand.seq)

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

    def get_buffers(self, layer: int, rank: int = 0) -> torch.Tensor:
        """Layer ``layer`` of rank ``rank``'s shard: a view ``[num_blocks, 2, tokens_per_block,
        kv_heads_per_rank, head_dim]`` sharing storage with :attr:`pool`."""
        return self.shard(rank)[layer]

    def _at(self, blocks: int | list[int]) -> tuple[Any, ...]:
        """Index of ``blocks`` in :attr:`pool` (block dim 1, or 2 behind the rank dim)."""
        return (*self._blocks, blocks)

    def shard(self, rank: int = 0) -> torch.Tensor:
        """Rank ``rank``'s pool shard ``[num_layers, num_blocks, 2, tpb, kv_heads_per_rank,
        head_dim]``, a contiguous view of :attr:`pool` (the pool itself when tp_size is 1)."""
        return self.pool[rank] if self.layout.tp_size > 1 else self.pool

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now: the free list plus evictable cached blocks (no
        request holds them; allocation evicts them LRU). Shared blocks count once, as used.
        ``num_blocks - get_num_free_blocks()`` is the blocks requests (and parked results)
        hold."""
        with self._lock:
            return len(self._free) + len(self._evictable)

    def get_num_evictable_blocks(self) -> int:
        """Cached blocks no request holds (included in :meth:`get_num_free_blocks`)."""
        with self._lock:
            return len(self._evictable)

    # --- transfer helpers ------------------------------------------------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the K/V of ``block_ids``: ``[num_layers, len(block_ids), 2, tpb, kvh, hd]``
        where ``kvh`` is every rank's heads side by side (rank-major, ``tp_size *
        kv_heads_per_rank``)."""
        data = self.pool[self._at(block_ids)]
        if self.layout.tp_size > 1:  # [tp, L, n, 2, tpb, h, hd] -> [L, n, 2, tpb, tp * h, hd]
            data = data.permute(1, 2, 3, 4, 0, 5, 6).flatten(4, 5)
        return data.clone()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (shaped as :meth:`read_blocks` returns) into ``block_ids``."""
        data = data.to(self.pool.dtype)
        if self.layout.tp_size > 1:
            L, n, _, tpb, _, hd = data.shape
            data = data.view(L, n, 2, tpb, self.layout.tp_size, -1, hd).permute(4, 0, 1, 2, 3, 5, 6)
        self.pool[self._at(block_ids)] = data
