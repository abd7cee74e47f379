"""``mix64``: a block digest computed where the KV bytes live, GPU memory included.

Why: xxh3 (:mod:`pdserve.transfer.integrity`'s default) runs on the CPU, so a CUDA pool's
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

Memory: segments are hashed in chunks of at most :data:`CHUNK_WORDS` words, so the temporaries
(about four int64 tensors of the chunk's size) stay bounded next to a GPU pool that fills its
memory. Stateless and thread-safe; torch only.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.errors import TransferError

NAME = "mix64"
"""The algorithm's name on the wire (:class:`pdserve.transfer.wire.BlockDigests`)."""
CHUNK_WORDS = 4 * 2**20
"""Words hashed per batch of kernels: 32 MiB of KV, about 128 MiB of temporaries."""


def _signed(v: int) -> int:
    """A 64-bit constant as the int64 torch computes with (two's complement)."""
    return v - (1 << 64) if v >= 1 << 63 else v


_PHI = _signed(0x9E3779B97F4A7C15)
_C1 = _signed(0xFF51AFD7ED558CCD)
_C2 = _signed(0xC4CEB9FE1A85EC53)
_LOW31 = (1 << 31) - 1  # masks an arithmetic >> 33 into a logical one


def _fmix64_(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix64 over an int64 tensor, in place (wrapping multiplies)."""
    for c in (_C1, _C2):
        x.bitwise_xor_(torch.bitwise_right_shift(x, 33).bitwise_and_(_LOW31))
        x.mul_(c)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 33).bitwise_and_(_LOW31))


def digests(memory: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``mix64`` of ``memory``'s byte ranges ``[offsets[k], offsets[k] + lengths[k])``: uint64
    ``[K]``, computed on ``memory``'s device (CPU or CUDA; one host sync at the end).

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
    sums = torch.zeros(len(offs), dtype=torch.int64, device=memory.device)
    pieces = _pieces(offs // 8, lens // 8)
    for chunk in pieces:
        _sum_chunk(words, chunk, sums)
    sums.bitwise_xor_(torch.from_numpy(lens).to(memory.device))
    return _fmix64_(sums).cpu().numpy().view(np.uint64).copy()


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


def _sum_chunk(
    words: torch.Tensor, pieces: list[tuple[int, int, int, int]], sums: torch.Tensor
) -> None:
    """Add the ``h_i`` of ``pieces``' words to ``sums[segment]`` (modulo 2**64)."""
    device = words.device
    x = torch.cat([words[first : first + n] for _, first, n, _ in pieces])
    counts = torch.tensor([n for _, _, n, _ in pieces], dtype=torch.int64)
    # the index of each word within its segment, plus one: piece base + position in the piece
    base = torch.tensor([at + 1 for *_, at in pieces], dtype=torch.int64)
    piece_start = torch.zeros_like(counts)
    torch.cumsum(counts[:-1], 0, out=piece_start[1:])
    total = int(counts.sum())
    shift = (base - piece_start).to(device)
    counts_d = counts.to(device)
    index = torch.arange(total, dtype=torch.int64, device=device)
    index.add_(torch.repeat_interleave(shift, counts_d, output_size=total))
    x.bitwise_xor_(index.mul_(_PHI))
    _fmix64_(x)
    segment = torch.tensor([k for k, *_ in pieces], dtype=torch.int64).to(device)
    sums.index_add_(0, torch.repeat_interleave(segment, counts_d, output_size=total), x)


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
