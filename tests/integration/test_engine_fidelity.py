"""The engine computes what transformers computes: greedy tokens equal ``generate()`` token for
token (tiny model, SmolLM2, float32), also across the prefill -> decode split, under batching
and with chunked prefill; seeded sampling is reproducible and split-invariant. In bfloat16
(``--dtype auto``'s choice on CPUs with AMX or AVX-512 BF16) SmolLM2 stays within bfloat16's
resolution of transformers in bfloat16 (the bound and why tokens may part: see the test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.engine import Engine, EngineRequest
from tests.support.engine import (
    TINY_TEXTS,
    check_within_bf16_resolution,
    complete,
    hf_greedy,
    joined,
    make_engine,
    run,
    split_complete,
    tiny_prompts,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, local_files_only=True
    ).eval()


@pytest.fixture(scope="module", params=["whole-prefill", "chunked-prefill"])
def tiny_engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Engine]:
    budget = 2048 if request.param == "whole-prefill" else 8
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=budget)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    """A prefill engine and a decode engine with different pool sizes (block ids differ)."""
    prefill = make_engine(tiny_model_dir, num_blocks=300)
    decode = make_engine(tiny_model_dir, num_blocks=200)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_greedy_tokens_equal_transformers_generate(tiny_engine: Engine, tiny_hf) -> None:
    for i, prompt in enumerate(tiny_prompts(tiny_engine.tokenizer)):
        got = complete(tiny_engine, f"greedy-{i}", prompt, GREEDY)
        assert got.token_ids == hf_greedy(tiny_hf, prompt, GREEDY.max_tokens), TINY_TEXTS[i:]
    assert tiny_engine.kv_cache.get_num_free_blocks() == tiny_engine.kv_cache.num_blocks


def test_split_prefill_then_resume_equals_generate(tiny_pair, tiny_hf) -> None:
    prefill, decode = tiny_pair
    for i, prompt in enumerate(tiny_prompts(prefill.tokenizer)):
        got = split_complete(prefill, decode, f"split-{i}", prompt, GREEDY)
        assert got.token_ids == hf_greedy(tiny_hf, prompt, GREEDY.max_tokens)
    for engine in (prefill, decode):
        assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_blocks


def test_concurrent_requests_equal_their_solo_outputs(tiny_engine: Engine) -> None:
    prompts = (tiny_prompts(tiny_engine.tokenizer) * 2)[:8]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12 + i)
        if i % 2 == 0
        else SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12 + i)
        for i in range(8)
    ]
    cases = list(zip(prompts, params, strict=True))
    solo = [complete(tiny_engine, f"solo-{i}", p, s) for i, (p, s) in enumerate(cases)]
    batch = run(tiny_engine, [EngineRequest(f"batch-{i}", p, s) for i, (p, s) in enumerate(cases)])
    for i in range(8):
        together = joined(batch[f"batch-{i}"])
        assert together.token_ids == solo[i].token_ids
        assert together.text == solo[i].text


def test_seeded_sampling_repeats_exactly_and_survives_the_split(tiny_engine, tiny_pair) -> None:
    prefill, decode = tiny_pair
    prompt = tiny_prompts(tiny_engine.tokenizer)[1]
    sampling = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=20, ignore_eos=True)
    first = complete(tiny_engine, "seeded-a", prompt, sampling)
    again = complete(tiny_engine, "seeded-b", prompt, sampling)
    split = split_complete(prefill, decode, "seeded-split", prompt, sampling)
    assert len(first.token_ids) == 20
    assert again.token_ids == first.token_ids and again.text == first.text
    assert split.token_ids == first.token_ids and split.text == first.text
    other_seed = complete(tiny_engine, "seeded-c", prompt, sampling.model_copy(update={"seed": 8}))
    assert other_seed.token_ids != first.token_ids


# --- SmolLM2 -----------------------------------------------------------------------------------

SMOL_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> Iterator[tuple[Engine, object, list[list[int]]]]:
    engine = make_engine(smollm2_dir, tokens_per_block=16, num_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    prompts = []
    for q in SMOL_QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tok.encode(text, add_special_tokens=False))
    yield engine, hf, prompts
    engine.shutdown()


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_transformers_generate(smol) -> None:
    engine, hf, prompts = smol
    sampling = SamplingParams(temperature=0.0, max_tokens=20)
    batch = run(engine, [EngineRequest(f"smol-{i}", p, sampling) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        got = joined(batch[f"smol-{i}"])
        expected = hf_greedy(hf, prompt, sampling.max_tokens)
        assert got.token_ids == expected
        assert got.text == engine.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_split_path_equals_generate(smol, smollm2_dir: Path) -> None:
    engine, hf, prompts = smol
    decode = make_engine(smollm2_dir, tokens_per_block=16, num_blocks=32)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=16)
        got = split_complete(engine, decode, "smol-split", prompts[1], sampling)
    finally:
        decode.shutdown()
    assert got.token_ids == hf_greedy(hf, prompts[1], sampling.max_tokens)


BF16_QUESTIONS = [
    *SMOL_QUESTIONS,
    "Explain gravity in one sentence.",
    "List three colors.",
    "Who wrote Hamlet?",
    "Describe a cat.",
]


@pytest.mark.slow
def test_smollm2_bfloat16_stays_within_bfloat16_resolution_of_transformers(
    smollm2_dir: Path,
) -> None:
    """Why not token for token: the logits come out of the LM head in bfloat16 in both (as in
    vLLM), so SmolLM2's flat first-token distributions meet ties and one-step swaps (for "What is
    the capital of France?" float32 puts "The" 0.10 nats above "L"; transformers' eager
    bfloat16 puts it 0.25 above, pdserve's compiled bfloat16 ties them, and argmax takes the
    lower id); transformers' own ``generate()`` parts from its full-sequence forward the same
    way. So the bound is on the choice: along pdserve's greedy answer (8 prompts x 32 tokens,
    teacher-forced through transformers in bfloat16), each token is within 2 steps of the top
    logprob and its logprob within 4 steps of transformers'. Measured on an Intel Xeon with AMX:
    at most 0.125 and 0.24 nats; each token within 0.10 nats of float32's top."""
    engine = make_engine(smollm2_dir, tokens_per_block=16, num_blocks=128, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.bfloat16, local_files_only=True
    ).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in BF16_QUESTIONS
    ]
    sampling = SamplingParams(temperature=0.0, max_tokens=32, logprobs=True, top_logprobs=1)
    try:
        batch = run(engine, [EngineRequest(f"b{i}", p, sampling) for i, p in enumerate(prompts)])
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        got = joined(batch[f"b{i}"]).token_ids
        ours = [lp.logprob for out in batch[f"b{i}"] for lp in out.logprobs or ()]
        check_within_bf16_resolution(hf, prompt, got, ours, BF16_QUESTIONS[i])
