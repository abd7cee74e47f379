"""Speculative decoding (n-gram prompt lookup) in the engine: greedy and seeded outputs equal
plain decoding's token for token, drafts are proposed and accepted, stop conditions and
``max_tokens`` cut inside an accepted run, blocks all come back, the prefix cache keeps serving
the right K/V, and the counters reach the worker's load report."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.engine import Engine, EngineRequest
from tests.support.engine import joined, make_engine, run, tiny_prompts

SPEC = {
    "speculative_tokens": 4,
    "speculative_ngram_max": 3,
    "speculative_ngram_min": 1,
    "speculative_max_batch": 8,
}


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = make_engine(tiny_model_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def spec(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = make_engine(tiny_model_dir, **SPEC)
    yield engine
    engine.shutdown()


def cases(engine: Engine) -> list[tuple[list[int], SamplingParams]]:
    """Tiny prompts (one repeats itself, so lookups find matches from the first step) under
    greedy, seeded sampling and logprobs; ``ignore_eos`` so every run is long."""
    prompts = tiny_prompts(engine.tokenizer)
    out: list[tuple[list[int], SamplingParams]] = []
    for i, prompt in enumerate(prompts):
        if i % 3 == 1:
            sampling = SamplingParams(temperature=0.9, seed=11 + i, max_tokens=40, ignore_eos=True)
        else:
            sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        out.append((prompt, sampling))
    return out


def outputs(engine: Engine, batch: list[tuple[list[int], SamplingParams]], tag: str) -> list:
    reqs = [EngineRequest(f"{tag}-{i}", p, s) for i, (p, s) in enumerate(batch)]
    outs = run(engine, reqs)
    for rid, got in outs.items():
        assert all(o.error is None for o in got), rid
    return [joined(outs[f"{tag}-{i}"]) for i in range(len(batch))]


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "batched"])
def test_outputs_equal_plain_decoding(plain: Engine, spec: Engine, together: bool) -> None:
    batch = cases(spec)
    before = spec.load()
    if together:  # 6 generation-phase sequences > speculative_max_batch part of the time
        want, got = outputs(plain, batch, "p"), outputs(spec, batch, "s")
    else:
        want = [outputs(plain, [c], f"p{i}")[0] for i, c in enumerate(batch)]
        got = [outputs(spec, [c], f"s{i}")[0] for i, c in enumerate(batch)]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"case {i}"
        assert g.text == w.text
        assert len(g.token_ids) == 40
    after = spec.load()
    drafts = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert drafts > 0 and 0 < accepted <= drafts
    assert after.spec_drafts > before.spec_drafts
    assert spec.kv_cache.get_num_free_blocks() == spec.kv_cache.num_blocks


COPY_TEXT = (
    "The KV cache stores the keys and values of every token a request has seen, so that each "
    "decode step attends to them without recomputing them. Disaggregated serving runs the "
    "prefill on one worker and the decode on another, and moves the KV cache between them."
)


def test_a_copying_answer_takes_several_tokens_per_step(smollm2_dir: Path) -> None:
    """SmolLM2 asked to repeat a text: its answer copies the prompt, the drafts are right, and
    the 59-token answer takes a fraction of the steps, identical to plain decoding."""
    answers, loads = [], []
    for spec in (0, 4):
        engine = make_engine(
            smollm2_dir, compile=False, tokens_per_block=16, speculative_tokens=spec
        )
        try:
            msgs = [{"role": "user", "content": f"Repeat this text exactly:\n\n{COPY_TEXT}"}]
            text = engine.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False
            )
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
            greedy = SamplingParams(temperature=0.0, max_tokens=64)
            answers.append(outputs(engine, [(prompt, greedy)], "copy")[0])
            loads.append(engine.load())
        finally:
            engine.shutdown()
    plain_answer, spec_answer = answers
    assert spec_answer.token_ids == plain_answer.token_ids
    assert spec_answer.text.startswith("The KV cache stores the keys and values")
    assert loads[0].spec_drafts == 0
    steps, accepted = loads[1].spec_drafts, loads[1].spec_accepted_tokens
    assert steps <= len(spec_answer.token_ids) // 2, "fewer than 2 tokens per step"
    assert accepted >= len(spec_answer.token_ids) // 2


def test_stops_inside_an_accepted_run(spec: Engine, plain: Engine) -> None:
    """``max_tokens`` and a stop token cut the output exactly where plain decoding stops, even
    when the step that produced it accepted tokens beyond it."""
    tok = spec.tokenizer
    prompt = tok.encode("a b c d a b c d a b c d a b c d", add_special_tokens=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free = outputs(plain, [(prompt, greedy)], "free")[0].token_ids
    for max_tokens in (2, 3, 7, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        got = outputs(spec, [(prompt, params)], f"max{max_tokens}")[0]
        assert got.token_ids == free[:max_tokens]
        assert got.finish_reason is not None and got.finish_reason.value == "length"
    stop_at = free[9]
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_at,)
    )
    got = outputs(spec, [(prompt, params)], "stop")[0]
    assert got.token_ids == free[: free.index(stop_at) + 1]
    assert got.finish_reason is not None and got.finish_reason.value == "stop"
    assert spec.kv_cache.get_num_free_blocks() == spec.kv_cache.num_blocks


def test_prefix_cache_after_speculation_serves_right_kv(spec: Engine, plain: Engine) -> None:
    """A request continuing a speculated conversation (its prompt = prompt + output) reuses
    the cached blocks and still decodes exactly as plain decoding: blocks that held rejected
    drafts' K/V were never registered under the real tokens."""
    tok = spec.tokenizer
    prompt = tok.encode("red green blue red green blue red green", add_special_tokens=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = outputs(spec, [(prompt, greedy)], "turn1")[0].token_ids
    follow = prompt + first + tok.encode(" again", add_special_tokens=False)
    got = outputs(spec, [(follow, greedy)], "turn2")[0].token_ids
    assert got == outputs(plain, [(follow, greedy)], "turn2-plain")[0].token_ids


def test_not_speculated_when_logits_are_processed(spec: Engine, plain: Engine) -> None:
    """A repetition penalty reads the output so far: such a request decodes one token per
    step (no drafts) and equals plain decoding."""
    prompt = spec.tokenizer.encode("x y x y x y x y", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    before = spec.load().spec_draft_tokens
    got = outputs(spec, [(prompt, params)], "pen")[0].token_ids
    assert spec.load().spec_draft_tokens == before
    assert got == outputs(plain, [(prompt, params)], "pen-plain")[0].token_ids
