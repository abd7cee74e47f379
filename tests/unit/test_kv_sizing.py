"""KV pool sizing: explicit sizes win; otherwise a share of the machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config.settings import KVCacheSettings
from pdserve.protocol import KVLayout
from pdserve.workers.kv import sizing as kv_sizing
from pdserve.workers.kv.sizing import cuda_kv_budget, pool_size

# SmolLM2's shape: 30 layers x 2 x 16 tokens x 3 heads x 64 x 4 bytes = 737,280 bytes a block
LAYOUT = KVLayout(
    model="m", num_layers=30, num_kv_heads=3, head_dim=64, tokens_per_block=16, dtype="float32"
)
BLOCK = 737_280
GIB = 2**30


def test_explicit_block_count_then_bytes_win_over_the_machine() -> None:
    size = pool_size(LAYOUT, KVCacheSettings(num_blocks=7, budget_mb=10), device="cpu")
    assert size.num_blocks == 7
    size = pool_size(LAYOUT, KVCacheSettings(budget_mb=10), device="cpu")
    assert size.num_blocks == 10 * 2**20 // BLOCK == 14  # 10 MiB: 14 whole blocks
    assert size.source == "budget_mb=10"


def test_a_tensor_parallel_block_costs_every_rank_its_shard() -> None:
    """TP=3: each rank holds 1 of the 3 heads, a block id costs the same bytes as at TP=1;
    TP=6 on 3 KV heads replicates each head twice, so a block id costs twice as much."""
    tp3 = KVLayout(**{**LAYOUT.model_dump(), "tp_size": 3})
    tp6 = KVLayout(**{**LAYOUT.model_dump(), "tp_size": 6})
    assert pool_size(tp3, KVCacheSettings(budget_mb=10), device="cpu").num_blocks == 14
    assert pool_size(tp6, KVCacheSettings(budget_mb=10), device="cpu").num_blocks == 7


def test_an_fp8_pool_holds_four_times_float32_and_twice_bfloat16() -> None:
    sizes = {
        dtype: pool_size(
            KVLayout(**{**LAYOUT.model_dump(), "dtype": dtype}),
            KVCacheSettings(budget_mb=64),
            device="cpu",
        ).num_blocks
        for dtype in ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2")
    }
    assert sizes["fp8_e4m3"] == sizes["fp8_e5m2"] == 2 * sizes["bfloat16"] == 4 * sizes["float32"]


def test_cpu_default_is_a_share_of_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_sizing, "available_host_memory", lambda: 8 * GIB)
    size = pool_size(LAYOUT, KVCacheSettings(memory_fraction=0.25), device="cpu")
    assert size.num_blocks == 2 * GIB // BLOCK
    assert "25% of 8.0 GiB available host memory" in size.source


def test_cuda_default_uses_the_profiled_budget() -> None:
    assert cuda_kv_budget(total=80 * GIB, in_use=2 * GIB, peak_step=GIB, utilization=0.9) == int(
        72 * GIB - 3 * GIB
    )
    assert cuda_kv_budget(total=GIB, in_use=GIB, peak_step=GIB, utilization=0.5) == 0
    size = pool_size(
        LAYOUT, KVCacheSettings(memory_fraction=0.25), device="cuda:0", auto_bytes=100 * BLOCK
    )
    assert size.num_blocks == 100 and size.source == "gpu_memory_utilization"


def test_available_memory_is_capped_by_the_cgroup_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "memory.max").write_text(f"{3 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{GIB}\n")
    monkeypatch.setattr(kv_sizing, "_CGROUP_LIMITS", (tmp_path / "memory.max",))
    monkeypatch.setattr(kv_sizing, "_CGROUP_USAGE", (tmp_path / "memory.current",))
    assert kv_sizing.available_host_memory() <= 2 * GIB
    (tmp_path / "memory.max").write_text("max\n")  # no limit: the host's MemAvailable
    assert kv_sizing.available_host_memory() > 0
