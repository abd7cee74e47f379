"""The KV cache connector's logic (:mod:`pdserve.workers.kv.offload`) with the scheduler and
a real CPU pool, no model: admission matches the blocks after the pool prefix in the host tier,
then the disk tier, up to the first miss and never the last token; the step loads them into the
admitted sequence's blocks; every full block a step completes is saved once; an evicted cached
block lands in the host tier; a damaged file is computed instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.config.settings import SchedulerSettings
from pdserve.protocol import KVLayout, SamplingParams
from pdserve.workers.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.workers.engine.sequence import Sequence
from pdserve.workers.kv.manager import KVCacheManager
from pdserve.workers.kv.offload import KVConnector
from pdserve.workers.kv.tiers import DiskTier, HostTier

TPB = 4
LAYOUT = KVLayout(
    model="connector-test", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TPB,
    dtype="float32",
)  # fmt: skip


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, TPB, 2, 8, generator=g)  # [num_layers, 2, tpb, kvh, hd]


def seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=4), "full", 64)


class Rig:
    """A pool, its tiers and a scheduler that asks the connector."""

    def __init__(self, tmp: Path | None, num_blocks: int = 32, budget: int = 64) -> None:
        self.kv = KVCacheManager(LAYOUT, num_blocks)
        self.host = HostTier(2**20)
        self.disk = DiskTier(tmp, 2**20, LAYOUT) if tmp is not None else None
        self.conn = KVConnector(self.kv, self.host, self.disk)
        self.sched = Scheduler(
            self.kv,
            SchedulerSettings(max_num_seqs=4, max_num_batched_tokens=budget),
            watermark_blocks=0,
            connector=self.conn.scheduler,
        )

    def hashes(self, s: Sequence) -> list[int]:
        return self.kv.hasher.hash_tokens(s.prompt_token_ids)

    def step(self) -> ScheduledBatch:
        """schedule -> load -> (no forward) -> register -> save, as Engine._step does."""
        batch = self.sched.schedule()
        self.conn.start_step(batch.items)
        self.kv.update_resources(batch.items)
        self.conn.finish_step()
        for s in batch.items:
            s.seq.num_computed_tokens = s.num_kv_tokens_after_step
        return batch

    def close(self) -> None:
        self.conn.shutdown()


@pytest.fixture
def rig(tmp_path: Path):
    r = Rig(tmp_path / "kv")
    yield r
    r.close()


def test_admission_loads_the_tier_blocks_and_computes_only_the_rest(rig: Rig) -> None:
    s = seq("a", 10)  # two full blocks + 2 tokens
    h = rig.hashes(s)
    rig.host.put(h[0], block(0))
    rig.host.put(h[1], block(1))
    rig.sched.add(s)
    (item,) = rig.step().items
    assert (item.start_position, item.num_new_tokens) == (8, 2)
    table = rig.kv.block_table("a")
    assert torch.equal(rig.kv.pool[:, table[0]], block(0))
    assert torch.equal(rig.kv.pool[:, table[1]], block(1))
    assert rig.conn.stats().hit_tokens("host") == 8
    assert rig.kv.match_prefix(h, 100)[1] == 8, "loaded blocks join the prefix index"


def test_a_prompt_of_whole_blocks_still_computes_its_last_block(rig: Rig) -> None:
    s = seq("a", 8)
    for i, digest in enumerate(rig.hashes(s)):
        rig.host.put(digest, block(i))
    rig.sched.add(s)
    (item,) = rig.step().items
    assert (item.start_position, item.num_new_tokens) == (4, 4)


def test_pool_prefix_first_then_host_then_disk_up_to_the_first_miss(rig: Rig) -> None:
    assert rig.disk is not None
    first = seq("first", 5)
    rig.sched.add(first)
    rig.step()  # computes block 0 into the pool (and saves it)
    rig.sched.finish(first)
    s = seq("b", 22)  # five full blocks + 2 tokens
    h = rig.hashes(s)
    rig.host.put(h[1], block(1))
    rig.disk.save(h[2], block(2))
    rig.disk.save(h[4], block(4))  # after the miss at block 3: not used
    assert rig.disk.flush(5.0)
    rig.sched.add(s)
    (item,) = rig.step().items
    assert item.start_position == 12
    table = rig.kv.block_table("b")
    assert torch.equal(rig.kv.pool[:, table[2]], block(2))
    stats = rig.conn.stats()
    assert stats.hit_blocks == {"host": 1, "disk": 1, "remote": 0}
    assert rig.kv.prefix_stats().hit_tokens == 4  # the pool's own hit


def test_each_full_block_a_step_completes_is_saved_once(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "kv", budget=6)
    try:
        assert rig.disk is not None
        s = seq("a", 10)
        h = rig.hashes(s)
        rig.sched.add(s)
        rig.step()  # positions 0..5: block 0 complete
        assert rig.disk.flush(5.0)
        assert rig.disk.path(h[0]).exists() and not rig.disk.path(h[1]).exists()
        rig.step()  # positions 6..9: block 1 complete
        assert rig.disk.flush(5.0)
        table = rig.kv.block_table("a")
        for i in range(2):
            assert torch.equal(rig.disk.load(h[i]), rig.kv.pool[:, table[i]])  # type: ignore[arg-type]
        assert rig.conn.stats().saved_blocks == 2
        other = seq("b", 10)  # the same tokens: nothing new to save
        rig.sched.add(other)
        rig.step()
        assert rig.conn.stats().saved_blocks == 2
    finally:
        rig.close()


def test_an_evicted_cached_block_is_copied_to_the_host_tier() -> None:
    rig = Rig(None, num_blocks=4)
    kv = rig.kv
    s = seq("a", 9)  # 2 full blocks + 1 token
    table = kv.allocate("a", 9)
    for i, b in enumerate(table):
        kv.pool[:, b] = block(10 + i)
    kv.register("a", rig.hashes(s), 9)
    kv.free("a")  # the two full blocks stay cached, evictable
    kv.allocate("filler", 4 * TPB)  # takes every block: evicts both
    h = rig.hashes(s)
    for i in range(2):
        got = rig.host.get(h[i])
        assert got is not None and torch.equal(got, block(10 + i))
    assert rig.host.stats().stored == 2


def test_a_damaged_disk_block_is_computed_instead_and_counted(rig: Rig) -> None:
    assert rig.disk is not None
    s = seq("a", 10)
    h = rig.hashes(s)
    rig.disk.save(h[0], block(0))
    rig.disk.save(h[1], block(1))
    assert rig.disk.flush(5.0)
    path = rig.disk.path(h[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    rig.sched.add(s)
    (item,) = rig.step().items
    assert item.start_position == 4  # block 0 loaded, block 1 computed
    assert rig.conn.stats().disk.corrupt == 1  # type: ignore[union-attr]
    assert rig.disk.flush(5.0)
    assert path.exists(), "the recomputed block is saved again"


def test_the_worker_exports_the_tier_counters(rig: Rig) -> None:
    from pdserve.bench.serving.bench_multiturn import parse_metrics
    from pdserve.workers.roles.worker_metrics import WorkerMetrics

    s = seq("a", 10)
    rig.host.put(rig.hashes(s)[0], block(0))
    rig.sched.add(s)
    rig.step()
    assert rig.disk is not None and rig.disk.flush(5.0)
    metrics = WorkerMetrics("prefill", lambda: None, lambda: 0, kv_tiers=rig.conn.stats)
    got = parse_metrics(metrics.render().decode())
    assert got['pdserve_kv_tier_hit_tokens_total{tier="host"}'] == TPB
    assert got['pdserve_kv_tier_hit_tokens_total{tier="disk"}'] == 0
    assert got['pdserve_kv_tier_stored_blocks_total{tier="disk"}'] == 1  # block 1; 0 was loaded
    assert got['pdserve_kv_tier_blocks{tier="disk"}'] == 1
    assert got['pdserve_kv_tier_corrupt_blocks_total{tier="disk"}'] == 0
    assert got['pdserve_kv_tier_pending_saves{tier="disk"}'] == 0
    assert got['pdserve_kv_tier_errors_total{tier="disk"}'] == 0
    assert not any('tier="remote"' in name for name in got), "the remote tier is off"


def test_the_settings_build_a_connector_only_with_a_tier_and_the_prefix_cache(
    tmp_path: Path,
) -> None:
    from pdserve.config.settings import HOST_CACHE_CUDA_MB, KVCacheSettings
    from pdserve.workers.kv.offload import build_connector

    defaults = KVCacheSettings()
    assert defaults.host_cache_bytes("cpu") == 0, "the CPU pool already is host memory"
    assert defaults.host_cache_bytes("cuda:0") == HOST_CACHE_CUDA_MB * 2**20
    assert build_connector(defaults, KVCacheManager(LAYOUT, 8)) is None
    disk = KVCacheSettings(disk_cache_dir=tmp_path / "kv", disk_cache_mb=0.5)
    no_prefix = KVCacheManager(LAYOUT, 8, prefix_caching=False)
    assert build_connector(disk, no_prefix) is None, "tiers name blocks by prefix-cache hash"
    conn = build_connector(disk.model_copy(update={"host_cache_mb": 1}), KVCacheManager(LAYOUT, 8))
    assert conn is not None and conn.host is not None and conn.disk is not None
    try:
        assert conn.host.capacity_bytes == 2**20 and conn.disk.capacity_bytes == 2**19
        assert (tmp_path / "kv").is_dir()
    finally:
        conn.shutdown()


def test_the_remote_tier_never_logs_a_store_password() -> None:
    from pdserve.workers.kv.remote import redact_url

    assert redact_url("redis://app:s3cret@cache:6379/0") == "redis://app:***@cache:6379/0"
    assert redact_url("rediss://:s3cret@cache/1") == "rediss://:***@cache/1"
    assert redact_url("redis://cache:6379/0") == "redis://cache:6379/0"
