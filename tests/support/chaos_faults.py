"""The chaos suite's faults and its table (tools in :mod:`tests.support.chaos`).

- :func:`run_fault`: one fault under the steady load, its checks and its :class:`Row`;
  :func:`kill`, :func:`sigstop`, :func:`rolling_restart`: the faults. A decode worker's fault
  waits until that worker has a sequence in its running batch (:func:`wait_busy`): a 32-token
  stream spends most of its ~0.2 s outside the decode worker's batch (prefill leg, KV pull,
  HTTP), so a fault injected blind often met no stream there and its row proved nothing
  about migration (the suite's ``migr D > 0`` checks failed in two of four runs).
- :class:`Row` / :func:`table`: one line per fault.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from pdserve.router.migration import LOST_GRACE_S
from tests.support.chaos import (
    FAIL_FAST_S,
    KINDS,
    LANES,
    MAX_TOKENS,
    QUIESCE_S,
    READY_S,
    RECOVER_S,
    Load,
    Migrations,
    UpStack,
    role_of,
)
from tests.support.servers import wait_until_sync

# --- faults -------------------------------------------------------------------------------------


BUSY_S = 30.0
"""A decode worker under the steady load has a sequence running within this."""


def wait_busy(stack: UpStack, name: str) -> None:
    """For a decode worker ``name``: wait until its ``pdserve_num_requests_running`` gauge is
    above 0, polling every 5 ms, so the fault injected next meets a stream in its running batch
    (a 32-token stream stays there for tens of milliseconds). Other workers: return at once."""
    if role_of(name) != "decode":
        return

    def busy() -> bool:
        try:
            m = stack.metrics(stack.worker_url(name))
        except (httpx.HTTPError, LookupError):
            return False
        return m.get("pdserve_num_requests_running", 0.0) > 0

    wait_until_sync(busy, BUSY_S, interval_s=0.005, what=f"a sequence running on {name}")


def stopped_past_lease(stack: UpStack) -> float:
    """Seconds a SIGSTOP must last for the router to give up the stopped worker's legs: its
    registration expires within ``ttl_s`` of the stop (the last refresh was up to ``ttl_s / 3``
    before it), then the router waits :data:`LOST_GRACE_S` for a silent leg; 2 s more cover
    etcd's expiry sweep and a loaded router (``ttl_s + 2`` alone left at most a second, and
    SIGCONT sometimes came first)."""
    return stack.ttl_s + LOST_GRACE_S + 2.0


def kill(stack: UpStack, name: str) -> Callable[[], None]:
    """SIGKILL ``name`` (a decode worker once it has a stream: :func:`wait_busy`); the fault
    ends when up has started it again (a new pid)."""

    def inject() -> None:
        wait_busy(stack, name)
        old = stack.pid(name)
        os.kill(old, signal.SIGKILL)
        struck[0] = time.monotonic()
        wait_restarted(stack, name, old, 30)

    struck = [0.0]
    inject.struck = struck  # type: ignore[attr-defined]  # when the signal went: run_fault
    return inject


def sigstop(stack: UpStack, name: str, stopped_s: float) -> Callable[[], None]:
    """SIGSTOP ``name`` (a decode worker once it has a stream: :func:`wait_busy`) for
    ``stopped_s`` seconds, then SIGCONT; the fault ends there."""

    def inject() -> None:
        wait_busy(stack, name)
        pid = stack.pid(name)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(stopped_s)  # the fault itself: stopped for that long
        finally:
            os.kill(pid, signal.SIGCONT)

    return inject


def rolling_restart(stack: UpStack, names: list[str]) -> Callable[[], None]:
    """One worker at a time: SIGTERM it (it drains: a decode worker hands its streams back to
    the router to migrate), wait until up has started it again (a new pid) and it is ready
    again (:meth:`UpStack.worker_ready`), then the next; the fault ends with the last one."""

    def inject() -> None:
        for name in names:
            wait_busy(stack, name)
            old = stack.pid(name)
            os.kill(old, signal.SIGTERM)
            wait_restarted(stack, name, old, 60)
            wait_ready(stack, name)

    return inject


def wait_restarted(stack: UpStack, name: str, old: int, timeout_s: float) -> None:
    """Wait until up runs ``name`` with another pid than ``old``."""
    wait_until_sync(lambda: stack.pids().get(name, old) != old, timeout_s, interval_s=0.05,
                    what=lambda: f"up to restart {name}:\n{stack.tail()}")  # fmt: skip


def wait_ready(stack: UpStack, name: str) -> None:
    """Wait until ``name`` is ready (:meth:`UpStack.worker_ready`)."""
    wait_until_sync(lambda: stack.worker_ready(name), READY_S, interval_s=0.1,
                    what=lambda: f"{name} ready: {stack.router_view()}\n{stack.tail()}")  # fmt: skip


def run_fault(
    stack: UpStack, expected: list[str], prompts: list[list[int]], fault: str,
    inject: Callable[[], None], rows: list[Row], *, may_fail: bool = False,
    in_flight_may_fail: bool = False,
) -> Row:  # fmt: skip
    """Steady load, ``inject()`` (returns when the fault has ended), a probe until a request
    succeeds, every worker ready again, more load, quiesce; record the row in ``rows``, then
    check it: nothing hung or mismatched, the pools clean and, unless ``may_fail``, no request
    failed; with ``may_fail`` (the fault is the client's endpoint, or the control plane), a
    request sent after the fault ended fails within :data:`FAIL_FAST_S`. With
    ``in_flight_may_fail`` (one of several router replicas killed) the clients retry a
    connection refused or reset before its answer, as the ``openai`` client does, and only a
    stream already answered when the fault struck may fail (``broken mid-stream``)."""
    assert stack.serves(), f"the stack does not serve before {fault}:\n{stack.tail()}"
    load = Load(stack.url, prompts, expected, max_tokens=MAX_TOKENS,
                deadline_s=stack.request_timeout_s, lanes=LANES,
                retries=in_flight_may_fail).start()  # fmt: skip
    try:
        wait_until_sync(lambda: load.count() >= LANES, 60, interval_s=0.1, what="steady load")
        before = stack.migrations()
        fault_start = time.monotonic()
        inject()
        fault_end = time.monotonic()
        recover_s = wait_until_sync(stack.serves, RECOVER_S, interval_s=0.2,
                                    what=lambda: f"service after {fault}:\n{stack.tail()}")  # fmt: skip
        recovered = time.monotonic()
        wait_until_sync(lambda: all(stack.worker_ready(n) for n in stack.names), READY_S,
                        interval_s=0.2, what=lambda: f"every worker ready after {fault}: "
                        f"{stack.router_view()}\n{stack.tail()}")  # fmt: skip
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
    during, calm = load.split_ok(fault_start, recovered)
    row = Row(fault, counts, leaked, recover_s, gap_fail_s, load.failures(),
              stack.migrations().since(before), during, calm)  # fmt: skip
    rows.append(row)
    print(f"{row.line()} {row.seen()}")
    bad = [o for o in load.outcomes if o.kind in ("hung", "mismatched")]
    assert not bad, f"{fault}: {bad[:5]}"
    assert counts["ok"] >= 2 * LANES
    if may_fail:
        assert gap_fail_s <= FAIL_FAST_S, (
            f"{fault}: a request in the gap took {gap_fail_s:.1f} s to fail"
        )
    else:
        failed = [o for o in load.outcomes if o.kind == "failed"]
        if in_flight_may_fail:  # only streams the killed replica was relaying
            struck = inject.struck[0]  # type: ignore[attr-defined]
            failed = [o for o in failed if not (o.detail.startswith("broken mid-stream")
                                                and o.start <= struck <= o.end)]  # fmt: skip
        assert not failed, f"{fault}: {len(failed)} failed: {row.seen()}; {failed[:3]}"
    pools = stack.pools()
    assert stack.quiet(), f"{fault}: KV pools not back to their totals: {pools}"
    return row


def percentiles(values: list[float]) -> tuple[float, float] | None:
    """(p50, p99) of ``values`` by nearest rank; None when empty."""
    if not values:
        return None
    v = sorted(values)

    def rank(q: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]

    return rank(0.5), rank(0.99)


# --- the table ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One fault's line of the table: outcomes by kind, KV blocks still used after the quiesce
    wait, seconds to the first successful request after the fault's end, the router's
    migrations, and the end-to-end seconds (p50/p99) of the successful requests in flight
    during the fault (from its injection to that first success) and of the others (calm)."""

    fault: str
    counts: Counter[str]
    leaked: int
    recover_s: float
    gap_fail_s: float = 0.0
    """The slowest failure among the requests sent after the fault ended (the gap)."""
    failures: Counter[str] = field(default_factory=Counter)
    migrations: Migrations = field(default_factory=Migrations)
    during: list[float] = field(default_factory=list)
    calm: list[float] = field(default_factory=list)

    def seen(self) -> str:
        """The explicit failures, most common first: ``HTTP 503 no_worker x12, ...``."""
        return ", ".join(f"{what} x{n}" for what, n in self.failures.most_common()) or "-"

    def line(self) -> str:
        c, m = self.counts, self.migrations
        avg = f"{m.seconds / m.timed:.2f}" if m.timed else "-"
        return (f"| {self.fault:<34} | {c['ok']:>4} | {c['failed']:>6} | {c['hung']:>4} | "
                f"{c['mismatched']:>10} | {self.leaked:>13} | {self.recover_s:>9.1f} | "
                f"{self.gap_fail_s:>13.2f} | {m.legs['prefill']:>6} | {m.legs['decode']:>6} | "
                f"{avg:>10} | {_p(self.during):>17} | {_p(self.calm):>17} |")  # fmt: skip


def _p(values: list[float]) -> str:
    """``p50 / p99`` seconds (``n=`` how many), ``-`` for none."""
    p = percentiles(values)
    return "-" if p is None else f"{p[0]:.1f} / {p[1]:.1f} n={len(values)}"


HEADER = (
    "| fault                              |   ok | failed | hung | mismatched | blocks leaked |"
    " recover s | gap failure s | migr P | migr D | migr avg s | fault e2e p50/p99 |"
    "  calm e2e p50/p99 |\n"
    "|------------------------------------|-----:|-------:|-----:|-----------:|--------------:|"
    "----------:|--------------:|-------:|-------:|-----------:|------------------:|"
    "------------------:|"
)


def table(rows: list[Row]) -> str:
    """The fault table, then what each fault's failed requests saw."""
    seen = [f"- {r.fault}: {r.seen()}" for r in rows]
    return "\n".join([HEADER, *(r.line() for r in rows), "", "failed requests saw:", *seen])
