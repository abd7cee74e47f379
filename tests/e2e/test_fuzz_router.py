"""Schema fuzzing of the router's public API (issue 9): schemathesis generates requests from the
running router's ``/openapi.json`` (valid ones and, in negative mode, ones the schema forbids)
and sends them with the client API key to a real stack (router + prefill + decode on the tiny
model). It checks that:

- no response is a 5xx other than the documented 503 ``no_worker``;
- every status code, content type, header and body is the one the document declares for it;
- a request the schema forbids is refused with a 4xx, and a ``/v1`` call without the key is a
  401 (schemathesis' ``ignored_auth``);
- afterwards the stack is untouched: the router still runs, the registry holds the same
  workers (ids and epochs), ``/ready`` is 200 and lists the same workers.

Bounded for CI (about a minute on 2 cores): :data:`EXAMPLES` cases per operation and mode,
derandomized (the same cases every run), no shrinking, and every generated request decodes at
most :data:`MAX_TOKENS` tokens (a larger or missing ``max_tokens`` is lowered to it, which
keeps a valid case valid and an invalid one invalid). Valid requests name the served model
(the fuzzer would otherwise almost never get past the 404 of an unknown model).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.stack import Stack, start_stack

API_KEY = "sk-fuzz-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVED = "tiny-llama"
MAX_TOKENS = 4
EXAMPLES = {GenerationMode.POSITIVE: 100, GenerationMode.NEGATIVE: 50}
"""Cases per operation and mode (a route without parameters yields one distinct case)."""


@pytest.fixture(scope="module")
def keyed_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Router (with a client API key) + 1 prefill + 1 decode on the tiny model."""
    stack = start_stack(
        tiny_model_dir,
        SERVED,
        tmp_path_factory.mktemp("fuzz"),
        extra_router_args=("--api-key", API_KEY),
    )
    yield stack
    stack.stop()


def no_5xx_but_no_worker(ctx: Any, response: Any, case: Any) -> bool | None:
    """Schemathesis check: a 5xx is only acceptable as the documented 503 ``no_worker``."""
    if response.status_code < 500:
        return None
    code = None
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        pass
    if (response.status_code, code) != (503, "no_worker"):
        raise AssertionError(
            f"HTTP {response.status_code} ({code}) for {case.method} {case.path}: "
            f"{response.text[:500]}"
        )
    return None


CHECKS = [
    no_5xx_but_no_worker,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
]


def bound(case: Any) -> None:
    """Keep the request cheap without changing whether it is valid: name the served model
    (when the model is a string), and lower (or add) ``max_tokens`` (``max_output_tokens``
    for ``/v1/responses``) to :data:`MAX_TOKENS` when it is a valid integer above it or
    absent."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = SERVED
    present = False
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if name in body:
            present = True
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if not present:  # a Responses request (it has input) names it max_output_tokens
        body["max_output_tokens" if "input" in body else "max_tokens"] = MAX_TOKENS


def fuzz(operation: Any, mode: GenerationMode, base_url: str, statuses: Counter[str]) -> None:
    """Run :data:`EXAMPLES` ``mode`` cases of ``operation``, counting the answers' statuses in
    ``statuses``; raises the first failure. An operation without anything to make invalid
    (no parameters, no body, no security) has no negative cases."""

    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        bound(case)
        response = case.call(base_url=base_url, headers=AUTH, timeout=60)
        statuses[f"{operation.label} {response.status_code}"] += 1
        case.validate_response(
            response, checks=CHECKS, headers=AUTH, transport_kwargs={"base_url": base_url}
        )

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        if mode is not GenerationMode.NEGATIVE:
            raise


def ready(stack: Stack) -> dict[str, Any]:
    r = httpx.get(f"{stack.url}/ready", timeout=5)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def registry(stack: Stack) -> set[tuple[str, str, int]]:
    """(worker id, role, epoch) of every registered worker (read with the cluster token)."""
    return {(w["worker_id"], w["role"], w["epoch"]) for w in stack.registry_workers()}


def test_schema_fuzzing_finds_no_undeclared_or_server_error(keyed_stack: Stack) -> None:
    stack = keyed_stack
    before = ready(stack)
    registered = registry(stack)
    schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    labels: list[str] = []
    failures: list[str] = []
    statuses: Counter[str] = Counter()
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        for mode in EXAMPLES:
            try:
                fuzz(operation, mode, stack.url, statuses)
            except (Exception, BaseExceptionGroup) as exc:  # reported together below
                failures.append(f"{operation.label} [{mode.value}]: {exc}")
    elapsed = time.monotonic() - started
    print(f"fuzzed {len(labels)} operations in {elapsed:.1f} s; answers: {dict(statuses)}")
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= set(labels)
    assert not any("/registry" in label for label in labels), "internal routes are not public"
    assert not failures, "\n\n".join(failures)
    for route in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert statuses[f"{route} 200"] >= 5, f"too few requests reached the workers: {statuses}"

    # The registry is untouched: same workers, still ready, router still up.
    assert registry(stack) == registered
    after = ready(stack)
    assert (after["prefill"], after["decode"]) == (before["prefill"], before["decode"])
    assert all(proc.popen.poll() is None for proc in stack.procs.values())
    ok = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": SERVED, "prompt": "Hello", "max_tokens": 2},
        headers=AUTH,
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
