"""Every common decoder family is served faithfully or refused at load: greedy tokens (and
logprobs) of the engine equal transformers' own ``generate()`` over the same weights, for each
family's tiny random model (:mod:`tests.support.families`: sliding windows, soft-capping,
multipliers, MoE on), eager and compiled, through the prefill -> decode split and batched on one
engine.

Every family listed is supported (docs/models.md): a refusal at load (the engine's
:class:`~pdserve.errors.ConfigError`), an exception, a step error or a different token fails.

Engines: two per family and forward (built per case, shared by its tests, shut down before the
next case). One process compiles a forward for every family in turn, more model classes than
torch._dynamo's default ``recompile_limit`` (8) allows for the one compiled function, so the
module raises that limit while it runs; a worker process compiles one model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.workers.engine.engine import Engine, EngineRequest
from tests.support.engine import joined, make_engine, run
from tests.support.families import (
    FAMILIES,
    FEATURE_SWITCHES,
    GREEDY_LOGPROBS,
    LOGPROB_TOLERANCE,
    family_model_dir,
    family_prompts,
    hf_model,
    hf_reference,
    mismatches,
    split_greedy,
)

CASES = [(family, compiled) for family in FAMILIES for compiled in (False, True)]
Reference = list[tuple[list[int], list[float]]]


def _case_id(case: tuple[str, bool]) -> str:
    return f"{case[0]}-{'compiled' if case[1] else 'eager'}"


@dataclass
class Pair:
    family: str
    compiled: bool
    prefill: Engine
    decode: Engine
    prompts: list[list[int]]
    want: Reference
    """transformers' greedy tokens and their logprobs, per prompt."""


_REFERENCE: dict[str, Reference] = {}


def _reference(family: str, model_dir: Path, prompts: list[list[int]]) -> Reference:
    if family not in _REFERENCE:
        hf: Any = hf_model(model_dir)
        _REFERENCE[family] = [hf_reference(hf, p) for p in prompts]
    return _REFERENCE[family]


@pytest.fixture(scope="module", autouse=True)
def _recompile_limit() -> Iterator[None]:
    config: Any = torch._dynamo.config
    saved = config.recompile_limit
    config.recompile_limit = max(saved, 8 * len(FAMILIES))
    yield
    config.recompile_limit = saved


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """A prefill engine and a decode engine (different pool sizes, so block ids differ) of one
    family and forward."""
    family, compiled = request.param
    model_dir = family_model_dir(tmp_path_factory, family)
    engines: list[Engine] = []
    started = time.perf_counter()
    try:
        for num_blocks in (300, 200):
            engines.append(make_engine(model_dir, compile=compiled, num_blocks=num_blocks))
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    build_s = time.perf_counter() - started
    prefill, decode = engines
    prompts = family_prompts(prefill.tokenizer)
    want = _reference(family, model_dir, prompts)
    print(f"\n[{_case_id(request.param)}] two engines built in {build_s:.1f} s")
    yield Pair(family, compiled, prefill, decode, prompts, want)
    for engine in engines:
        engine.shutdown()


def _failure(pair: Pair, bad: list[str]) -> str:
    return f"{pair.family}: {len(bad)} of {len(pair.prompts)} prompts differ\n  " + "\n  ".join(bad)


def test_split_greedy_equals_transformers_generate(pair: Pair) -> None:
    """Prefill leg on one engine, blocks copied byte-wise, decode resumed on the other (greedy
    tokens only: the sampler's argmax path)."""
    got: list[tuple[list[int], list[float] | None]] = [
        (split_greedy(pair.prefill, pair.decode, f"split-{i}", p).token_ids, None)
        for i, p in enumerate(pair.prompts)
    ]
    bad = mismatches(pair.prompts, got, pair.want)
    assert not bad, _failure(pair, bad)
    for engine in (pair.prefill, pair.decode):
        assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_blocks


def test_batched_greedy_and_logprobs_equal_transformers_generate(pair: Pair) -> None:
    """Every prompt at once on one engine (prefill and decode steps batched), with logprobs:
    they see what greedy tokens cannot (final soft-capping, ``logits_scaling``)."""
    reqs = [EngineRequest(f"batch-{i}", p, GREEDY_LOGPROBS) for i, p in enumerate(pair.prompts)]
    outs = run(pair.prefill, reqs)
    errors = [o.error for r in reqs for o in outs[r.request_id] if o.error is not None]
    assert not errors, f"{pair.family}: engine step failed: {errors[0]}"
    got: list[tuple[list[int], list[float] | None]] = []
    for r in reqs:
        tokens = joined(outs[r.request_id]).token_ids
        got.append((tokens, [lp.logprob for o in outs[r.request_id] for lp in o.logprobs]))
    bad = mismatches(pair.prompts, got, pair.want)
    assert not bad, _failure(pair, bad)


def test_the_engines_ran_the_forward_the_case_names(pair: Pair) -> None:
    """The tokens above came from the forward the case names: with ``compile=True`` the
    compiled one (compiled at start-up, and no step fell back to eager: the runner logs and
    drops it when one fails), else the eager one."""
    for role, engine in (("prefill", pair.prefill), ("decode", pair.decode)):
        compiled = engine.runner.compiled is not None
        assert compiled == pair.compiled, f"{pair.family}: {role} engine compiled={compiled}"


@pytest.mark.parametrize(
    ("family", "feature", "off"),
    FEATURE_SWITCHES,
    ids=[f"{f}-{name.replace(' ', '-')}" for f, name, _ in FEATURE_SWITCHES],
)
def test_family_feature_changes_the_reference(
    tmp_path_factory: pytest.TempPathFactory, family: str, feature: str, off: dict[str, Any]
) -> None:
    """The tests above can see each family feature: with it off, transformers' greedy tokens
    change on some prompt, or a logprob moves by more than ten times the tolerance."""
    from transformers import AutoTokenizer

    model_dir = family_model_dir(tmp_path_factory, family)
    prompts = family_prompts(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    on = _reference(family, model_dir, prompts)
    without: Any = hf_model(model_dir, **off)
    off_ref = [hf_reference(without, p) for p in prompts]
    tokens_changed = sum(a[0] != b[0] for a, b in zip(on, off_ref, strict=True))
    same = [(a[1], b[1]) for a, b in zip(on, off_ref, strict=True) if a[0] == b[0]]
    moved = max((abs(x - y) for la, lb in same for x, y in zip(la, lb, strict=True)), default=0.0)
    assert tokens_changed or moved > 10 * LOGPROB_TOLERANCE, (
        f"{family}: turning off {feature} ({off}) changes no token and moves logprobs by "
        f"{moved:.3g} only"
    )
    print(
        f"\n[{family} {feature}] off: {tokens_changed} of {len(prompts)} prompts change tokens; "
        f"logprobs of the others move up to {moved:.3g}"
    )
