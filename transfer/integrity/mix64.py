"""``mix64``: a block digest computed where the KV bytes live, GPU memory included.

Why: xxh3 (:mod:`pdserve.transfer.integrity.digests`'s default) runs on the CPU, so a CUDA pool's
segments must first be copied to host memory and hashed there; on an H100 that took NIXL's
VRAM -> VRAM pull of 45 MiB from 57 to 3.3 GB/s (docs/benchmarks.md). ``mix64`` is built from
elementwise integer tensor ops and a sum, so it runs on the pool's own device in a few
bandwidth-bound kernels, and gives the same digest on any device (integer arithmetic is exact
and the sum is taken modulo 2**64, so the order of a parallel reduction does not matter).

Definition, per segment of ``L`` bytes (``L`` a multiple of 8), read as little-endian 64-bit
words ``w_0 .. w_{n-1}`` (``n = L / 8``), all arithmetic modulo 2**64::

    h_i    = fmix64(w_i XOR (i + 1) * 0x9E3779B97F4A7C15)
    digest = fmix64((h_0 + h_1 + ... + h_{n-1}) XOR L)

``fmix64`` is MurmurHash3's 64-bit finaliser (``x ^= x >> 33; x *= 0xff51afd7ed558ccd;
x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53; x ^= x >> 33``, logical shifts), a bijection in which
every input bit flips each output bit with probability about 1/2. The word index keys each word,
so moved, swapped or repeated words change the digest; a single changed word changes one
``h_i`` to an unrelated value, which the sum keeps. Like xxh3 it guards against accidents
(corruption, wrong offsets, a source changed under the move), not an adversary.

Speed: eagerly, about twenty elementwise passes over the words; on a GPU :func:`prepare`
(called when a transceiver with a CUDA pool starts) compiles them into one kernel that reads
each word once, and keeps it only after it matched the eager form. Memory: segments are hashed
in chunks of at most :data:`CHUNK_WORDS` words, so the temporaries (a few int64 tensors of the
chunk's size, eagerly) stay bounded next to a GPU pool that fills its memory. Thread-safe once
prepared; torch only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from pdserve.errors import TransferError

log = logging.getLogger(__name__)

NAME = "mix64"
"""The algorithm's name on the wire (:class:`pdserve.transfer.wire.BlockDigests`)."""
CHUNK_WORDS = 2 * 2**20
"""Words hashed per batch of kernels: 16 MiB of KV, about 100 MiB of temporaries eagerly."""


def _signed(v: int) -> int:
    """A 64-bit constant as the int64 torch computes with (two's complement)."""
    return v - (1 << 64) if v >= 1 << 63 else v


_PHI = _signed(0x9E3779B97F4A7C15)
_C1 = _signed(0xFF51AFD7ED558CCD)
_C2 = _signed(0xC4CEB9FE1A85EC53)
_LOW31 = (1 << 31) - 1  # masks an arithmetic >> 33 into a logical one


def digests(memory: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``mix64`` of ``memory``'s byte ranges ``[offsets[k], offsets[k] + lengths[k])``: uint64
    ``[K]``, computed on ``memory``'s device (CPU or CUDA; one host sync at the end), by the
    compiled kernel where :func:`prepare` built one for that device, else eagerly.

    ``memory``: a contiguous tensor of any dtype (its bytes are read, never written); offsets
    and lengths in bytes (int64 arrays). Raises TransferError when a range lies outside
    ``memory`` or an offset or length is not a multiple of 8."""
    if not memory.is_contiguous():
        raise TransferError("KV memory must be contiguous to be digested")
    flat = memory.view(-1).view(torch.uint8)
    offs, lens = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if len(offs) and (offs.min() < 0 or int((offs + lens).max()) > flat.numel()):
        raise TransferError(f"digest segment outside the {flat.numel()}-byte KV memory")
    if ((offs | lens) % 8).any() or flat.numel() % 8 or flat.data_ptr() % 8:
        raise TransferError("mix64 digests need 8-byte aligned segments of whole 8-byte words")
    words = flat.view(torch.int64)
    device = memory.device
    kernel = _COMPILED.get(str(device), _chunk_sums)
    sums = torch.zeros(len(offs), dtype=torch.int64, device=device)
    for chunk in _pieces(offs // 8, lens // 8):
        table = torch.tensor(chunk, dtype=torch.int64).T.contiguous().to(device)
        total = sum(n for _, _, n, _ in chunk)
        sums.index_add_(0, table[0], kernel(words, table, total))
    sums.bitwise_xor_(torch.from_numpy(lens).to(device))
    return _fmix64(sums).cpu().numpy().view(np.uint64).copy()


def _pieces(starts: np.ndarray, counts: np.ndarray) -> list[list[tuple[int, int, int, int]]]:
    """The words to hash, as chunks of pieces ``(segment, first word, words, index of the first
    word within its segment)``, each chunk at most :data:`CHUNK_WORDS` words."""
    chunks: list[list[tuple[int, int, int, int]]] = [[]]
    room = CHUNK_WORDS
    for k, (start, count) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        done = 0
        while done < count:
            if room == 0:
                chunks.append([])
                room = CHUNK_WORDS
            take = min(count - done, room)
            chunks[-1].append((k, start + done, take, done))
            done += take
            room -= take
    return [c for c in chunks if c]


def _chunk_sums(words: torch.Tensor, table: torch.Tensor, total: int) -> torch.Tensor:
    """The sum of ``h_i`` over each piece of one chunk: int64 ``[P]``. ``table`` is int64
    ``[4, P]`` (rows: segment, first word, words, index of the first word in its segment) on
    ``words``' device; ``total`` the chunk's words. Written so that one fused kernel can compute
    it (:func:`prepare`): each word finds its piece by binary search (``bucketize``) and is read
    straight from the pool; only the running sum of the mixed words has the chunk's size."""
    counts = table[2]
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    j = torch.arange(total, dtype=torch.int64, device=words.device)
    piece = torch.bucketize(j, ends, right=True)
    within = j - starts[piece]  # the word's index within its piece
    x = words[table[1][piece] + within] ^ ((within + table[3][piece] + 1) * _PHI)
    # per-piece sums as differences of one running sum (exact modulo 2**64): a scan, where
    # scattering into a few dozen sums would serialise millions of atomic adds on a GPU
    run = torch.cumsum(_fmix64(x), 0)
    before = torch.where(starts > 0, run[(starts - 1).clamp(min=0)], 0)
    return run[ends - 1] - before


def _fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix64 over an int64 tensor (wrapping multiplies; an arithmetic ``>> 33``
    masked into a logical one); out of place, a graph torch.compile fuses."""
    for c in (_C1, _C2):
        x = (x ^ ((x >> 33) & _LOW31)) * c
    return x ^ ((x >> 33) & _LOW31)


_COMPILED: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {}
"""Device -> the compiled :func:`_chunk_sums` that :func:`prepare` built and checked."""


def compiled_devices() -> list[str]:
    """The devices whose digests run the compiled kernel (:func:`prepare` built and checked it)."""
    return sorted(_COMPILED)


def prepare(device: torch.device, *, force: bool = False) -> bool:
    """Compile :func:`_chunk_sums` for a CUDA ``device`` (torch.compile, one fused kernel
    instead of about twenty passes over the words) and check it against the eager form on
    random words, chunk shapes of one and of several pieces; keep it only if every digest
    agrees. Returns whether the compiled kernel is in use. Takes seconds the first time (the
    kernels are cached on disk after). Never raises: a failure is logged and the eager form
    stays. No-op (False) for a CPU device, where xxh3 is used instead, unless ``force``
    (tests: the compiled form checked on the CPU's compiler)."""
    if device.type != "cuda" and not force:
        return False
    key = str(device)
    if key in _COMPILED:
        return True
    try:
        compiled = torch.compile(_chunk_sums, dynamic=True, fullgraph=True)
        g = torch.Generator().manual_seed(0)
        probe = torch.randint(-(2**62), 2**62, (4096,), dtype=torch.int64, generator=g).to(device)
        for offs, lens in ((np.array([0]), np.array([8 * 4096])),
                           (np.array([0, 808, 8000, 24]), np.array([800, 8, 16384, 0])),
                           (np.array([16]), np.array([8]))):  # fmt: skip
            want = digests(probe, offs, lens)
            _COMPILED[key] = compiled
            try:
                got = digests(probe, offs, lens)
            finally:
                del _COMPILED[key]
            if not np.array_equal(got, want):
                log.warning(
                    "mix64: the compiled digest differs from the eager one on %s; "
                    "digests stay eager",
                    device,
                )
                return False
    except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the eager form
        log.warning(
            "mix64: torch.compile failed on %s (%s: %s); digests stay eager",
            device,
            type(exc).__name__,
            exc,
        )
        return False
    _COMPILED[key] = compiled
    log.info("mix64: compiled digest kernel checked and in use on %s", device)
    return True


def reference(data: bytes) -> int:
    """``mix64`` of one segment in plain Python (the definition above, for tests and for
    checking another implementation): ``data``'s length must be a multiple of 8."""
    mask = (1 << 64) - 1

    def fmix(x: int) -> int:
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & mask
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & mask
        return x ^ (x >> 33)

    total = 0
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i : 8 * i + 8], "little")
        total = (total + fmix(w ^ (((i + 1) * 0x9E3779B97F4A7C15) & mask))) & mask
    return fmix(total ^ len(data))
