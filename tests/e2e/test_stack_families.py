"""Every common decoder family through the whole disaggregated path: router + prefill + decode
(eager, ``--no-compile``) worker processes (the router hands every request off) serve each
family's tiny random model (:mod:`tests.support.families`) with transformers' greedy tokens and
logprobs, read from the completions API (prompt as token ids, ``ignore_eos``, ``logprobs=0``).

Every family listed is supported (docs/models.md): a worker that refuses its model at load or
dies fails the test.

The prefill worker runs the compiled forward for :data:`COMPILED` only: every family's compiled
forward is checked against transformers, eager and compiled, on both roles in one process by
tests/integration/test_engine_families.py, and compiling each family once more here cost CI
about 15 s per family.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from pdserve.server.rendering.logprobs import TokenRenderer
from tests.support.families import (
    FAMILIES,
    MAX_NEW_TOKENS,
    family_model_dir,
    family_prompts,
    hf_model,
    hf_reference,
    mismatches,
)
from tests.support.stack import Stack

COMPILED = FAMILIES[0]
"""The family whose prefill worker compiles its forward here (the others run eager)."""


@dataclass
class FamilyStack:
    family: str
    stack: Stack
    model_dir: Path


@pytest.fixture(scope="module", params=FAMILIES)
def family_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FamilyStack]:
    """Router + 1 prefill (compiled forward for :data:`COMPILED`, else eager) + 1 decode
    (eager) on one family's tiny model: the tokens cross both workers and the hand-off."""
    family: str = request.param
    model_dir = family_model_dir(tmp_path_factory, family)
    started = time.perf_counter()
    stack = Stack(
        model_dir=model_dir,
        served_model_name=family,
        log_dir=tmp_path_factory.mktemp(f"stack-{family}"),
    )
    try:
        stack.start_router()
        compile_flag = "--compile" if family == COMPILED else "--no-compile"
        stack.start_worker("prefill", "prefill-0", (compile_flag,))
        stack.start_worker("decode", "decode-0", ("--no-compile",))
        stack.wait_ready(2)
    except BaseException:
        stack.stop()
        raise
    print(f"\n[{family}] stack ready in {time.perf_counter() - started:.1f} s")
    try:
        yield FamilyStack(family, stack, model_dir)
    finally:
        stack.stop()


def _complete(fs: FamilyStack, prompt: list[int]) -> tuple[list[str], list[float]]:
    body = {
        "model": fs.family,
        "prompt": prompt,
        "max_tokens": MAX_NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    resp = httpx.post(f"{fs.stack.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    logprobs = resp.json()["choices"][0]["logprobs"]
    return list(logprobs["tokens"]), [float(v) for v in logprobs["token_logprobs"]]


def test_greedy_completions_equal_transformers_generate(family_stack: FamilyStack) -> None:
    """Token for token (as the API's token strings) and logprob for logprob."""
    fs = family_stack
    tok = AutoTokenizer.from_pretrained(fs.model_dir, local_files_only=True)
    text = TokenRenderer(tok).text
    prompts = family_prompts(tok)
    hf: Any = hf_model(fs.model_dir)
    want = []
    for p in prompts:
        tokens, logprobs = hf_reference(hf, p)
        want.append(([text(t) for t in tokens], logprobs))
    started = time.perf_counter()
    got: list[tuple[list[Any], list[float] | None]] = [_complete(fs, p) for p in prompts]
    print(f"\n[{fs.family}] {len(prompts)} completions in {time.perf_counter() - started:.1f} s")
    bad = mismatches(prompts, got, want)
    assert not bad, f"{fs.family}: {len(bad)} of {len(prompts)} prompts differ\n  " + "\n  ".join(
        bad
    )


def test_the_prefill_worker_runs_the_forward_it_was_given(family_stack: FamilyStack) -> None:
    """The completions above crossed the forward the prefill worker was started with: for
    :data:`COMPILED` the compiled one (compiled at start-up, never fell back to eager), for
    the others the eager one (``--no-compile`` compiles nothing)."""
    family = family_stack.family
    log = family_stack.stack.procs["prefill-0"].log()
    compiled = "compiled the model forward in" in log
    assert compiled == (family == COMPILED), f"{family}: compiled={compiled}"
    assert "running eagerly" not in log, f"{family}: fell back to eager"
