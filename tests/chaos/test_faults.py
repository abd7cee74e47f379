"""Faults under steady load against ``pdserve up`` itself (issue 9, item 6; issue 26).

Two stacks (router + 1 prefill + 1 decode on the tiny model, 3 s lease and registration TTL):
one on etcd discovery for the process faults and the etcd restart, with a 45 s request
deadline that outlasts a worker's restart, one on NATS (12 s deadline) for the NATS
restart, and one with two router replicas on the embedded default (``--routers 2``) for a
router's kill. Under 8 streaming requests in flight at all times, each fault is injected once; then,
for every request: it ended (success or an explicit error) within its deadline, and no complete
stream differs from the prompt's solo greedy output; after the load stops, every worker's KV
pool is back to its total with nothing parked (no lease left); and a new request succeeded
within :data:`~tests.support.chaos.RECOVER_S` of the fault's end.

A worker's fault fails no request: the router holds requests while no worker can serve them
(``router.worker_wait_s``), retries a failed prefill leg and migrates a failed decode leg to
the restarted worker (``router.migration_limit``). Killing one of two router replicas fails
only the streams it was relaying (clients retry a refused connection, as the ``openai`` client
does); the control plane's restarts may fail requests, but a request sent after the fault
ended fails fast. The
table is printed at the end of each module (docs/reliability.md holds one from a real run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.chaos import LANES, MAX_TOKENS, UpStack, make_prompts, solo_outputs
from tests.support.chaos_faults import Row, kill, run_fault, sigstop, stopped_past_lease
from tests.support.procfs import listening_ports
from tests.support.servers import ServerProcess, wait_until_sync

ETCD_DEADLINE_S = 45.0
"""The etcd stack's request deadline: longer than a worker's restart (6-14 s on 2 busy cores)
plus the router's wait for it."""
ROWS: list[Row] = []


def _stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, url: str, deadline_s: float
) -> Iterator[tuple[UpStack, list[str]]]:
    stack = UpStack(tiny_model_dir, tmp_path_factory.mktemp("up"), discovery=url,
                    request_timeout_s=deadline_s)  # fmt: skip
    try:
        stack.start()
        expected = solo_outputs(stack.url, make_prompts(LANES), MAX_TOKENS, stack.request_timeout_s)
        yield stack, expected
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def etcd_stack(tiny_model_dir, tmp_path_factory, etcd):  # type: ignore[no-untyped-def]
    yield from _stack(tiny_model_dir, tmp_path_factory, etcd.url, ETCD_DEADLINE_S)


@pytest.fixture(scope="module")
def nats_stack(tiny_model_dir, tmp_path_factory, nats):  # type: ignore[no-untyped-def]
    yield from _stack(tiny_model_dir, tmp_path_factory, nats.url, 12.0)


def test_kill_prefill_worker(etcd_stack, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = etcd_stack
    run_fault(stack, expected, prompts, "kill -9 prefill worker", kill(stack, "prefill-0"), ROWS)
    log = stack.log.read_text(errors="replace")
    assert (
        "pdserve: prefill-0 exited with code -9; restarting in 0.2 s (restart 1 of at most 5" in log
    )
    router = stack.metrics(stack.url)
    assert router['pdserve_worker_restarts_total{role="prefill"}'] == 1
    assert stack.metrics(stack.worker_url("prefill-0"))["pdserve_process_restarts"] == 1


def test_kill_decode_worker(etcd_stack, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = etcd_stack
    row = run_fault(stack, expected, prompts, "kill -9 decode worker", kill(stack, "decode-0"),
                    ROWS)  # fmt: skip
    assert stack.metrics(stack.url)['pdserve_worker_restarts_total{role="decode"}'] == 1
    # its streams in flight were continued on its restarted self, not failed
    assert row.migrations.legs["decode"] > 0, row.migrations


def test_sigstop_decode_worker_longer_than_the_lease(etcd_stack, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = etcd_stack
    stopped_s = stopped_past_lease(stack)
    fault = f"SIGSTOP decode worker {stopped_s:g} s"
    row = run_fault(stack, expected, prompts, fault, sigstop(stack, "decode-0", stopped_s), ROWS)
    assert row.migrations.legs["decode"] > 0, row.migrations


@pytest.fixture(scope="module")
def replicas_stack(tiny_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """``pdserve up --routers 2`` on the embedded default: the registry shared through SQLite."""
    stack = UpStack(tiny_model_dir, tmp_path_factory.mktemp("up"), routers=2)
    try:
        stack.start()
        wait_until_sync(lambda: all(stack.port in listening_ports(stack.pid(f"router-{i}"))
                                    for i in range(2)), 60, interval_s=0.1,
                        what=lambda: f"both router replicas listening:\n{stack.tail()}")  # fmt: skip
        expected = solo_outputs(stack.url, make_prompts(LANES), MAX_TOKENS, stack.request_timeout_s)
        yield stack, expected
    finally:
        stack.stop()


def test_kill_one_of_two_routers(replicas_stack, prompts) -> None:  # type: ignore[no-untyped-def]
    """Issue 42, item 2: the clients retry a refused or reset connection (as the openai client
    does), so only the streams the killed replica was relaying fail; up restarts it, and it
    serves again with the shared registry's workers."""
    stack, expected = replicas_stack
    row = run_fault(stack, expected, prompts, "kill -9 1 of 2 routers (embedded)",
                    kill(stack, "router-1"), ROWS, in_flight_may_fail=True)  # fmt: skip
    assert "pdserve: router-1 exited with code -9; restarting" in stack.log.read_text()
    new = stack.pid("router-1")
    wait_until_sync(lambda: stack.port in listening_ports(new), 60, interval_s=0.1,
                    what=lambda: f"the restarted replica listening:\n{stack.tail()}")  # fmt: skip
    assert row.counts["failed"] <= LANES, row.seen()


def _outage(stack: UpStack, server: ServerProcess) -> Callable[[], None]:
    """Stop the control plane until a worker notices (its /ready goes 503), then start it."""

    def worker_noticed() -> bool:
        try:
            r = httpx.get(f"{stack.worker_url('decode-0')}/ready", timeout=2, trust_env=False)
        except httpx.HTTPError:
            return False
        return r.status_code == 503

    def inject() -> None:
        server.stop()
        try:
            wait_until_sync(worker_noticed, 30, interval_s=0.1, what="a worker to notice")
        finally:
            server.start()

    return inject


def test_etcd_restart(etcd_stack, etcd, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = etcd_stack
    run_fault(stack, expected, prompts, "etcd restart", _outage(stack, etcd), ROWS, may_fail=True)


def test_nats_restart(nats_stack, nats, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = nats_stack
    run_fault(stack, expected, prompts, "NATS restart", _outage(stack, nats), ROWS, may_fail=True)
