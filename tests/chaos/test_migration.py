"""Mid-stream migration under faults against ``pdserve up`` itself (issue 26).

One stack: router + 2 prefill + 2 decode workers on the tiny model, etcd discovery, 3 s lease
and registration TTL, a 45 s request deadline. Under 8 streaming greedy requests in flight at
all times, each fault is injected once (a kill -9, a SIGSTOP past the registration TTL, a
rolling restart of every worker); then no request failed, hung or differs from its prompt's
solo greedy output, and every worker's KV pool is back to its total with nothing parked. A
decode worker that had streams when it was killed, stopped or restarted must have made the
router migrate some (a row shows it in *migr D*), so the rows prove migration rather than luck.

The table (printed at the module's end) adds the router's migrations per leg, the mean of
``pdserve_router_migration_seconds`` (a migrated decode leg's failure to its new worker's first
token, exact: the histogram's sum over its count) and the load's own end-to-end latency p50/p99
of the successful requests in flight during the fault (from its injection to the first success
after its end) and of the others.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.chaos import LANES, MAX_TOKENS, UpStack, make_prompts, solo_outputs
from tests.support.chaos_faults import (
    Row,
    kill,
    rolling_restart,
    run_fault,
    sigstop,
    stopped_past_lease,
)

DEADLINE_S = 45.0
"""The request deadline: longer than a worker's restart (6-14 s on 2 busy cores)."""
ROWS: list[Row] = []


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, etcd) -> Iterator[tuple[UpStack, list[str]]]:  # type: ignore[no-untyped-def]
    up = UpStack(tiny_model_dir, tmp_path_factory.mktemp("up"), discovery=etcd.url,
                 request_timeout_s=DEADLINE_S, prefill=2, decode=2)  # fmt: skip
    try:
        up.start()
        yield up, solo_outputs(up.url, make_prompts(LANES), MAX_TOKENS, up.request_timeout_s)
    finally:
        up.stop()


def test_kill_prefill_worker(stack, prompts) -> None:  # type: ignore[no-untyped-def]
    up, expected = stack
    run_fault(up, expected, prompts, "kill -9 prefill-0 (2P+2D)", kill(up, "prefill-0"), ROWS)
    assert up.metrics(up.url)['pdserve_worker_restarts_total{role="prefill"}'] == 1


def test_kill_decode_worker(stack, prompts) -> None:  # type: ignore[no-untyped-def]
    up, expected = stack
    row = run_fault(up, expected, prompts, "kill -9 decode-0 (2P+2D)", kill(up, "decode-0"), ROWS)
    assert row.migrations.legs["decode"] > 0, row.migrations
    assert up.metrics(up.url)['pdserve_worker_restarts_total{role="decode"}'] == 1


def test_sigstop_prefill_worker(stack, prompts) -> None:  # type: ignore[no-untyped-def]
    up, expected = stack
    stopped_s = stopped_past_lease(up)
    run_fault(up, expected, prompts, f"SIGSTOP prefill-1 {stopped_s:g} s (2P+2D)",
              sigstop(up, "prefill-1", stopped_s), ROWS)  # fmt: skip


def test_sigstop_decode_worker(stack, prompts) -> None:  # type: ignore[no-untyped-def]
    up, expected = stack
    stopped_s = stopped_past_lease(up)
    row = run_fault(up, expected, prompts, f"SIGSTOP decode-1 {stopped_s:g} s (2P+2D)",
                    sigstop(up, "decode-1", stopped_s), ROWS)  # fmt: skip
    assert row.migrations.legs["decode"] > 0, row.migrations


def test_rolling_restart(stack, prompts) -> None:  # type: ignore[no-untyped-def]
    up, expected = stack
    before = up.metrics(up.url)
    row = run_fault(up, expected, prompts, "rolling restart, SIGTERM (2P+2D)",
                    rolling_restart(up, up.names), ROWS)  # fmt: skip
    assert row.migrations.legs["decode"] > 0, row.migrations
    after = up.metrics(up.url)
    for role in ("prefill", "decode"):
        key = f'pdserve_worker_restarts_total{{role="{role}"}}'
        assert after[key] - before[key] == 2, (role, before[key], after[key])
