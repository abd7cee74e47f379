"""The engine's in-place paged attention (the C++ kernel reading KV blocks through the block
tables) against its gather + SDPA path: the same tokens for decode batches, chunked prefill
(continued chunks over the cache), prefix-cache hits and speculative drafts, and the same
logprobs to float32 rounding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.engine import Engine, EngineRequest
from pdserve.workers.engine.model import paged_kernel
from tests.support.engine import joined, make_engine, mixed_cases, run

pytestmark = pytest.mark.skipif(
    not paged_kernel.available() and "compiler" in (paged_kernel.unavailable_reason() or ""),
    reason="no C++ compiler: the in-place kernel cannot be built here",
)

SETTINGS = {"max_num_batched_tokens": 24, "speculative_tokens": 3, "speculative_max_batch": 8}


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    in_place = make_engine(tiny_model_dir, **SETTINGS)
    gather = make_engine(tiny_model_dir, **SETTINGS)
    gather.runner.in_place = False  # the reference: gather + SDPA
    yield in_place, gather
    in_place.shutdown()
    gather.shutdown()


def test_the_kernel_serves_the_cpu_engine(engines: tuple[Engine, Engine]) -> None:
    in_place, _ = engines
    assert in_place.runner.in_place, paged_kernel.unavailable_reason()


def _outputs(engine: Engine, cases: list[tuple[list[int], SamplingParams]], tag: str) -> list:
    outs = run(engine, [EngineRequest(f"{tag}-{i}", p, s) for i, (p, s) in enumerate(cases)])
    for got in outs.values():
        assert all(o.error is None for o in got)
    return [joined(outs[f"{tag}-{i}"]) for i in range(len(cases))]


def test_same_tokens_as_the_gather_path(engines: tuple[Engine, Engine]) -> None:
    """Mixed prompt lengths prefilled in 24-token chunks beside decoding sequences, one
    seeded sample; then the same prompts again (prefix-cache hits: continued chunks over
    cached blocks)."""
    in_place, gather = engines
    cases = mixed_cases(in_place.runner.vocab_size, seed=3)
    for round_ in ("cold", "cached"):
        got = _outputs(in_place, cases, f"k-{round_}")
        want = _outputs(gather, cases, f"g-{round_}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.token_ids == w.token_ids, f"{round_} case {i}"
    for engine in engines:
        assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_blocks


def test_same_logprobs_as_the_gather_path(engines: tuple[Engine, Engine]) -> None:
    in_place, gather = engines
    prompt = list(range(5, 70))  # 65 tokens: three chunks, the last two continued
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)
    outs = [_outputs(e, [(prompt, params)], f"lp-{i}")[0] for i, e in enumerate(engines)]
    assert outs[0].token_ids == outs[1].token_ids
    got = run(in_place, [EngineRequest("lp-k", prompt, params)])["lp-k"]
    want = run(gather, [EngineRequest("lp-g", prompt, params)])["lp-g"]
    a = [lp.logprob for o in got for lp in o.logprobs]
    b = [lp.logprob for o in want for lp in o.logprobs]
    assert len(a) == len(b) == 12
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
