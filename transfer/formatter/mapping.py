"""Formatter: which bytes of the prefill pool go to which bytes of the decode pool.

Design origin: the TensorRT-LLM seed's *Formatter* (maps the context executor's cache layout to
the generation executor's and refuses what it cannot map). :meth:`Formatter.negotiate` runs once
per connection, at handshake, on both sides:

- equal layouts (:class:`~pdserve.protocol.KVLayout`) -> :class:`IdentityFormatter`: the
  zero-copy path, blocks go byte for byte from the prefill pool into the decode pool;
- layouts that differ only in ``tokens_per_block`` and/or ``dtype``
  (:meth:`KVLayout.can_map_to`) -> :class:`ConvertingFormatter`: the prefill (sending) side
  re-blocks and converts the request's K/V into a *staging buffer* laid out exactly like the
  destination blocks (:mod:`pdserve.transfer.formatter.convert`), and the backend sends that buffer;
- anything else (model, layers, KV heads, head size) -> :class:`LayoutMismatchError` naming the
  fields, at handshake, so no request ever reaches a pair that cannot be mapped.

Why convert on the sender: the sender learns the receiver's layout at handshake, so the bytes on
the wire are already in the receiver's layout. The receiver's data path is then the same for
every layout pair (NIXL still does one WRITE into the decode pool's blocks; TCP/UCX still
scatter straight into them), and the decode side never holds a second copy of the prompt.

Pool arithmetic (both sides, see docs/architecture/workers.md, "KV cache manager")::

    pool[num_layers, num_blocks, 2, tpb, kvh, hd]   one contiguous tensor
    byte offset of (layer, block) = (layer * num_blocks + block) * block_bytes
                                                     block_bytes = layout.block_bytes_per_layer
      layer 0: | b0 | b1 | b2 | ... | b(nb-1) |
      layer 1: | b0 | b1 | b2 | ... | b(nb-1) |   <- layer stride = num_blocks * block_bytes

A run of consecutive ids on BOTH sides (src 7,8,9 -> dst 2,3,4) is one contiguous range per
layer on each side, so a transfer is ``num_layers * num_runs`` segments, never one per block.
A converting transfer's source is the staging buffer ``[num_layers, n_dst, 2, dst_tpb, kvh, hd]``
(block ``i`` of it is destined for ``dst_ids[i]``), so its runs are the runs of ``dst_ids``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from pdserve.errors import ConfigError, LayoutMismatchError, TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer.formatter import convert

_ALIGN = 64
"""Byte alignment of the scratch area behind a staging buffer's output area."""


_LAYER_BASES: dict[tuple[PoolGeometry, int], np.ndarray] = {}
"""(geometry, block bytes) -> :meth:`PoolGeometry.layer_bases`: computed once per peer pool."""


@dataclass(frozen=True)
class PoolGeometry:
    """Where one worker's pool lies: enough to turn (rank, layer, block) into a byte offset.

    ``base_addr`` is the pool's data pointer (process-local; meaningful to NIXL only),
    ``block_bytes`` = ``layout.block_bytes_per_layer`` (one rank's shard), ``device`` a torch
    device string, ``num_shards`` = ``layout.tp_size`` (the shards lie rank-major, each
    ``shard_nbytes`` long).
    """

    num_layers: int
    num_blocks: int
    block_bytes: int
    base_addr: int = 0
    device: str = "cpu"
    num_shards: int = 1

    @property
    def shard_nbytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes

    @property
    def nbytes(self) -> int:
        return self.num_shards * self.shard_nbytes

    def layer_bases(self, block_bytes: int) -> np.ndarray:
        """Byte offset of block 0 of every (shard, layer), shard-major: int64
        ``[num_shards * num_layers]`` for blocks of ``block_bytes`` (the plan's unit; cached,
        read-only: every plan adds its block offsets to it)."""
        key = (self, block_bytes)
        bases = _LAYER_BASES.get(key)
        if bases is None:
            shards = np.arange(self.num_shards, dtype=np.int64)[:, None] * self.shard_nbytes
            layers = np.arange(self.num_layers, dtype=np.int64)[None, :]
            bases = (shards + layers * self.num_blocks * block_bytes).ravel()
            bases.flags.writeable = False
            if len(_LAYER_BASES) >= 64:  # a handful of geometries per process in practice
                _LAYER_BASES.clear()
            _LAYER_BASES[key] = bases
        return bases

    @classmethod
    def from_pool(cls, pool: torch.Tensor, layout: KVLayout) -> PoolGeometry:
        """Check ``pool`` against ``layout`` (shape, dtype, contiguity); raises ConfigError."""
        tp = layout.tp_size
        shard = (layout.num_layers, 2, layout.tokens_per_block, layout.kv_heads_per_rank)
        shape = tuple(pool.shape)
        lead = (tp,) if tp > 1 else ()
        rank_dims = len(lead)
        if (
            pool.dim() != 6 + rank_dims
            or shape[:rank_dims] != lead
            or (shape[rank_dims], *shape[rank_dims + 2 : rank_dims + 5]) != shard
            or shape[-1] != layout.head_dim
            or shape[rank_dims + 1] <= 0
        ):
            raise ConfigError(
                f"KV pool shape {shape} does not match layout [{f'tp_size={tp}, ' if lead else ''}"
                f"num_layers={layout.num_layers}, num_blocks, 2, {layout.tokens_per_block}, "
                f"{layout.kv_heads_per_rank}, {layout.head_dim}]"
            )
        if pool.dtype != convert.torch_dtype(layout.dtype):
            raise ConfigError(f"KV pool dtype {pool.dtype} != layout dtype {layout.dtype}")
        if not pool.is_contiguous():
            raise ConfigError("KV pool must be one contiguous tensor")
        return cls(
            num_layers=layout.num_layers,
            num_blocks=int(pool.shape[rank_dims + 1]),
            block_bytes=layout.block_bytes_per_layer,
            base_addr=int(pool.data_ptr()),
            device=str(pool.device),
            num_shards=tp,
        )

    @classmethod
    def of_layout(cls, layout: KVLayout, num_blocks: int) -> PoolGeometry:
        """A peer's pool geometry as far as offsets go (its address is the backend's
        business), from its handshake's layout and block count."""
        return cls(
            num_layers=layout.num_layers,
            num_blocks=num_blocks,
            block_bytes=layout.block_bytes_per_layer,
            num_shards=layout.tp_size,
        )


def pool_bytes(pool: torch.Tensor) -> memoryview:
    """Writable flat byte view of a contiguous CPU pool (any dtype, bfloat16 included); no copy."""
    if pool.device.type != "cpu":
        raise ConfigError(f"byte streaming needs a CPU pool, got {pool.device}")
    return pool.view(-1).view(torch.uint8).numpy().data.cast("B")


_PY_RUNS_MAX = 512
"""Up to this many ids :func:`coalesce_runs` walks them in Python (about 1 us for one block,
against 9 us for the vectorised form, whose fixed cost is five numpy calls); longer lists
go through numpy, which wins from about a thousand ids."""


def coalesce_runs(
    src_ids: Sequence[int], dst_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the pairing ``src_ids[i] -> dst_ids[i]`` into maximal runs consecutive on both sides.

    Returns ``(src_starts, dst_starts, counts)``, int64 arrays of equal length R; run ``r`` maps
    src blocks ``src_starts[r] .. +counts[r]`` to dst blocks ``dst_starts[r] .. +counts[r]``.
    Example: src (3,4,5,9) dst (10,11,0,1) -> starts (3,5,9)/(10,0,1), counts (2,1,1).
    """
    n = len(src_ids)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if n <= _PY_RUNS_MAX:  # the per-request fixed cost: no numpy call per step
        src_starts, dst_starts, counts = [src_ids[0]], [dst_ids[0]], []
        begin, prev_s, prev_d = 0, src_ids[0], dst_ids[0]
        for i in range(1, n):
            s, d = src_ids[i], dst_ids[i]
            if s != prev_s + 1 or d != prev_d + 1:
                counts.append(i - begin)
                begin = i
                src_starts.append(s)
                dst_starts.append(d)
            prev_s, prev_d = s, d
        counts.append(n - begin)
        return (
            np.array(src_starts, dtype=np.int64),
            np.array(dst_starts, dtype=np.int64),
            np.array(counts, dtype=np.int64),
        )
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    return src[starts], dst[starts], np.diff(np.append(starts, src.size))


@dataclass(frozen=True)
class TransferPlan:
    """One request's byte movement: segment ``k`` copies ``lengths[k]`` bytes from byte offset
    ``src_offsets[k]`` of the source memory to ``dst_offsets[k]`` of the decode pool.

    Arrays are int64 of length ``num_layers * num_runs``, layer-major. Offsets are relative to
    each memory's base. On the TCP stream the bytes travel in exactly this order.

    ``source`` is the source memory: ``None`` = the sender's KV pool (identity layouts);
    otherwise a contiguous 1-D ``uint8`` tensor, a staging buffer the converting formatter
    filled in the destination layout (owned by :class:`pdserve.transfer.formatter.staging.StagingPool`,
    registered with the backend through ``Backend.register_staging``, lent for this one send).
    Backends send from ``source`` when it is set. Only the sender's plan ever has one.
    """

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    source: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(self.lengths.size)

    def with_source(self, source: torch.Tensor) -> TransferPlan:
        """The same segments, read from ``source`` instead of the pool."""
        return replace(self, source=source)


class Formatter(ABC):
    """Maps blocks of a prefill (src) pool onto blocks of a decode (dst) pool.

    Created once per connection by :meth:`negotiate` at handshake; stateless after that, so
    both sides compute the same :class:`TransferPlan` from the same ids. ``staged``: the sender
    must :meth:`stage` the bytes into a staging buffer before sending (converting formatters).
    """

    staged: ClassVar[bool] = False

    def __init__(self, src: PoolGeometry, dst: PoolGeometry):
        self.src = src
        self.dst = dst

    @property
    def block_aligned(self) -> bool:
        """Source block ``i`` fills destination block ``i`` (equal tokens per block), so a
        request's leading blocks can move before the rest exist (streamed hand-off)."""
        return True

    @staticmethod
    def negotiate(
        src_layout: KVLayout, dst_layout: KVLayout, src: PoolGeometry, dst: PoolGeometry
    ) -> Formatter:
        """Pick the formatter that maps ``src_layout`` (prefill) onto ``dst_layout`` (decode).

        Raises LayoutMismatchError naming the fields no formatter bridges (model identity,
        num_layers, num_kv_heads, head_dim), e.g. ``num_kv_heads: 3 != 6``.
        """
        if src_layout == dst_layout:
            return IdentityFormatter(src, dst)
        if src_layout.can_map_to(dst_layout):
            return ConvertingFormatter(src_layout, dst_layout, src, dst)
        raise LayoutMismatchError(
            "KV layouts cannot be mapped (prefill vs decode): "
            f"{src_layout.describe_unmappable(dst_layout)}; the formatter converts only "
            "tokens_per_block, dtype and the tensor parallel split (tp_size)"
        )

    @abstractmethod
    def plan(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> TransferPlan:
        """Segments moving the K/V held by blocks ``src_ids`` (in token order) into blocks
        ``dst_ids`` (in token order), every layer.

        Raises TransferError for block counts that hold no common token count, out-of-range
        or duplicate destination ids.
        """

    def staging_nbytes(self, num_dst_blocks: int) -> int:
        """Bytes of staging buffer :meth:`stage` needs for ``num_dst_blocks`` (0: none)."""
        return 0

    def stage(
        self, pool: torch.Tensor, src_ids: Sequence[int], num_dst_blocks: int, buf: torch.Tensor
    ) -> torch.Tensor:
        """Sender side: write the K/V of ``src_ids`` into ``buf`` as ``num_dst_blocks``
        destination blocks and return the part of ``buf`` the plan's ``src_offsets`` index.
        Identity: never called."""
        raise TransferError(f"{type(self).__name__} sends from the pool; nothing to stage")


class IdentityFormatter(Formatter):
    """Equal layouts: block ``s`` of layer ``l`` is copied byte for byte into block ``d``."""

    def plan(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> TransferPlan:
        if len(src_ids) != len(dst_ids):
            raise TransferError(
                f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks"
            )
        _check_ids(src_ids, dst_ids, self.src.num_blocks, self.dst.num_blocks)
        return _run_plan(self.src, self.dst, src_ids, dst_ids)


@dataclass(frozen=True)
class HeadPart:
    """Part of one destination rank's KV heads that one source rank holds: source shard
    ``src_rank``'s local heads ``src_heads`` go to the destination shard's local heads
    ``dst_heads`` (equal lengths, consecutive on both sides)."""

    src_rank: int
    src_heads: range
    dst_heads: range


def head_map(src: KVLayout, dst: KVLayout) -> tuple[tuple[HeadPart, ...], ...]:
    """For each destination rank, where its KV heads come from (the Formatter's mapping
    between tensor parallel layouts, as TensorRT-LLM's and vLLM's heterogeneous-TP transfers
    do it). A head several source ranks hold (replicated) is read from the first of them.

    Example, 3 KV heads: TP 1 -> 3 gives rank ``r`` ``(HeadPart(0, range(r, r+1),
    range(0, 1)),)`` (a split); TP 3 -> 1 gives rank 0 three parts, one per source rank (a
    merge). Raises LayoutMismatchError when the layouts hold different KV heads."""
    if src.num_kv_heads != dst.num_kv_heads:
        raise LayoutMismatchError(f"num_kv_heads: {src.num_kv_heads} != {dst.num_kv_heads}")
    owner: dict[int, tuple[int, int]] = {}  # global head -> (source rank, local index)
    for rank in range(src.tp_size):
        for local, head in enumerate(src.rank_heads(rank)):
            owner.setdefault(head, (rank, local))
    result: list[tuple[HeadPart, ...]] = []
    for rank in range(dst.tp_size):
        parts: list[HeadPart] = []
        for local, head in enumerate(dst.rank_heads(rank)):
            s_rank, s_local = owner[head]
            last = parts[-1] if parts else None
            if last and last.src_rank == s_rank and last.src_heads.stop == s_local:
                parts[-1] = HeadPart(
                    s_rank,
                    range(last.src_heads.start, s_local + 1),
                    range(last.dst_heads.start, local + 1),
                )
            else:
                parts.append(HeadPart(s_rank, range(s_local, s_local + 1), range(local, local + 1)))
        result.append(tuple(parts))
    return tuple(result)


class ConvertingFormatter(Formatter):
    """Layouts equal but for ``tokens_per_block`` (p -> d), ``dtype`` and/or ``tp_size``:
    re-block, convert and map KV heads between rank layouts in one staging pass.

    Token ``t`` of a request lives in source block ``src_ids[t // p]`` slot ``t % p`` and goes
    to destination block ``dst_ids[t // d]`` slot ``t % d``. With p=16, d=32::

        src  | s0: t0-15 | s1: t16-31 | s2: t32-47 |            (3 blocks, 48 slots)
        dst  | d0: t0-31              | d1: t32-63 |            (2 blocks, 64 slots)
                                              t48-63: padding, zero-filled

    A request of T tokens has ``ceil(T / p)`` source and ``ceil(T / d)`` destination blocks;
    the ``min(n_src * p, n_dst * d)`` slots both sides hold are moved (every real token, and
    the tail of the last block beyond T, which attention never reads), the destination slots
    past the source's are zeroed. Values convert as ``Tensor.to`` does (round to nearest even
    when narrowing, exact when widening: bfloat16 -> float32 reproduces every bit).

    Tensor parallel layouts (:func:`head_map`): destination rank ``r``'s shard is staged from
    the source shards that hold its KV heads. With equal block sizes every part is one strided
    copy per run of source blocks, from the source shard's head slice into the destination
    shard's (:func:`convert.copy_heads`; one pass, dtype converted on the way). When the block
    size changes too, a rank whose heads one source shard holds (same split, or a finer one:
    TP 1 -> 3) is gathered straight into the output (the source's head slice read in place);
    one whose heads several hold (a coarser split: TP 3 -> 1) is gathered per source into the
    scratch area and copied into its head slice::

        src  rank 0: [h0 h1 h2]                      dst rank 0: [h0]  rank 1: [h1]  rank 2: [h2]
        (TP 1 -> 3: split)  each decode rank receives exactly the one head it owns

    The plan's source is the staging buffer ``[tp_dst, num_layers, n_dst, 2, d, kvh_r, hd]``
    of the destination dtype (:meth:`stage`; no leading dim when tp_dst is 1), one run per run
    of consecutive ``dst_ids`` per destination shard.

    Why stage even when only the block size differs (a zero-copy plan of one segment per K or
    V of each source block would do): measured on this machine's loopback, SmolLM2 layout, f32
    16 -> 32 tokens per block, the staged pull added 2.2 ms (512 tokens) and 9 ms (2048) to the
    matched pull over NIXL, the zero-copy descriptor list 8 ms and 26 ms (UCX pays per
    descriptor: 1920 and 7680 of 12 KiB); over TCP they were even at 512 tokens and staging
    ahead at 2048 (a zero-copy variant of this class, measured beside the staged one with
    ``pdserve bench formatter``, then dropped).
    """

    staged = True

    def __init__(
        self, src_layout: KVLayout, dst_layout: KVLayout, src: PoolGeometry, dst: PoolGeometry
    ):
        super().__init__(src, dst)
        if not src_layout.can_map_to(dst_layout):
            raise LayoutMismatchError(src_layout.describe_unmappable(dst_layout))
        self.src_layout = src_layout
        self.dst_layout = dst_layout
        self.heads = head_map(src_layout, dst_layout)

    @property
    def block_aligned(self) -> bool:
        return self.src_layout.tokens_per_block == self.dst_layout.tokens_per_block

    def plan(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> TransferPlan:
        p, d = self.src_layout.tokens_per_block, self.dst_layout.tokens_per_block
        n_dst = len(dst_ids)
        _check_token_counts(len(src_ids), p, n_dst, d)
        _check_ids(src_ids, dst_ids, self.src.num_blocks, self.dst.num_blocks)
        staging = PoolGeometry(
            self.dst.num_layers, n_dst, self.dst.block_bytes, num_shards=self.dst.num_shards
        )
        return _run_plan(staging, self.dst, range(n_dst), dst_ids)

    def _output_nbytes(self, num_dst_blocks: int) -> int:
        return self.dst.num_shards * self.dst.num_layers * num_dst_blocks * self.dst.block_bytes

    def staging_nbytes(self, num_dst_blocks: int) -> int:
        """Output area (destination layout, every destination shard) plus a scratch area in
        the source dtype: the converting gather's chunks (at most ``convert.SCRATCH_BYTES``)
        when the dtype changes, one source shard's heads of the request when shards merge."""
        out = self._output_nbytes(num_dst_blocks)
        scratch = self._scratch_nbytes(num_dst_blocks) + self._merge_nbytes(num_dst_blocks)
        if not scratch:
            return out
        return -(-out // _ALIGN) * _ALIGN + scratch

    def _out_shape(self, num_dst_blocks: int, heads: int | None = None) -> tuple[int, ...]:
        """One destination shard's staged blocks: ``[L, n_dst, 2, d, heads, hd]``."""
        dst = self.dst_layout
        return (
            dst.num_layers,
            num_dst_blocks,
            2,
            dst.tokens_per_block,
            dst.kv_heads_per_rank if heads is None else heads,
            dst.head_dim,
        )

    def _scratch_nbytes(self, num_dst_blocks: int) -> int:
        if self.src_layout.dtype == self.dst_layout.dtype:
            return 0
        return convert.scratch_nbytes(
            convert.torch_dtype(self.src_layout.dtype),
            self._out_shape(num_dst_blocks),
            self.src_layout.tokens_per_block,
        )

    def _merge_nbytes(self, num_dst_blocks: int) -> int:
        if self.src_layout.tokens_per_block == self.dst_layout.tokens_per_block:
            return 0  # strided copies straight into the head slices
        widest = max((len(p.src_heads) for r in self.heads if len(r) > 1 for p in r), default=0)
        if not widest:
            return 0
        numel = math.prod(self._out_shape(num_dst_blocks, widest))
        return -(-numel * self.src_layout.itemsize // _ALIGN) * _ALIGN

    def stage(
        self, pool: torch.Tensor, src_ids: Sequence[int], num_dst_blocks: int, buf: torch.Tensor
    ) -> torch.Tensor:
        """Fill ``buf`` (1-D uint8, at least ``staging_nbytes(num_dst_blocks)`` bytes, on the
        pool's device) from ``pool`` (the sender's pool: ``[L, nb, 2, p, kvh, hd]``, or
        ``[tp_src, L, nb, 2, p, kvh_r, hd]`` when tensor parallel), for the ids the plan was
        made from. Returns the output area, the first ``_output_nbytes`` bytes of ``buf``."""
        n_out = self._output_nbytes(num_dst_blocks)
        shape = self._out_shape(num_dst_blocks)
        dst_dtype = convert.torch_dtype(self.dst_layout.dtype)
        src_dtype = convert.torch_dtype(self.src_layout.dtype)
        out = buf[:n_out].view(dst_dtype).view(self.dst.num_shards, *shape)
        start = -(-n_out // _ALIGN) * _ALIGN
        n_scratch = self._scratch_nbytes(num_dst_blocks)
        scratch = buf[start : start + n_scratch].view(src_dtype) if n_scratch else None
        merge = buf[start + n_scratch :]
        shards = pool.unbind(0) if self.src_layout.tp_size > 1 else (pool,)
        same_blocks = self.src_layout.tokens_per_block == self.dst_layout.tokens_per_block
        for rank, parts in enumerate(self.heads):
            if same_blocks:  # strided copies, straight into each part's head slice
                for part in parts:
                    heads = slice(part.dst_heads.start, part.dst_heads.stop)
                    convert.copy_heads(
                        shards[part.src_rank], src_ids, out[rank, ..., heads, :], part.src_heads
                    )
                continue
            if len(parts) == 1:  # one source shard holds every head of this rank
                (part,) = parts
                convert.reblock(shards[part.src_rank], src_ids, out[rank], scratch, part.src_heads)
                continue
            for part in parts:  # a merge: gather each source's heads, then place them
                numel = math.prod(self._out_shape(num_dst_blocks, len(part.src_heads)))
                tmp = merge[: numel * src_dtype.itemsize].view(src_dtype)
                tmp = tmp.view(self._out_shape(num_dst_blocks, len(part.src_heads)))
                convert.reblock(shards[part.src_rank], src_ids, tmp, None, part.src_heads)
                heads = slice(part.dst_heads.start, part.dst_heads.stop)
                convert.convert_into(out[rank, ..., heads, :], tmp)
        return buf[:n_out]


def _run_plan(
    src: PoolGeometry, dst: PoolGeometry, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> TransferPlan:
    """Identity-shaped plan: block ``src_ids[i]`` of ``src`` -> ``dst_ids[i]`` of ``dst``, blocks
    of ``dst.block_bytes``, one segment per shard per layer per run (shard ``r`` of ``src`` into
    shard ``r`` of ``dst``: equal shard counts). Costs two outer sums over the geometries'
    cached (shard, layer) base offsets, about 5 us for a one-block request."""
    if src.num_shards != dst.num_shards:
        raise TransferError(f"{src.num_shards} source shards but {dst.num_shards} destination")
    src_starts, dst_starts, counts = coalesce_runs(src_ids, dst_ids)
    bb = dst.block_bytes
    src_off = np.add.outer(src.layer_bases(bb), src_starts * bb).ravel()
    dst_off = np.add.outer(dst.layer_bases(bb), dst_starts * bb).ravel()
    lengths = np.empty_like(src_off)
    lengths.reshape(-1, counts.size)[:] = counts * bb  # the runs' lengths, every (shard, layer)
    return TransferPlan(src_off, dst_off, lengths)


def _check_token_counts(n_src: int, p: int, n_dst: int, d: int) -> None:
    """Some token count T must need exactly ``n_src`` blocks of ``p`` and ``n_dst`` of ``d``."""
    if n_src and n_dst and max((n_src - 1) * p, (n_dst - 1) * d) >= min(n_src * p, n_dst * d):
        raise TransferError(
            f"{n_src} source blocks of {p} tokens and {n_dst} destination blocks of {d} "
            "tokens hold no common token count"
        )


def _check_ids(
    src_ids: Sequence[int], dst_ids: Sequence[int], src_blocks: int, dst_blocks: int
) -> None:
    if len(src_ids) == 0 or len(dst_ids) == 0:
        raise TransferError("a transfer needs at least one block")
    for name, ids, limit in (("source", src_ids, src_blocks), ("destination", dst_ids, dst_blocks)):
        if min(ids) < 0 or max(ids) >= limit:
            raise TransferError(f"{name} block id out of range [0, {limit}): {list(ids)}")
    if len(set(dst_ids)) != len(dst_ids):
        raise TransferError(f"duplicate destination block ids: {list(dst_ids)}")
