"""The engine's newer paths on CUDA (tiny model): an FP8 KV pool (e4m3, e5m2) stores the CPU
engine's prompt K/V to within one FP8 step and decodes the CPU engine's greedy tokens; a
bfloat16 model batches as it runs alone; speculative decoding (n-gram prompt lookup) accepts
drafts and emits plain decoding's tokens; structured outputs (JSON Schema, regex) hold; a prefix
evicted from the pool comes back from the host tier and decodes as a fresh run.

Not covered: tensor parallelism. It runs on CPU only (gloo) in this version; a CUDA engine with
``tensor_parallel_size > 1`` is refused at start (``ModelRunner``), there is no NCCL path yet.

Skipped without CUDA (``torch.cuda.is_available()``). ``PDSERVE_GPU_TEST_DEVICE`` names the
device (default ``cuda``): ``PDSERVE_GPU_TEST_DEVICE=cpu pytest tests/gpu/test_features_cuda.py``
runs the same checks on the CPU, to check the test logic where no GPU is lent (the CUDA-vs-CPU
comparisons then compare CPU with CPU).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from pdserve.protocol import FinishReason, SamplingParams, StructuredOutput, TokenLogprob
from pdserve.workers.engine.engine import Engine, EngineRequest
from pdserve.workers.kv.manager import KV_DTYPES
from tests.support.engine import complete, joined, make_engine, mixed_cases, run, tiny_prompts

DEVICE = os.environ.get("PDSERVE_GPU_TEST_DEVICE", "cuda")

pytestmark = [
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available()); PDSERVE_GPU_TEST_DEVICE=cpu "
        "runs the checks on the CPU",
    ),
]

# Greedy runs computed in different ways (another device, another batch) agree only up to
# rounding, and the tiny model meets near-ties often: on its prompts a fifth of the greedy
# steps have the top two tokens within 0.1 nats (the smallest gap 0.002). Where rounding is
# coarse (bfloat16 activations, FP8 K/V) two runs may therefore part at a near-tie. TIE_NATS
# bounds how far rounding moves a logprob: measured on CPU, all of bfloat16's rounding (a
# bfloat16 model against the float32 one) moves the tiny prompts' logprobs by at most 0.17 nats
# before the runs part, and all of FP8's (an FP8 pool against a float32 one) by at most 0.25
# (e4m3) and 0.56 (e5m2); two runs that differ in a few rounding steps only (kernel choice,
# a K/V value on the other side of an FP8 rounding boundary) move them far less. Runs may part
# only where the reference's top two lie within TIE_NATS and the other run took the runner-up;
# a wrong K/V or a mixed-up batch row parts at the first steps, where most gaps exceed it.
TIE_NATS = 0.2


def device_engine(model_dir: Path, **overrides: object) -> Engine:
    """:func:`make_engine` on :data:`DEVICE`, float32 unless ``dtype`` is given (``auto`` would
    pick float16 for the float32 checkpoint on CUDA) and eager (``compile=False``: no effect on
    CUDA, and on the CPU override it spares the compile)."""
    settings: dict[str, object] = {"device": DEVICE, "dtype": "float32", "compile": False}
    settings.update(overrides)
    return make_engine(model_dir, **settings)


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on :data:`DEVICE` (any index of its type)."""
    return t.device.type == torch.device(DEVICE).type


def greedy_logprobs(
    engine: Engine, tag: str, prompts: list[list[int]], *, together: bool
) -> list[list[TokenLogprob]]:
    """24 greedy tokens after each of ``prompts`` (``ignore_eos``), each with its logprob and the
    top two, run in one batch (``together``) or one request at a time."""
    sampling = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    reqs = [EngineRequest(f"{tag}-{i}", p, sampling) for i, p in enumerate(prompts)]
    if together:
        outs = run(engine, reqs)
    else:
        outs = {r.request_id: run(engine, [r])[r.request_id] for r in reqs}
    assert all(o.error is None for got in outs.values() for o in got)
    return [[lp for o in outs[r.request_id] for lp in o.logprobs] for r in reqs]


def assert_equal_up_to_near_ties(
    got: list[list[TokenLogprob]], want: list[list[TokenLogprob]], tie: float = TIE_NATS
) -> None:
    """Assert that each case of ``got`` has ``want``'s tokens, with logprobs within ``tie``
    nats, up to where the two part; they may part only where ``got`` took a token whose
    logprob in ``want`` lies within ``tie`` of ``want``'s choice (see :data:`TIE_NATS`), and
    at most half of the cases may part at all."""
    parted = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w) > 0, f"case {i}: {len(g)} tokens, want {len(w)}"
        for j, (a, b) in enumerate(zip(g, w, strict=True)):
            if a.token_id != b.token_id:
                alternatives = dict(b.top)
                assert a.token_id in alternatives, f"case {i} parts at token {j}: {a} vs {b}"
                gap = b.logprob - alternatives[a.token_id]
                assert gap <= tie, f"case {i} parts at token {j}, no near-tie: {a} vs {b}"
                parted += 1
                break
            assert abs(a.logprob - b.logprob) <= tie, f"case {i} token {j}: {a} vs {b}"
    assert parted <= len(want) // 2, f"{parted} of {len(want)} cases parted"


def prompt_kv(engine: Engine, rid: str, prompt: list[int]) -> torch.Tensor:
    """The K/V the engine stores for ``prompt``'s full blocks (a prefill leg, its parked blocks
    read and freed), on the CPU as float32 ``[layers, blocks, 2, tpb, kv_heads, head_dim]``."""
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (first,) = run(engine, [EngineRequest(rid, prompt, sampling, mode="prefill")])[rid]
    assert first.error is None and first.parked_block_ids is not None, first
    full = first.parked_block_ids[: len(prompt) // engine.kv_cache.tokens_per_block]
    pool = engine.kv_cache.pool  # FP8 as bytes: not every index kernel has an FP8 variant
    data = pool.view(torch.uint8)[:, full].cpu().view(pool.dtype).float()
    engine.free_parked(rid)
    return data


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_pool_on_device_matches_the_cpu_engine(tiny_model_dir: Path, kv_dtype: str) -> None:
    dev = device_engine(tiny_model_dir, kv_dtype=kv_dtype)
    cpu = make_engine(tiny_model_dir, kv_dtype=kv_dtype, compile=False)
    try:
        pool = dev.kv_cache.pool
        assert on_device(pool) and pool.dtype == cpu.kv_cache.pool.dtype == KV_DTYPES[kv_dtype]
        prompts = tiny_prompts(cpu.tokenizer)
        # Each device computes K/V in float32 (rounding apart by ~1e-6) and rounds it to FP8:
        # a value may land one FP8 step apart (a rounding boundary between the two), no more.
        finfo = torch.finfo(pool.dtype)
        differing = total = 0
        for i, prompt in enumerate(prompts):
            a, b = prompt_kv(dev, f"kv-{i}", prompt), prompt_kv(cpu, f"kv-{i}", prompt)
            assert a.shape == b.shape
            step = finfo.eps * torch.maximum(a.abs().maximum(b.abs()), torch.tensor(finfo.tiny))
            assert ((a - b).abs() <= step).all(), f"prompt {i}: K/V more than one FP8 step apart"
            differing += int((a != b).sum())
            total += a.numel()
        assert total > 0 and differing <= total // 100, f"{differing} of {total} values differ"
        want = greedy_logprobs(cpu, "cpu", prompts, together=False)
        got = greedy_logprobs(dev, "dev", prompts, together=False)
        assert_equal_up_to_near_ties(got, want)
        assert dev.kv_cache.get_num_free_blocks() == dev.kv_cache.num_blocks
    finally:
        dev.shutdown()
        cpu.shutdown()


def test_bfloat16_batch_equals_solo_runs_on_device(tiny_model_dir: Path) -> None:
    # no prefix caching: the batch recomputes what the solo runs computed; 32-token steps chunk
    # the long prompts while the short ones decode
    engine = device_engine(
        tiny_model_dir, dtype="bfloat16", prefix_caching=False, max_num_batched_tokens=32
    )
    try:
        assert engine.runner.dtype == torch.bfloat16
        assert all(
            p.dtype == torch.bfloat16 and on_device(p) for p in engine.runner.model.parameters()
        )
        assert on_device(engine.kv_cache.pool) and engine.kv_cache.pool.dtype == torch.bfloat16
        randoms = [p for p, _ in mixed_cases(256)[1:3]]  # 17 and 30 random tokens
        prompts = tiny_prompts(engine.tokenizer) + randoms  # 8 prompts: max_num_seqs
        solo = greedy_logprobs(engine, "solo", prompts, together=False)
        batched = greedy_logprobs(engine, "batch", prompts, together=True)
        assert_equal_up_to_near_ties(batched, solo)
        assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_blocks
    finally:
        engine.shutdown()


SPEC = {
    "speculative_tokens": 4,
    "speculative_ngram_max": 3,
    "speculative_ngram_min": 1,
    "speculative_max_batch": 8,
}
# The random tiny model copies no prompt, but after these it loops on its own output, which
# the lookup then proposes (on CPU 17 of 17 draft tokens accepted for "11111111", 14 of 22 for
# "yyyyyyyy"); acceptance follows from the greedy tokens alone, the same on every device.
REPEATING = ["11111111", " " * 8, "yyyyyyyy", "vvvvvvvv", "red green blue " * 3, "pdserve " * 9]


def test_speculative_decoding_equals_plain_decoding_on_device(tiny_model_dir: Path) -> None:
    plain, spec = device_engine(tiny_model_dir), device_engine(tiny_model_dir, **SPEC)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        prompts = [spec.tokenizer.encode(t, add_special_tokens=False) for t in REPEATING]
        want = [complete(plain, f"p-{i}", p, greedy).token_ids for i, p in enumerate(prompts)]
        before = spec.load()
        solo = [complete(spec, f"s-{i}", p, greedy).token_ids for i, p in enumerate(prompts)]
        outs = run(spec, [EngineRequest(f"b-{i}", p, greedy) for i, p in enumerate(prompts)])
        batched = [joined(outs[f"b-{i}"]).token_ids for i in range(len(prompts))]
        after = spec.load()
        assert solo == want and batched == want
        assert all(len(t) == greedy.max_tokens for t in want)
        drafts = after.spec_draft_tokens - before.spec_draft_tokens
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        print(f"speculative: {accepted} of {drafts} draft tokens accepted")
        assert drafts > 0 and 0 < accepted <= drafts
        assert spec.kv_cache.get_num_free_blocks() == spec.kv_cache.num_blocks
    finally:
        plain.shutdown()
        spec.shutdown()


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "note": {"type": "string", "minLength": 4, "maxLength": 12},
    },
    "required": ["id", "tag", "note"],
    "additionalProperties": False,
}
PATTERN = r"[a-z]{3,8}-[0-9]{2,4}"


def test_structured_outputs_hold_on_device(tiny_model_dir: Path) -> None:
    engine = device_engine(tiny_model_dir)
    schema = StructuredOutput(kind="json", spec=json.dumps(SCHEMA))
    regex = StructuredOutput(kind="regex", spec=PATTERN)
    prompts = tiny_prompts(engine.tokenizer)
    cases = [  # constrained and free rows in one batch: greedy, seeded samples, a free row
        *(SamplingParams(temperature=0.0, max_tokens=160, structured=schema) for _ in range(3)),
        SamplingParams(temperature=0.9, seed=5, max_tokens=160, structured=schema),
        SamplingParams(temperature=0.0, max_tokens=30, structured=regex),
        SamplingParams(temperature=0.9, seed=6, max_tokens=30, structured=regex),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    try:
        reqs = [EngineRequest(f"so-{i}", prompts[i % len(prompts)], s) for i, s in enumerate(cases)]
        outs = run(engine, reqs)
        for i, sampling in enumerate(cases):
            got = joined(outs[f"so-{i}"])
            text = got.text
            print(f"structured {i}: {got.finish_reason} {text!r}")
            if sampling.structured is None:  # no other row's mask reached it
                alone = complete(engine, "free", reqs[i].prompt_token_ids, sampling)
                assert got.token_ids == alone.token_ids and len(alone.token_ids) == 30
                continue
            assert got.finish_reason == FinishReason.STOP, (i, text)
            if sampling.structured is schema:
                jsonschema.validate(json.loads(text), SCHEMA)
            else:
                assert re.fullmatch(PATTERN, text), (i, text)
        assert engine.grammars.compiled == 2, "one schema and one regex, each compiled once"
        assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_blocks
    finally:
        engine.shutdown()


TIER_TEXTS = [
    "The host tier keeps KV blocks the pool evicted, in host memory, least recent out. " * 2,
    "A block found in a tier is loaded into the pool instead of being computed again. " * 2,
    "Zebras graze quietly while the evening light fades over the open savanna plain. " * 2,
    "Seven copper kettles whistled in the crowded kitchen of the old mountain hotel. " * 2,
]


def test_a_prefix_evicted_from_the_device_pool_comes_back_from_the_host_tier(
    tiny_model_dir: Path,
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cold = device_engine(tiny_model_dir, prefix_caching=False)
    engine = device_engine(tiny_model_dir, num_blocks=48, host_cache_mb=1)
    try:
        assert on_device(engine.kv_cache.pool) and engine.connector is not None
        tok, tpb = engine.tokenizer, engine.kv_cache.tokens_per_block
        prompts = [tok.encode(t, add_special_tokens=False) for t in TIER_TEXTS]
        assert sum(len(p) for p in prompts[1:]) // tpb > 48, "the others evict the first"
        want = complete(cold, "cold", prompts[0], greedy).token_ids
        assert complete(engine, "t-0", prompts[0], greedy).token_ids == want
        for i, p in enumerate(prompts[1:], 1):
            complete(engine, f"t-{i}", p, greedy)
        assert engine.kv_cache.prefix_stats().evictions > 0
        stats = engine.kv_connector_stats()
        assert stats is not None and stats.host is not None and stats.hit_tokens("host") == 0
        outs = run(engine, [EngineRequest("again", prompts[0], greedy)])["again"]
        assert joined(outs).token_ids == want
        stats = engine.kv_connector_stats()
        assert stats is not None and stats.host is not None
        loaded, in_pool = stats.hit_tokens("host"), outs[0].cached_tokens
        print(f"host tier: {loaded} tokens loaded, {in_pool} from the pool")
        assert loaded > 0 and stats.host.stored > 0
        # every full block below the last prompt token comes from the pool or the tier
        assert in_pool is not None and loaded + in_pool == (len(prompts[0]) - 1) // tpb * tpb
    finally:
        cold.shutdown()
        engine.shutdown()
