"""The KV cache connector with the engine (tiny model, eager): blocks saved to the disk tier by
one worker process are loaded by another after a restart and the greedy output equals a cold
run; a flipped byte in a saved file is detected, the file removed and the block recomputed (and
saved again); a host tier hit after the pool evicted the blocks; the disk tier's size cap holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.engine import Engine
from tests.support.engine import complete, make_engine

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXTS = [
    "The disk tier keeps KV blocks across restarts of every worker on this host. " * 2,
    "A block found in a tier is loaded into the pool instead of being computed again. " * 2,
    "Zebras graze quietly while the evening light fades over the open savanna plain. " * 2,
    "Seven copper kettles whistled in the crowded kitchen of the old mountain hotel. " * 2,
]


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = make_engine(tiny_model_dir, compile=False, prefix_caching=False)
    yield engine
    engine.shutdown()


def prompt(engine: Engine, i: int) -> list[int]:
    return list(engine.tokenizer.encode(TEXTS[i], add_special_tokens=False))


def tier_engine(model_dir: Path, **settings: object) -> Engine:
    return make_engine(model_dir, compile=False, **settings)


def expected_hit(tokens: list[int], tpb: int) -> int:
    """Tokens a fully cached prompt loads: every full block below its last token."""
    return (len(tokens) - 1) // tpb * tpb


def test_blocks_saved_by_one_worker_process_are_loaded_by_another_after_a_restart(
    tiny_model_dir: Path, cold: Engine, tmp_path: Path
) -> None:
    tokens = prompt(cold, 0)
    want = complete(cold, "cold-restart", tokens, GREEDY).token_ids

    def worker_process() -> dict[str, object]:
        argv = [sys.executable, "-m", "tests.support.kv_connector_child",
                str(tiny_model_dir), str(tmp_path / "kv"), json.dumps(tokens)]  # fmt: skip
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        return report

    first, second = worker_process(), worker_process()
    assert first["tokens"] == second["tokens"] == want
    fed = len(tokens) + GREEDY.max_tokens - 1  # the last sampled token is never fed
    assert first["disk_hit_tokens"] == 0 and first["saved_blocks"] == fed // 4
    assert second["disk_hit_tokens"] == expected_hit(tokens, 4)
    assert second["corrupt"] == 0


def test_a_flipped_byte_in_a_saved_file_is_detected_removed_and_recomputed(
    tiny_model_dir: Path, cold: Engine, tmp_path: Path
) -> None:
    tokens = prompt(cold, 1)
    want = complete(cold, "cold-flip", tokens, GREEDY).token_ids
    first = tier_engine(tiny_model_dir, disk_cache_dir=tmp_path)
    try:
        assert complete(first, "flip-1", tokens, GREEDY).token_ids == want
    finally:
        first.shutdown()
    damaged = 2  # block 2 of the prompt: blocks 0 and 1 still load, 2 on are computed
    digest = first.kv_cache.hasher.hash_tokens(tokens)[damaged]
    path = tmp_path / f"{digest:032x}.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0x04  # a K/V byte
    path.write_bytes(bytes(data))

    second = tier_engine(tiny_model_dir, disk_cache_dir=tmp_path)
    try:
        assert complete(second, "flip-2", tokens, GREEDY).token_ids == want
    finally:
        second.shutdown()
    stats = second.kv_connector_stats()
    assert stats is not None and stats.disk is not None
    assert stats.disk.corrupt == 1
    assert stats.hit_tokens("disk") == damaged * 4
    assert path.read_bytes() != bytes(data), "recomputed and written again, whole"


def test_a_block_evicted_from_a_small_pool_comes_back_from_the_host_tier(
    tiny_model_dir: Path, cold: Engine
) -> None:
    engine = tier_engine(tiny_model_dir, num_blocks=48, host_cache_mb=1)
    try:
        prompts = [prompt(engine, i) for i in range(len(TEXTS))]
        assert sum(len(p) for p in prompts[1:]) // 4 > 48, "the others evict the first"
        want = complete(cold, "cold-host", prompts[0], GREEDY).token_ids
        assert complete(engine, "h-0", prompts[0], GREEDY).token_ids == want
        for i, p in enumerate(prompts[1:], 1):
            complete(engine, f"h-{i}", p, GREEDY)
        assert engine.kv_cache.prefix_stats().evictions > 0
        assert complete(engine, "h-again", prompts[0], GREEDY).token_ids == want
        stats = engine.kv_connector_stats()
        assert stats is not None and stats.host is not None
        assert stats.hit_tokens("host") > 0 and stats.host.stored > 0
    finally:
        engine.shutdown()


def test_the_disk_tier_size_cap_holds(tiny_model_dir: Path, tmp_path: Path) -> None:
    cap_mb = 0.02  # about eight block files of the tiny model
    engine = tier_engine(tiny_model_dir, disk_cache_dir=tmp_path, disk_cache_mb=cap_mb)
    try:
        for i in range(len(TEXTS)):
            complete(engine, f"cap-{i}", prompt(engine, i), GREEDY)
    finally:
        engine.shutdown()
    stats = engine.kv_connector_stats()
    assert stats is not None and stats.disk is not None
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert on_disk <= cap_mb * 2**20
    assert stats.disk.evicted > 0 and stats.disk.stored > len(list(tmp_path.iterdir()))
