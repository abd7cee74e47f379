"""The engine on CUDA computes what transformers computes on CUDA: greedy tokens equal
``generate()`` token for token (tiny model; a model with SmolLM2-135M's architecture and random
weights, since SmolLM2's weights cannot be carried to the GPU machine), also across the
prefill -> decode split and under batching; the CUDA engine emits the CPU engine's tokens; and a
forward makes no host synchronisation per layer.

Skipped without CUDA (``torch.cuda.is_available()``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.engine import Engine, EngineRequest
from tests.support.engine import complete, joined, make_engine, run, split_complete, tiny_prompts
from tests.support.gpu_models import build_smollm2_like, hf_greedy_on, syncs_per_forward

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())"
    ),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def tiny_hf_cuda(tiny_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, local_files_only=True
    )
    return model.to("cuda").eval()


@pytest.fixture(scope="module")
def tiny_cuda(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = make_engine(tiny_model_dir, device="cuda", dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def smol_like_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_smollm2_like(tmp_path_factory.mktemp("smollm2-like"), seed=0)


def test_kv_pool_and_weights_live_on_the_gpu(tiny_cuda: Engine) -> None:
    assert tiny_cuda.kv_cache.pool.is_cuda
    assert all(p.is_cuda for p in tiny_cuda.runner.model.parameters())


def test_greedy_tokens_equal_transformers_generate_on_cuda(tiny_cuda: Engine, tiny_hf_cuda) -> None:
    for i, prompt in enumerate(tiny_prompts(tiny_cuda.tokenizer)):
        got = complete(tiny_cuda, f"greedy-{i}", prompt, GREEDY)
        assert got.token_ids == hf_greedy_on(tiny_hf_cuda, prompt, GREEDY.max_tokens), i
    assert tiny_cuda.kv_cache.get_num_free_blocks() == tiny_cuda.kv_cache.num_blocks


def test_cuda_engine_emits_the_cpu_engines_tokens(tiny_cuda: Engine, tiny_model_dir: Path) -> None:
    cpu = make_engine(tiny_model_dir)
    try:
        for i, prompt in enumerate(tiny_prompts(cpu.tokenizer)):
            on_cpu = complete(cpu, f"cpu-{i}", prompt, GREEDY)
            on_gpu = complete(tiny_cuda, f"gpu-{i}", prompt, GREEDY)
            assert on_gpu.token_ids == on_cpu.token_ids and on_gpu.text == on_cpu.text, i
    finally:
        cpu.shutdown()


def test_batched_and_seeded_requests_equal_their_solo_outputs_on_cuda(tiny_cuda: Engine) -> None:
    prompts = (tiny_prompts(tiny_cuda.tokenizer) * 2)[:8]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12 + i)
        if i % 2 == 0
        else SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12 + i)
        for i in range(8)
    ]
    cases = list(zip(prompts, params, strict=True))
    solo = [complete(tiny_cuda, f"solo-{i}", p, s) for i, (p, s) in enumerate(cases)]
    batch = run(tiny_cuda, [EngineRequest(f"batch-{i}", p, s) for i, (p, s) in enumerate(cases)])
    for i in range(8):
        assert joined(batch[f"batch-{i}"]).token_ids == solo[i].token_ids, i


def test_split_across_two_cuda_engines_equals_generate(tiny_model_dir: Path, tiny_hf_cuda) -> None:
    prefill = make_engine(tiny_model_dir, device="cuda", dtype="float32", num_blocks=300)
    decode = make_engine(tiny_model_dir, device="cuda", dtype="float32", num_blocks=200)
    try:
        for i, prompt in enumerate(tiny_prompts(prefill.tokenizer)):
            got = split_complete(prefill, decode, f"split-{i}", prompt, GREEDY)
            assert got.token_ids == hf_greedy_on(tiny_hf_cuda, prompt, GREEDY.max_tokens), i
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.slow
def test_smollm2_architecture_greedy_equals_generate_on_cuda(smol_like_dir: Path) -> None:
    engine = make_engine(
        smol_like_dir, device="cuda", dtype="float32", tokens_per_block=16, num_blocks=64
    )
    hf = AutoModelForCausalLM.from_pretrained(
        smol_like_dir, dtype=torch.float32, local_files_only=True
    )
    hf = hf.to("cuda").eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 259, (n,), generator=gen).tolist() for n in (40, 75)]
    sampling = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    try:
        batch = run(engine, [EngineRequest(f"s-{i}", p, sampling) for i, p in enumerate(prompts)])
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        assert joined(batch[f"s-{i}"]).token_ids == hf_greedy_on(hf, prompt, 20), i


@pytest.mark.slow
def test_a_forward_makes_no_host_sync_per_layer(smol_like_dir: Path) -> None:
    per_forward = syncs_per_forward(smol_like_dir, tokens_per_block=16, num_blocks=64)
    print("host syncs per forward (30 layers):", [len(s) for s in per_forward])
    print("kinds:", sorted({m for s in per_forward for m in s}))
    assert len(per_forward) == 6  # one prefill step, five decode steps
    # The step's input copies and transformers' packed-sequence check sync once per forward;
    # one sync per layer would make it at least 30.
    assert max(len(s) for s in per_forward) < 30, per_forward
