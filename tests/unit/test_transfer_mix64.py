"""``mix64``, the block digest two GPU pools agree on: the torch implementation equals the
definition written out in plain Python (chunked or not), catches a flipped bit, swapped words
and swapped segments, refuses ranges it cannot read, and is what the pulling side asks for
exactly when both pools are on a GPU. (On CUDA memory: tests/gpu/test_transfer_cuda.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.errors import IntegrityError, TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer.formatter.mapping import Formatter, PoolGeometry
from pdserve.transfer.integrity import mix64
from pdserve.transfer.integrity.digests import (
    ALGORITHM,
    ALGORITHMS,
    BlockDigester,
    choose_algorithm,
)
from tests.support.transfer import apply_plan, pattern_pool, zeros_pool


def _memory(n_bytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=g)


SEGMENTS = (np.array([0, 800, 8, 4096, 9992]), np.array([800, 0, 64, 5896, 8]))
"""Offsets and lengths (bytes): long, empty, short, overlapping, last word of the memory."""


def _reference(mem: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> list[int]:
    raw = mem.numpy().tobytes()
    return [mix64.reference(raw[o : o + n]) for o, n in zip(offsets, lengths, strict=True)]


def test_the_tensor_form_equals_the_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    mem = _memory(10000)
    want = _reference(mem, *SEGMENTS)
    assert mix64.digests(mem, *SEGMENTS).tolist() == want
    assert mix64.digests(mem.view(torch.float32), *SEGMENTS).tolist() == want  # any dtype
    monkeypatch.setattr(mix64, "CHUNK_WORDS", 7)  # segments split across chunks
    assert mix64.digests(mem, *SEGMENTS).tolist() == want
    assert mix64.digests(mem, np.array([], dtype=np.int64), np.array([], dtype=np.int64)).size == 0


def test_a_flipped_bit_changes_only_its_segments_digest() -> None:
    mem = _memory(4096)
    offsets, lengths = np.arange(0, 4096, 512), np.full(8, 512)
    before = mix64.digests(mem, offsets, lengths)
    for byte, bit in ((0, 0), (1000, 7), (4095, 3)):
        flipped = mem.clone()
        flipped[byte] ^= 1 << bit
        after = mix64.digests(flipped, offsets, lengths)
        changed = np.flatnonzero(after != before).tolist()
        assert changed == [byte // 512]


def test_moved_words_and_swapped_segments_change_the_digests() -> None:
    mem = _memory(2048)
    offsets, lengths = np.array([0, 1024]), np.array([1024, 1024])
    before = mix64.digests(mem, offsets, lengths)
    words = mem.view(torch.int64).clone()
    words[[3, 4]] = words[[4, 3]]  # two words of segment 0 trade places: same multiset
    swapped = mix64.digests(words, offsets, lengths)
    assert swapped[0] != before[0] and swapped[1] == before[1]
    halves = torch.cat([mem[1024:], mem[:1024]])  # the two segments trade places
    assert mix64.digests(halves, offsets, lengths).tolist() == before[::-1].tolist()
    # ... which a check of the plan's order catches: each segment's digest is now the other's
    assert (mix64.digests(halves, offsets, lengths) != before).all()


def test_ranges_it_cannot_read_are_refused() -> None:
    mem = _memory(1024)
    with pytest.raises(TransferError, match="outside"):
        mix64.digests(mem, np.array([1000]), np.array([32]))
    with pytest.raises(TransferError, match="8-byte"):
        mix64.digests(mem, np.array([4]), np.array([16]))
    with pytest.raises(TransferError, match="8-byte"):
        mix64.digests(mem, np.array([0]), np.array([12]))
    with pytest.raises(TransferError, match="unknown KV digest algorithm"):
        BlockDigester(mem).digests(mem, np.array([0]), np.array([8]), "md5")


def test_both_pools_on_a_gpu_choose_mix64_any_cpu_side_keeps_xxh3() -> None:
    assert ALGORITHMS == ("xxh3_64", "mix64") and ALGORITHM == "xxh3_64"
    layout = KVLayout(
        model="m", num_layers=2, num_kv_heads=1, head_dim=3, tokens_per_block=1, dtype="fp8_e4m3"
    )
    assert layout.block_bytes_per_layer == 6  # not whole words: segments mix64 cannot read
    wide = layout.model_copy(update={"head_dim": 4})
    assert choose_algorithm("cuda", "cuda") == "mix64"
    assert choose_algorithm("cuda", "cuda", wide, wide) == "mix64"
    assert choose_algorithm("cuda", "cuda", wide, layout) == "xxh3_64"
    for pair in (("cpu", "cpu"), ("cpu", "cuda"), ("cuda", "cpu")):
        assert choose_algorithm(*pair, wide, wide) == "xxh3_64"


def test_a_corrupted_move_fails_the_mix64_check_naming_the_block() -> None:
    layout = KVLayout(
        model="m", num_layers=3, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float32"
    )
    src, dst = pattern_pool(layout, 12), zeros_pool(layout, 12)
    formatter = Formatter.negotiate(
        layout, layout, PoolGeometry.from_pool(src, layout), PoolGeometry.from_pool(dst, layout)
    )
    plan = formatter.plan([3, 4], [7, 8])
    digests = BlockDigester(src).source(plan, "mix64")
    apply_plan(plan, src, dst)
    check = BlockDigester(dst)
    geometry = PoolGeometry.from_pool(dst, layout)
    landed = check.landed(plan, "mix64")
    check.check(plan, digests, request_id="r", geometry=geometry, block_map={7: 3, 8: 4},
                landed=landed)  # fmt: skip
    dst.view(-1).view(torch.uint8)[int(plan.dst_offsets[0]) + 5] ^= 0x01
    with pytest.raises(IntegrityError, match=r"request r: layer 0, decode blocks \[7, 8\].*mix64"):
        check.check(plan, digests, request_id="r", geometry=geometry, block_map={7: 3, 8: 4},
                    landed=check.landed(plan, "mix64"))  # fmt: skip
    # intact bytes checked by xxh3 against mix64 digests fail: the algorithms never mix silently
    apply_plan(plan, src, dst)
    with pytest.raises(IntegrityError):
        check.check(plan, digests, request_id="r", geometry=geometry, block_map={})


def test_the_compiled_kernel_equals_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU transceiver's start does (``prepare``: torch.compile, then a check against the
    eager form), here on the CPU's compiler: one graph for every chunk shape, the same digests."""
    monkeypatch.setattr(mix64, "_COMPILED", {})
    cpu = torch.device("cpu")
    assert not mix64.prepare(cpu)  # CPU pools use xxh3: nothing to compile
    assert mix64.prepare(cpu, force=True)
    assert "cpu" in mix64._COMPILED
    mem = _memory(10000, seed=3)
    assert mix64.digests(mem, *SEGMENTS).tolist() == _reference(mem, *SEGMENTS)
    monkeypatch.setattr(mix64, "CHUNK_WORDS", 7)
    assert mix64.digests(mem, *SEGMENTS).tolist() == _reference(mem, *SEGMENTS)
