"""Formatter: which bytes of the prefill pool go to which bytes of the decode pool.

Design origin: the TensorRT-LLM seed's *Formatter* (maps the context executor's cache layout to
the generation executor's and refuses what it cannot map). :meth:`Formatter.negotiate` runs once
per connection, at handshake, on both sides:

- equal layouts (:class:`~pdserve.protocol.KVLayout`) -> :class:`IdentityFormatter`: the
  zero-copy path, blocks go byte for byte from the prefill pool into the decode pool;
- layouts that differ only in ``tokens_per_block`` and/or ``dtype``
  (:meth:`KVLayout.can_map_to`) -> :class:`ConvertingFormatter`: the prefill (sending) side
  re-blocks and converts the request's K/V into a *staging buffer* laid out exactly like the
  destination blocks (:mod:`pdserve.transfer.convert`), and the backend sends that buffer;
- anything else (model, layers, KV heads, head size) -> :class:`LayoutMismatchError` naming the
  fields, at handshake, so no request ever reaches a pair that cannot be mapped.

Why convert on the sender: the sender learns the receiver's layout at handshake, so the bytes on
the wire are already in the receiver's layout. The receiver's data path is then the same for
every layout pair (NIXL still does one WRITE into the decode pool's blocks; TCP/UCX still
scatter straight into them), and the decode side never holds a second copy of the prompt.

Pool arithmetic (both sides, see docs/architecture.md "KV cache pool")::

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

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from pdserve.errors import ConfigError, LayoutMismatchError, TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer import convert

_ALIGN = 64
"""Byte alignment of the scratch area behind a staging buffer's output area."""


@dataclass(frozen=True)
class PoolGeometry:
    """Where one worker's pool lies: enough to turn (layer, block) into a byte offset.

    ``base_addr`` is the pool's data pointer (process-local; meaningful to NIXL only),
    ``block_bytes`` = ``layout.block_bytes_per_layer``, ``device`` a torch device string.
    """

    num_layers: int
    num_blocks: int
    block_bytes: int
    base_addr: int = 0
    device: str = "cpu"

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes

    @classmethod
    def from_pool(cls, pool: torch.Tensor, layout: KVLayout) -> PoolGeometry:
        """Check ``pool`` against ``layout`` (shape, dtype, contiguity); raises ConfigError."""
        expected = (layout.num_layers, 2, layout.tokens_per_block, layout.num_kv_heads)
        shape = tuple(pool.shape)
        if (
            pool.dim() != 6
            or (shape[0], *shape[2:5]) != expected
            or shape[5] != layout.head_dim
            or pool.shape[1] <= 0
        ):
            raise ConfigError(
                f"KV pool shape {shape} does not match layout [num_layers={layout.num_layers}, "
                f"num_blocks, 2, {layout.tokens_per_block}, {layout.num_kv_heads}, "
                f"{layout.head_dim}]"
            )
        if str(pool.dtype).removeprefix("torch.") != layout.dtype:
            raise ConfigError(f"KV pool dtype {pool.dtype} != layout dtype {layout.dtype}")
        if not pool.is_contiguous():
            raise ConfigError("KV pool must be one contiguous tensor")
        return cls(
            num_layers=layout.num_layers,
            num_blocks=int(pool.shape[1]),
            block_bytes=layout.block_bytes_per_layer,
            base_addr=int(pool.data_ptr()),
            device=str(pool.device),
        )


def pool_bytes(pool: torch.Tensor) -> memoryview:
    """Writable flat byte view of a contiguous CPU pool (any dtype, bfloat16 included); no copy."""
    if pool.device.type != "cpu":
        raise ConfigError(f"byte streaming needs a CPU pool, got {pool.device}")
    return pool.view(-1).view(torch.uint8).numpy().data.cast("B")


def coalesce_runs(
    src_ids: Sequence[int], dst_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the pairing ``src_ids[i] -> dst_ids[i]`` into maximal runs consecutive on both sides.

    Returns ``(src_starts, dst_starts, counts)``, int64 arrays of equal length R; run ``r`` maps
    src blocks ``src_starts[r] .. +counts[r]`` to dst blocks ``dst_starts[r] .. +counts[r]``.
    Example: src (3,4,5,9) dst (10,11,0,1) -> starts (3,5,9)/(10,0,1), counts (2,1,1).
    """
    src = np.asarray(src_ids, dtype=np.int64)
    dst = np.asarray(dst_ids, dtype=np.int64)
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.append(starts, src.size))
    return src[starts], dst[starts], counts


@dataclass(frozen=True)
class TransferPlan:
    """One request's byte movement: segment ``k`` copies ``lengths[k]`` bytes from byte offset
    ``src_offsets[k]`` of the source memory to ``dst_offsets[k]`` of the decode pool.

    Arrays are int64 of length ``num_layers * num_runs``, layer-major. Offsets are relative to
    each memory's base. On the TCP stream the bytes travel in exactly this order.

    ``source`` is the source memory: ``None`` = the sender's KV pool (identity layouts);
    otherwise a contiguous 1-D ``uint8`` tensor, a staging buffer the converting formatter
    filled in the destination layout (owned by :class:`pdserve.transfer.staging.StagingPool`,
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
            "tokens_per_block and dtype"
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


class ConvertingFormatter(Formatter):
    """Layouts equal but for ``tokens_per_block`` (p -> d) and/or ``dtype``: re-block + convert.

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

    The plan's source is the staging buffer ``[num_layers, n_dst, 2, d, kvh, hd]`` of the
    destination dtype (:meth:`stage`), one run per run of consecutive ``dst_ids``.

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

    def plan(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> TransferPlan:
        p, d = self.src_layout.tokens_per_block, self.dst_layout.tokens_per_block
        n_dst = len(dst_ids)
        _check_token_counts(len(src_ids), p, n_dst, d)
        _check_ids(src_ids, dst_ids, self.src.num_blocks, self.dst.num_blocks)
        staging = PoolGeometry(self.dst.num_layers, n_dst, self.dst.block_bytes)
        return _run_plan(staging, self.dst, range(n_dst), dst_ids)

    def _output_nbytes(self, num_dst_blocks: int) -> int:
        return self.dst.num_layers * num_dst_blocks * self.dst.block_bytes

    def staging_nbytes(self, num_dst_blocks: int) -> int:
        """Output area (destination layout) plus, when the dtype changes, a scratch area of at
        most ``convert.SCRATCH_BYTES`` in the source dtype (the gather lands there in chunks
        before converting)."""
        out = self._output_nbytes(num_dst_blocks)
        if self.src_layout.dtype == self.dst_layout.dtype:
            return out
        return -(-out // _ALIGN) * _ALIGN + self._scratch_nbytes(num_dst_blocks)

    def _out_shape(self, num_dst_blocks: int) -> tuple[int, int, int, int, int, int]:
        dst = self.dst_layout
        return (
            dst.num_layers,
            num_dst_blocks,
            2,
            dst.tokens_per_block,
            dst.num_kv_heads,
            dst.head_dim,
        )

    def _scratch_nbytes(self, num_dst_blocks: int) -> int:
        return convert.scratch_nbytes(
            convert.torch_dtype(self.src_layout.dtype),
            self._out_shape(num_dst_blocks),
            self.src_layout.tokens_per_block,
        )

    def stage(
        self, pool: torch.Tensor, src_ids: Sequence[int], num_dst_blocks: int, buf: torch.Tensor
    ) -> torch.Tensor:
        """Fill ``buf`` (1-D uint8, at least ``staging_nbytes(num_dst_blocks)`` bytes, on the
        pool's device) from ``pool`` (the sender's ``[L, nb, 2, p, kvh, hd]`` pool), for the
        ids the plan was made from. Returns the output area, the first
        ``L * num_dst_blocks * dst_block_bytes`` bytes of ``buf``."""
        n_out = self._output_nbytes(num_dst_blocks)
        shape = self._out_shape(num_dst_blocks)
        out = buf[:n_out].view(convert.torch_dtype(self.dst_layout.dtype)).view(shape)
        scratch = None
        if self.src_layout.dtype != self.dst_layout.dtype:
            start = -(-n_out // _ALIGN) * _ALIGN
            scratch = buf[start : start + self._scratch_nbytes(num_dst_blocks)]
            scratch = scratch.view(convert.torch_dtype(self.src_layout.dtype))
        convert.reblock(pool, src_ids, out, scratch)
        return buf[:n_out]


def _run_plan(
    src: PoolGeometry, dst: PoolGeometry, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> TransferPlan:
    """Identity-shaped plan: block ``src_ids[i]`` of ``src`` -> ``dst_ids[i]`` of ``dst``, blocks
    of ``dst.block_bytes``, one segment per layer per run."""
    src_starts, dst_starts, counts = coalesce_runs(src_ids, dst_ids)
    bb = dst.block_bytes
    layers = np.arange(dst.num_layers, dtype=np.int64)[:, None]
    src_off = (layers * src.num_blocks + src_starts[None, :]) * bb
    dst_off = (layers * dst.num_blocks + dst_starts[None, :]) * bb
    lengths = np.broadcast_to(counts[None, :] * bb, src_off.shape)
    return TransferPlan(src_off.ravel(), dst_off.ravel(), np.ascontiguousarray(lengths).ravel())


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
