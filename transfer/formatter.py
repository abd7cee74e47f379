"""Formatter: which bytes of the prefill pool go to which bytes of the decode pool.

Design origin: the TensorRT-LLM seed's *Formatter* (maps the context executor's cache layout to
the generation executor's and refuses what it cannot map). Today only the identity mapping
exists: both sides must have equal :class:`~pdserve.protocol.KVLayout`; anything else is refused
at handshake with :class:`~pdserve.errors.LayoutMismatchError` naming the differing fields.
Block-size, dtype or head-split conversions are further :class:`Formatter` subclasses chosen in
:meth:`Formatter.negotiate`.

Pool arithmetic (both sides, see docs/architecture.md "KV cache pool")::

    pool[num_layers, num_blocks, 2, tpb, kvh, hd]   one contiguous tensor
    byte offset of (layer, block) = (layer * num_blocks + block) * block_bytes
                                                     block_bytes = layout.block_bytes_per_layer
      layer 0: | b0 | b1 | b2 | ... | b(nb-1) |
      layer 1: | b0 | b1 | b2 | ... | b(nb-1) |   <- layer stride = num_blocks * block_bytes

A run of consecutive ids on BOTH sides (src 7,8,9 -> dst 2,3,4) is one contiguous range per
layer on each side, so a transfer is ``num_layers * num_runs`` segments, never one per block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.errors import ConfigError, LayoutMismatchError, TransferError
from pdserve.protocol import KVLayout


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
    ``src_offsets[k]`` of the prefill pool to ``dst_offsets[k]`` of the decode pool.

    Arrays are int64 of length ``num_layers * num_runs``, layer-major. Offsets are relative to
    each pool's base. On the TCP stream the bytes travel in exactly this order.
    """

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(self.lengths.size)


class Formatter(ABC):
    """Maps blocks of a prefill (src) pool onto blocks of a decode (dst) pool.

    Created once per connection by :meth:`negotiate` at handshake; pure and stateless after
    that, so both sides compute the same :class:`TransferPlan` from the same ids.
    """

    def __init__(self, src: PoolGeometry, dst: PoolGeometry):
        self.src = src
        self.dst = dst

    @staticmethod
    def negotiate(
        src_layout: KVLayout, dst_layout: KVLayout, src: PoolGeometry, dst: PoolGeometry
    ) -> Formatter:
        """Pick the formatter that maps ``src_layout`` onto ``dst_layout``.

        Raises LayoutMismatchError, naming the differing fields, for any pair it cannot map
        (today: any pair that is not equal).
        """
        if src_layout == dst_layout:
            return IdentityFormatter(src, dst)
        raise LayoutMismatchError(
            f"KV layouts differ (prefill vs decode): {src_layout.describe_mismatch(dst_layout)}; "
            "no formatter converts between them"
        )

    @abstractmethod
    def plan(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> TransferPlan:
        """Segments moving block ``src_ids[i]`` to block ``dst_ids[i]`` in every layer.

        Raises TransferError for unequal lengths, out-of-range or duplicate destination ids.
        """


class IdentityFormatter(Formatter):
    """Equal layouts: block ``s`` of layer ``l`` is copied byte for byte into block ``d``."""

    def plan(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> TransferPlan:
        _check_ids(src_ids, dst_ids, self.src.num_blocks, self.dst.num_blocks)
        src_starts, dst_starts, counts = coalesce_runs(src_ids, dst_ids)
        bb = self.src.block_bytes
        layers = np.arange(self.src.num_layers, dtype=np.int64)[:, None]
        src_off = (layers * self.src.num_blocks + src_starts[None, :]) * bb
        dst_off = (layers * self.dst.num_blocks + dst_starts[None, :]) * bb
        lengths = np.broadcast_to(counts[None, :] * bb, src_off.shape)
        return TransferPlan(src_off.ravel(), dst_off.ravel(), np.ascontiguousarray(lengths).ravel())


def _check_ids(
    src_ids: Sequence[int], dst_ids: Sequence[int], src_blocks: int, dst_blocks: int
) -> None:
    if len(src_ids) != len(dst_ids):
        raise TransferError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if len(src_ids) == 0:
        raise TransferError("a transfer needs at least one block")
    for name, ids, limit in (("source", src_ids, src_blocks), ("destination", dst_ids, dst_blocks)):
        if min(ids) < 0 or max(ids) >= limit:
            raise TransferError(f"{name} block id out of range [0, {limit}): {list(ids)}")
    if len(set(dst_ids)) != len(dst_ids):
        raise TransferError(f"duplicate destination block ids: {list(dst_ids)}")
