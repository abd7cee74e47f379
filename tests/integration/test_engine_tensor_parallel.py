"""Tensor parallel engines (real rank processes, a real gloo group) decode as TP=1 does.

In-process engines on the tiny model (4 query heads, 2 KV heads): TP=2 holds one KV head per
rank, TP=4 replicates each KV head on two ranks. Steps small enough to chunk the long prompt
(continued chunks read the rank's shard back), a batch of sequences decoded together, a
prefix-cache hit, ``n=2`` choices (the fork copies a block in every rank's shard), and a rank
that dies: the engine's requests end with an error instead of hanging. The ranks meet through a
private file store and listen on loopback only (issue 39: a TCPStore listened on every
interface, unauthenticated).
"""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.protocol import FinishReason, SamplingParams
from pdserve.workers.engine.engine import Engine, EngineRequest
from tests.support.engine import joined, make_engine, run
from tests.support.procfs import listeners
from tests.support.servers import wait_until_sync

PROMPTS = [
    [1, 72, 101, 108, 108, 111],
    list(range(40, 90)),  # 50 tokens: chunked at 32 tokens per step
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110] * 2,
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(model_dir: Path, tp: int) -> Engine:
    return make_engine(model_dir, tensor_parallel_size=tp, compile=False, max_num_batched_tokens=32)


LOOPBACK = "127.0.0.1"
BEFORE_ENGINES: set[tuple[str, int]] = set()
"""This process's TCP listeners before the module's engines started (rank 0 is this process)."""


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[dict[int, Engine]]:
    BEFORE_ENGINES.update(listeners(os.getpid()))
    made = {tp: _engine(tiny_model_dir, tp) for tp in (1, 2, 4)}
    yield made
    for engine in made.values():
        engine.shutdown()


def _batch(engine: Engine, tag: str) -> list[list[int]]:
    reqs = [EngineRequest(f"{tag}-{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    outs = run(engine, reqs)
    return [joined(outs[r.request_id]).token_ids for r in reqs]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_batch_equals_tp1(engines: dict[int, Engine], tp: int) -> None:
    reference = _batch(engines[1], "ref")
    assert all(len(t) == GREEDY.max_tokens for t in reference)
    assert _batch(engines[tp], f"tp{tp}") == reference
    # the same prompts again: prefix-cache hits, the shards' cached K/V is read back
    before = engines[tp].kv_cache.prefix_stats().hit_tokens
    assert _batch(engines[tp], f"tp{tp}-again") == reference
    assert engines[tp].kv_cache.prefix_stats().hit_tokens > before


def test_tensor_parallel_choices_fork_every_shard(engines: dict[int, Engine]) -> None:
    sampling = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2)
    prompt = PROMPTS[1][:23]  # the last block is partial: the fork copies it

    def choices(engine: Engine, rid: str) -> list[list[int]]:
        outs = run(engine, [EngineRequest(rid, prompt, sampling)])[rid]
        return [[t for o in outs if o.index == i for t in o.token_ids] for i in range(2)]

    reference = choices(engines[1], "n-ref")
    assert all(len(c) >= sampling.max_tokens - 1 for c in reference)
    assert choices(engines[2], "n-tp2") == reference


def test_ranks_meet_through_a_private_store_and_listen_on_loopback_only(
    engines: dict[int, Engine],
) -> None:
    for tp in (2, 4):
        ranks = engines[tp].runner.ranks
        assert ranks is not None
        assert stat.S_IMODE(ranks.store_dir.stat().st_mode) == 0o700  # this user's only
        assert ranks.store_path.is_file()
        for proc in ranks._procs:  # each rank's gloo pair listener, nothing else
            found = listeners(proc.pid)
            assert found and {addr for addr, _ in found} == {LOOPBACK}, (proc.name, found)
    # rank 0 (this process): what the engines opened is loopback too (a TCPStore was "::")
    opened = listeners(os.getpid()) - BEFORE_ENGINES
    assert opened and {addr for addr, _ in opened} == {LOOPBACK}, opened


def test_a_dead_rank_ends_requests_with_an_error(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, 2)
    try:
        ranks = engine.runner.ranks
        assert ranks is not None
        died = threading.Event()
        ranks.on_death = lambda reason: died.set()
        assert _batch(engine, "alive")  # the group works
        (proc,) = ranks._procs
        os.kill(proc.pid, signal.SIGKILL)
        wait_until_sync(died.is_set, 30.0, interval_s=0.05, what="the watchdog to see the death")
        outs = run(engine, [EngineRequest("after", PROMPTS[0], GREEDY)], timeout=30)["after"]
        assert outs[-1].finish_reason == FinishReason.ERROR
        assert "tensor parallel rank 1" in (outs[-1].error or "")
        assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_blocks
    finally:
        engine.shutdown()
    assert not ranks.store_dir.exists()  # closing the group removed its rendezvous folder
