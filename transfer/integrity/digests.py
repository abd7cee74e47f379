"""Block digests: the sender's record of the KV bytes it moved, checked where they landed.

Design origin: the requirement that each transferred block carry a digest checked on arrival (a
mismatch fails the request), and the end-to-end argument: whatever the backend (TCP stream, NIXL/UCX
one-sided WRITE, ucxx send/recv), the only check that covers the whole path is one computed over
the source memory and over the destination memory after the bytes landed.

When: where the bytes are touched anyway (:class:`SegmentDigests`, computed group by group).
TCP hashes each ~256 KiB group of segments right before the socket reads it and right after
the socket wrote it, while those bytes are in the CPU's cache, so hashing costs a cache pass, not a
second trip to memory; NIXL and UCX write pool to pool, so both sides hash after the WRITE, at
the same time (the sender right after TransferDone, the receiver on its landed bytes). A
digest taken after the move still covers the bytes that left: the parked source blocks cannot
change while they are sent (fencing), and if one did, the digests differ.

Unit of a digest: one **transfer-plan segment** (:class:`~pdserve.transfer.formatter.mapping.TransferPlan`),
i.e. one layer of one run of blocks consecutive on both sides::

    plan segment k = layer (k // runs), run (k % runs)      (layer-major, as the formatter emits)
    sender:   xxh3_64(src_pool_bytes[src_offsets[k] : src_offsets[k] + lengths[k]])
    receiver: xxh3_64(dst_pool_bytes[dst_offsets[k] : dst_offsets[k] + lengths[k]])

One hash call per contiguous range, so a request costs ``num_layers * num_runs`` calls (about
0.25 us each) plus the hashing itself, never a Python call per block per layer. Measured on the
2-core dev machine (AMD EPYC, AVX-512): xxh3_64 hashes about 100 GB/s from L2 and 54 GB/s
over 16 MiB warm in cache, far less from DRAM, which is why the digests ride along the move. Both sides derive the same plan from the same block ids (the
formatter is deterministic), so segment k names the same bytes on both sides. A mismatch is
reported with the layer and the decode (and prefill) block ids of the segment, which is as
precise as the digest granularity allows; a single block run is always named exactly.

Wire form: ``len(plan)`` digests as little-endian uint64, base64 in
:class:`~pdserve.transfer.wire.BlockDigests` (8 bytes per segment; a SmolLM2 request of one run
is 30 segments, 320 characters).

What it guards against: bytes corrupted on the way (a NIC, a proxy, a backend bug, a wrong
offset) and a source block that changed under the transfer. What it does not: an attacker on
the unauthenticated control connection, who could rewrite the digest frame as well (xxh3 is
not cryptographic, and the connection is not authenticated either).

Thread-safety: stateless apart from the pool view; call from the transceiver's event loop.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import xxhash

from pdserve.errors import IntegrityError, TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer.formatter.hoststage import HostStage, byte_view, packed_offsets
from pdserve.transfer.formatter.mapping import PoolGeometry, TransferPlan, pool_bytes
from pdserve.transfer.integrity import mix64

ALGORITHM = "xxh3_64"
"""The default digest of every segment (python-xxhash ``xxh3_64``, seed 0), computed on the CPU."""
ALGORITHMS = (ALGORITHM, mix64.NAME)
"""Every digest a sender computes when asked (:class:`pdserve.transfer.wire.SendBlocks`)."""


def choose_algorithm(local_device: str, peer_device: str, *layouts: KVLayout) -> str:
    """The digest the pulling (decode) side asks for, by where both pools live (``cpu``,
    ``cuda``) and their ``layouts``: :mod:`pdserve.transfer.integrity.mix64` when both are on a GPU
    (computed there, no copy to the host) and every layout's block of one layer is whole 8-byte
    words (so is every plan segment and its offset, which mix64 needs; any head_dim of 4 or more
    gives it), else xxh3 (on a CPU xxh3 is about 3x faster than compiled mix64, 15-25x than
    eager mix64; a GPU side of a mixed pair stages through pinned memory as before)."""
    words = all(layout.block_bytes_per_layer % 8 == 0 for layout in layouts)
    return mix64.NAME if local_device == peer_device == "cuda" and words else ALGORITHM


_DIGEST = np.dtype("<u8")


def segment_digests(buf: memoryview, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """xxh3_64 of ``buf[offsets[k] : offsets[k] + lengths[k]]`` for every k: uint64 ``[K]``.

    ``buf`` is a flat byte view (``memoryview`` of format ``B``); offsets and lengths are in
    bytes. Raises TransferError when a segment lies outside ``buf``."""
    offs, lens = offsets.tolist(), lengths.tolist()
    if offs and (min(offs) < 0 or max(o + n for o, n in zip(offs, lens, strict=True)) > len(buf)):
        raise TransferError(f"digest segment outside the {len(buf)}-byte KV pool")
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter(
        (digest(buf[o : o + n]) for o, n in zip(offs, lens, strict=True)),
        dtype=_DIGEST,
        count=len(offs),
    )


def encode(digests: np.ndarray) -> str:
    """uint64 digests -> base64 of their little-endian bytes (the wire form)."""
    return base64.b64encode(digests.astype(_DIGEST, copy=False).tobytes()).decode()


def decode(text: str, count: int) -> np.ndarray:
    """The wire form -> uint64 ``[count]``. Raises TransferError when it is not ``count``
    digests (a sender that planned another transfer, or a garbled frame)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise TransferError(f"malformed block digests: {exc}") from exc
    if len(raw) != count * _DIGEST.itemsize:
        raise TransferError(
            f"peer sent {len(raw) // _DIGEST.itemsize} block digests for a {count}-segment plan"
        )
    return np.frombuffer(raw, dtype=_DIGEST)


DIGEST_GROUP_BYTES = 256 * 1024
"""Bytes of plan segments hashed per step where hashing rides along a stream (TCP): a group is
still in the CPU's L2 cache when the socket copy reads it (or right after it wrote it), and a
step costs one system call's worth of Python. Measured on the 2-core AMD EPYC (1 MiB L2),
SmolLM2 pulls between two processes, digests on: 24 blocks (17 MB) 3.4-3.9 ms with 256 KiB
groups, the same as digests off (3.6-4.4 ms), against 5.4-6.0 ms with 1 MiB groups (a group
larger than L2 is read from memory twice) and one block 0.24 ms against 0.46-0.51 ms with a
group per 24 KiB segment (a system call each)."""


def digest_groups(lengths: np.ndarray, group_bytes: int = DIGEST_GROUP_BYTES) -> list[int]:
    """Split segments ``0..K-1`` into consecutive groups of about ``group_bytes`` (at least
    one segment each): the end index of every group, ascending, the last equal to ``K``."""
    ends: list[int] = []
    total = 0
    for k, n in enumerate(lengths.tolist()):
        total += n
        if total >= group_bytes:
            ends.append(k + 1)
            total = 0
    if not ends or ends[-1] != len(lengths):
        ends.append(len(lengths))
    return ends


class SegmentDigests:
    """The digests of one plan's segments in one memory (the sender's source or the
    receiver's pool), computed group by group where the bytes are touched anyway (TCP: each
    group right before the socket reads it, or right after the socket wrote it), or all at
    once by :meth:`finish` (NIXL, UCX: after the one-sided WRITE).

    ``update(stop)`` hashes segments ``done..stop-1``; :meth:`finish` hashes what is left and
    returns uint64 ``[K]``. ``algorithm``: one of :data:`ALGORITHMS`. Owned by one transfer;
    not thread-safe.
    """

    def __init__(
        self,
        digester: BlockDigester,
        memory: torch.Tensor,
        offsets: np.ndarray,
        lengths: np.ndarray,
        algorithm: str = ALGORITHM,
    ):
        self._digester = digester
        self._memory = memory
        self._offsets = offsets
        self._lengths = lengths
        self.algorithm = algorithm
        self.values = np.zeros(len(lengths), dtype=_DIGEST)
        self.done = 0

    def update(self, stop: int) -> None:
        """Hash segments ``done .. stop - 1`` (no-op when ``stop <= done``)."""
        start = self.done
        if stop > start:
            self.values[start:stop] = self._digester.digests(
                self._memory, self._offsets[start:stop], self._lengths[start:stop], self.algorithm
            )
            self.done = stop

    def finish(self) -> np.ndarray:
        """Every segment's digest (hashing the rest first)."""
        self.update(len(self._lengths))
        return self.values


class BlockDigester:
    """Digests over one worker's KV pool; one per transceiver.

    ``pool`` is the worker's contiguous pool tensor (any dtype); it is read, never written, and
    must outlive the digester. xxh3 (the default): CPU memory is hashed in place; CUDA memory
    is first copied segment by segment into pinned host memory
    (:mod:`pdserve.transfer.formatter.hoststage`; one D2H copy per segment, a blocking wait of about
    ``nbytes / 20 GB/s``), then hashed: the same digests as for the same bytes on CPU, so CPU
    and CUDA workers check each other. For a pool on another device type every call raises
    TransferError (switch integrity off with ``TransferSettings.integrity=False``). mix64
    (:mod:`pdserve.transfer.integrity.mix64`, what two GPU pools agree on: :func:`choose_algorithm`):
    computed on the pool's own device, also device-independent.
    """

    def __init__(self, pool: torch.Tensor) -> None:
        self._pool = pool
        self._stage = HostStage(pool.device) if pool.device.type == "cuda" else None
        self._bytes = pool_bytes(pool) if pool.device.type == "cpu" else None

    def prepare(self) -> bool:
        """Get the pool's device ready to digest (:func:`pdserve.transfer.integrity.mix64.prepare`: on a
        GPU, compile and check mix64's kernel; seconds, once per process). Whether the compiled
        kernel is in use; never raises."""
        return mix64.prepare(self._pool.device)

    def source(self, plan: TransferPlan, algorithm: str = ALGORITHM) -> str:
        """Sender side, before any byte of ``plan`` moves: the wire form of the digests of its
        source segments (``plan.src_offsets``) in the memory the backend sends from: the pool,
        or ``plan.source`` (a converting formatter's staging buffer, already filled)."""
        return encode(self.at_source(plan, algorithm).finish())

    def at_source(self, plan: TransferPlan, algorithm: str = ALGORITHM) -> SegmentDigests:
        """Sender side: the digests of ``plan``'s source segments, to be computed as they are
        sent (:class:`SegmentDigests`), in the memory the backend sends from: the pool, or
        ``plan.source`` (a converting formatter's staging buffer, already filled). The
        parked blocks do not change while they are sent (fencing), so a digest computed
        while or after a segment moves covers the bytes that left."""
        memory = self._pool if plan.source is None else plan.source
        return SegmentDigests(self, memory, plan.src_offsets, plan.lengths, algorithm)

    def landed(self, plan: TransferPlan, algorithm: str = ALGORITHM) -> SegmentDigests:
        """Receiver side: the digests of ``plan``'s destination segments in this pool, to be
        computed as they land (:class:`SegmentDigests`)."""
        return SegmentDigests(self, self._pool, plan.dst_offsets, plan.lengths, algorithm)

    def check(
        self,
        plan: TransferPlan,
        digests: str,
        *,
        request_id: str,
        geometry: PoolGeometry,
        block_map: Mapping[int, int],
        landed: SegmentDigests | None = None,
    ) -> None:
        """Receiver side, after every byte of ``plan`` landed: compare the destination segments
        (``plan.dst_offsets`` in the pool) with the sender's ``digests`` (wire form).

        ``geometry`` is this (destination) pool's; ``block_map`` maps a destination block id to
        the prefill block id it was filled from (for the message only); ``landed``: this
        pool's digests of the plan, maybe computed in part as the bytes landed
        (:meth:`landed`; default: all computed now). Raises IntegrityError naming the request,
        the layer and the blocks of the first differing segment; raises TransferError for
        digests that do not fit the plan."""
        expected = decode(digests, len(plan))
        landed = landed or self.landed(plan)
        actual = landed.finish()
        bad = np.flatnonzero(actual != expected)
        if bad.size == 0:
            return
        k = int(bad[0])
        where = describe_segment(
            int(plan.dst_offsets[k]), int(plan.lengths[k]), geometry, block_map
        )
        raise IntegrityError(
            f"KV integrity check failed for request {request_id}: {where} arrived corrupted "
            f"({landed.algorithm} {int(actual[k]):#018x}, the prefill worker digested "
            f"{int(expected[k]):#018x}); {bad.size} of {len(plan)} segments differ"
        )

    def digests(
        self,
        memory: torch.Tensor,
        offsets: np.ndarray,
        lengths: np.ndarray,
        algorithm: str = ALGORITHM,
    ) -> np.ndarray:
        """``algorithm`` digests of ``memory``'s segments (uint64 ``[K]``); ``memory`` is the
        pool or a staging buffer. Raises TransferError (a segment outside it, memory on a device
        that cannot be hashed, an unknown algorithm)."""
        if algorithm == mix64.NAME:
            return mix64.digests(memory, offsets, lengths)
        if algorithm != ALGORITHM:
            raise TransferError(f"unknown KV digest algorithm {algorithm!r}")
        if memory.device.type == "cpu":
            buf = self._bytes if memory is self._pool else pool_bytes(memory)
            assert buf is not None
            return segment_digests(buf, offsets, lengths)
        if self._stage is None or memory.device != self._stage.device:
            raise TransferError(
                f"KV block digests need CPU or CUDA memory, this KV data is on {memory.device}; "
                "switch transfer integrity off (--no-kv-integrity) for it"
            )
        host = self._stage.gather_now(byte_view(memory), offsets, lengths)
        return segment_digests(pool_bytes(host), packed_offsets(lengths), lengths)


def describe_segment(
    offset: int, length: int, geometry: PoolGeometry, block_map: Mapping[int, int]
) -> str:
    """Name the blocks a segment of ``geometry``'s pool covers, e.g. ``"layer 2, decode blocks
    [10, 11] (prefill blocks [3, 4])"`` (``"rank 1, layer 2, ..."`` in a tensor parallel pool). ``block_map``: local block id -> peer block id."""
    shard, offset = divmod(offset, geometry.shard_nbytes)
    stride = geometry.num_blocks * geometry.block_bytes
    layer, start = divmod(offset, stride)
    first = start // geometry.block_bytes
    last = (start + max(length, 1) - 1) // geometry.block_bytes
    local = list(range(first, last + 1))
    text = f"layer {layer}, decode block{'s' if len(local) > 1 else ''} {_ids(local)}"
    if geometry.num_shards > 1:
        text = f"rank {shard}, {text}"
    peer = [block_map[b] for b in local if b in block_map]
    if peer:
        text += f" (prefill block{'s' if len(peer) > 1 else ''} {_ids(peer)})"
    return text


def _ids(ids: Sequence[int]) -> str:
    return str(ids[0]) if len(ids) == 1 else str(list(ids))
