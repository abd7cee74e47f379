"""KV cache tiers (:mod:`pdserve.workers.kv.tiers`): the host tier's LRU byte cap; the disk
tier's atomic, digest-checked files (a flipped byte, a truncated file or a file of another
block is removed, counted and a miss), its size cap with LRU cleanup, a second instance on the
same directory (a restart) and its bounded write queue."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve.protocol import KVLayout
from pdserve.workers.kv.tiers import DiskTier, HostTier, block_nbytes

LAYOUT = KVLayout(
    model="tiers-test", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4,
    dtype="float32",
)  # fmt: skip
SHAPE = (2, 2, 4, 2, 8)  # [num_layers, 2, tpb, kvh, hd]


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def disk(tmp_path: Path):
    tier = DiskTier(tmp_path / "kv", 64 * block_nbytes(LAYOUT), LAYOUT)
    yield tier
    tier.close()


def saved(tier: DiskTier, blocks: dict[int, torch.Tensor]) -> None:
    for digest, kv in blocks.items():
        assert tier.save(digest, kv)
    assert tier.flush(10.0)


# --- host tier -------------------------------------------------------------------------------


def test_host_tier_keeps_at_most_its_bytes_and_drops_the_least_recently_used() -> None:
    size = block_nbytes(LAYOUT)
    host = HostTier(2 * size + size // 2)  # room for two blocks
    host.put(1, block(1))
    host.put(2, block(2))
    assert host.get(1) is not None  # 1 is now the most recently used
    host.put(3, block(3))
    assert 2 not in host and 1 in host and 3 in host
    stats = host.stats()
    assert (stats.blocks, stats.bytes, stats.stored, stats.evicted) == (2, 2 * size, 3, 1)
    assert torch.equal(host.get(3), block(3))  # type: ignore[arg-type]


def test_host_tier_refuses_a_block_larger_than_itself() -> None:
    host = HostTier(block_nbytes(LAYOUT) - 1)
    assert not host.put(1, block(1))
    assert host.get(1) is None


# --- disk tier: files ----------------------------------------------------------------------------


def test_a_saved_block_loads_back_equal_from_a_file_named_by_its_hash(disk: DiskTier) -> None:
    digest = 0xABCDEF << 64
    saved(disk, {digest: block(7)})
    names = os.listdir(disk.directory)
    assert names == [f"{digest:032x}.safetensors"]  # no temporary file left behind
    got = disk.load(digest)
    assert got is not None and torch.equal(got, block(7))
    assert disk.load(digest + 1) is None
    stats = disk.stats()
    assert (stats.blocks, stats.stored, stats.corrupt, stats.pending) == (1, 1, 0, 0)
    assert stats.bytes == (disk.directory / names[0]).stat().st_size


def test_a_second_tier_on_the_same_directory_loads_the_blocks_after_a_restart(
    disk: DiskTier,
) -> None:
    saved(disk, {1: block(1), 2: block(2)})
    disk.close()
    again = DiskTier(disk.directory, disk.capacity_bytes, LAYOUT)
    try:
        assert again.stats().blocks == 2
        assert torch.equal(again.load(2), block(2))  # type: ignore[arg-type]
    finally:
        again.close()


def test_a_saved_view_of_a_larger_tensor_is_written_contiguously(disk: DiskTier) -> None:
    pool = torch.randn(2, 5, 2, 4, 2, 8)  # [layers, blocks, ...]: pool[:, 3] is strided
    saved(disk, {5: pool[:, 3]})
    assert torch.equal(disk.load(5), pool[:, 3])  # type: ignore[arg-type]


def _flip_byte_near_the_end(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # inside the tensor data
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "another block", "garbage"])
def test_a_damaged_file_is_a_miss_and_is_removed(disk: DiskTier, damage: str) -> None:
    saved(disk, {1: block(1), 2: block(2)})
    path = disk.path(1)
    if damage == "flipped byte":
        _flip_byte_near_the_end(path)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "another block":
        os.replace(disk.path(2), path)  # the right bytes under the wrong name
    else:
        path.write_bytes(b"\x00" * 100)
    assert disk.load(1) is None
    assert not path.exists()
    assert disk.stats().corrupt == 1
    assert disk.load(1) is None  # now a plain miss
    assert disk.stats().corrupt == 1


def test_a_file_of_another_layout_is_a_miss(disk: DiskTier) -> None:
    other = LAYOUT.model_copy(update={"model": "another-model"})
    foreign = DiskTier(disk.directory, disk.capacity_bytes, other)
    try:
        saved(foreign, {9: block(9)})
    finally:
        foreign.close()
    assert disk.load(9) is None
    assert disk.stats().corrupt == 1


def test_a_stale_temporary_file_is_removed_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir()
    stale = folder / ".0001.safetensors.1.2.tmp"
    stale.write_bytes(b"partial")
    old = stale.stat().st_mtime - 3600
    os.utime(stale, (old, old))
    fresh = folder / ".0002.safetensors.1.2.tmp"  # maybe another worker writing right now
    fresh.write_bytes(b"partial")
    DiskTier(folder, 2**20, LAYOUT).close()
    assert not stale.exists() and fresh.exists()


# --- disk tier: size cap, queue -----------------------------------------------------------------


def test_the_size_cap_holds_and_the_least_recently_used_files_go_first(tmp_path: Path) -> None:
    probe = DiskTier(tmp_path / "probe", 2**20, LAYOUT)
    saved(probe, {1: block(1)})
    file_bytes = probe.stats().bytes
    probe.close()
    cap = 5 * file_bytes + file_bytes // 2  # five files
    tier = DiskTier(tmp_path / "kv", cap, LAYOUT)
    try:
        for digest in range(1, 6):
            saved(tier, {digest: block(digest)})
            t = os.stat(tier.path(digest)).st_mtime_ns - 10**9 * (10 - digest)
            os.utime(tier.path(digest), ns=(t, t))  # distinct, increasing mtimes
        for digest in range(6, 12):
            assert tier.load(1) is not None  # touched: now the most recently used
            saved(tier, {digest: block(digest)})
            total = sum(p.stat().st_size for p in tier.directory.iterdir())
            assert total <= cap
        assert tier.path(1).exists(), "a block loaded again and again outlives the others"
        assert not tier.path(2).exists()
        assert tier.path(11).exists()
        stats = tier.stats()
        assert stats.evicted >= 6 and stats.bytes <= cap
    finally:
        tier.close()


def test_a_full_write_queue_drops_the_save_and_counts_it(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "kv", 2**20, LAYOUT, max_pending_bytes=block_nbytes(LAYOUT) - 1)
    try:
        assert not tier.save(1, block(1))
        assert tier.stats().dropped == 1
        assert tier.flush(5.0) and tier.load(1) is None
    finally:
        tier.close()


def test_a_queued_block_is_served_before_it_is_written_and_close_writes_it(
    tmp_path: Path,
) -> None:
    tier = DiskTier(tmp_path / "kv", 2**20, LAYOUT)
    assert tier.save(3, block(3))
    assert not tier.save(3, block(3))  # already queued or written
    got = tier.load(3)
    assert got is not None and torch.equal(got, block(3))
    tier.close()
    tier.close()  # idempotent
    assert tier.path(3).exists()
    assert not tier.save(4, block(4))  # closed
