"""The engine with its prefix cache (tiny model): a request whose prefix is cached computes only
the rest, and its greedy tokens equal a cold run (``--no-prefix-caching``) and transformers'
``generate()``, whole or chunked prefill, under pool pressure (LRU eviction, preemption) and
with ``n`` choices; every block comes back (free + evictable = total)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.engine import Engine, EngineOutput, EngineRequest
from tests.support.engine import complete, hf_greedy, joined, make_engine, run

SYSTEM = "You are pdserve, a helpful assistant. Answer briefly. "
QUESTIONS = ["What is a KV cache?", "Why split prefill and decode?", "Name a prime number."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, local_files_only=True
    ).eval()


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = make_engine(tiny_model_dir, prefix_caching=False)
    yield engine
    engine.shutdown()


def choices(
    engine: Engine, rid: str, prompt: list[int], params: SamplingParams
) -> dict[int, list[int]]:
    """Tokens of each choice of one request, once every choice finished."""
    tokens: dict[int, list[int]] = {}
    left, done = [params.n], threading.Event()

    def sink(out: EngineOutput) -> None:
        assert out.error is None, out.error
        tokens.setdefault(out.index, []).extend(out.token_ids)
        if out.finish_reason is not None:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    engine.add_request(EngineRequest(rid, prompt, params), sink)
    assert done.wait(120.0), "choices did not finish"
    return tokens


def chat_prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(SYSTEM + q, add_special_tokens=False) for q in QUESTIONS]


def assert_pool_back(engine: Engine) -> None:
    kv = engine.kv_cache
    assert kv.holders() == [] and not engine.parked
    assert kv.get_num_free_blocks() == kv.num_blocks, "free + evictable = total"


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole-prefill", "chunked-prefill"])
def test_cache_hits_equal_a_cold_run_and_generate(
    tiny_model_dir: Path, cold: Engine, tiny_hf, budget: int
) -> None:
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=budget)
    try:
        prompts = chat_prompts(engine)
        for round_ in range(2):  # round 1 hits the shared prefix, round 2 the whole prompts
            for i, prompt in enumerate(prompts):
                got = complete(engine, f"r{round_}-{i}", prompt, GREEDY)
                want = complete(cold, f"cold-{budget}-{round_}-{i}", prompt, GREEDY)
                assert got.token_ids == want.token_ids == hf_greedy(tiny_hf, prompt, 16)
                assert got.text == want.text
        stats = engine.kv_cache.prefix_stats()
        tpb = engine.kv_cache.tokens_per_block
        shared = len(prompts[0]) // tpb * tpb  # at least the system prompt's full blocks
        assert stats.queries == 6
        assert stats.hit_tokens >= 2 * shared, stats
        assert stats.hit_tokens < stats.query_tokens, "never the whole prompt"
        assert cold.kv_cache.prefix_stats().hit_tokens == 0
        assert_pool_back(engine)
        assert engine.kv_cache.get_num_evictable_blocks() > 0
    finally:
        engine.shutdown()


def test_a_repeated_prompt_computes_only_its_last_block(tiny_model_dir: Path, tiny_hf) -> None:
    engine = make_engine(tiny_model_dir)
    try:
        prompt = chat_prompts(engine)[0]
        first = complete(engine, "first", prompt, GREEDY)
        before = engine.kv_cache.prefix_stats().hit_tokens
        again = complete(engine, "again", prompt, GREEDY)
        hit = engine.kv_cache.prefix_stats().hit_tokens - before
        tpb = engine.kv_cache.tokens_per_block
        assert hit == (len(prompt) - 1) // tpb * tpb, "cached up to the block below the end"
        assert again.token_ids == first.token_ids == hf_greedy(tiny_hf, prompt, 16)
        assert_pool_back(engine)
    finally:
        engine.shutdown()


def test_pool_pressure_evicts_and_preempts_without_changing_outputs(
    tiny_model_dir: Path, cold: Engine
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = make_engine(tiny_model_dir, num_blocks=40)
    try:
        prompts = chat_prompts(engine)
        reqs = [EngineRequest(f"p{i}", p, greedy) for i, p in enumerate(prompts * 2)]
        want = {r.request_id: complete(cold, f"cold-{r.request_id}", r.prompt_token_ids, greedy)
                for r in reqs}  # fmt: skip
        for wave in range(2):  # the second wave meets a cache filled (and evicted) by the first
            outs = run(engine, [EngineRequest(f"w{wave}-{r.request_id}", r.prompt_token_ids,
                                              greedy) for r in reqs])  # fmt: skip
            for r in reqs:
                got = joined(outs[f"w{wave}-{r.request_id}"])
                assert got.token_ids == want[r.request_id].token_ids, (wave, r.request_id)
        stats = engine.kv_cache.prefix_stats()
        assert stats.hit_tokens > 0 and stats.evictions > 0, stats
        assert engine.load().preemptions > 0
        assert_pool_back(engine)
    finally:
        engine.shutdown()


def test_n_choices_over_a_cached_prefix(tiny_model_dir: Path, cold: Engine) -> None:
    engine = make_engine(tiny_model_dir)
    try:
        prompt = chat_prompts(engine)[1]
        params = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=12)
        complete(engine, "warm", prompt, GREEDY)
        got, want = choices(engine, "n", prompt, params), choices(cold, "cold-n", prompt, params)
        assert got == want and len(got) == 3 and all(got.values())
        assert_pool_back(engine)
    finally:
        engine.shutdown()
