"""One OpenMP thread team per engine process: heavy torch work off every thread but the engine's.

torch's CPU build runs its intra-op parallelism (ATen, oneDNN, inductor's C++ kernels) on GNU
OpenMP, and libgomp keeps one pool of worker threads per thread that ever opened a parallel
region, for the life of that thread. When the threads of all pools together outnumber the CPUs
the process may use, libgomp cuts the time its workers spin between parallel regions from
~300,000 iterations to 100 ("throttled" spinning), so every region of a decode step (hundreds
per forward) waits for its workers to wake from a futex. A worker that loaded its model on the
main thread (a pool of ``threads`` there) and then decodes on the engine thread (a second pool)
is in that state: measured on the 2-core AMD EPYC dev machine, SmolLM2 at 2 threads, one decode
step takes 42 ms on the engine thread after a main-thread load and 21 ms after a load on a
thread that has exited (its pool goes with it), the same as on the main thread alone.

So :func:`in_fresh_thread` runs the engine's construction (model load, compile warm-up,
load-time probe, pool allocation) on a short-lived thread, and the step loop is then the only
long-lived thread with a team. Threads that must stay (the event loop, transfer threads) should
not run large torch ops on the pool; the same-layout hand-off reads and writes it through
memoryviews (no torch op), so only the engine thread forms a team in a serving worker.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_fresh_thread(fn: Callable[[], T], name: str = "pdserve-engine-setup") -> T:
    """``fn()`` run on a new thread that exits when it returns (its OpenMP pool with it), in a
    copy of the caller's context (context variables, e.g. torch's dynamo and inductor config
    overrides, which a bare thread would not see); returns its result or raises its
    exception, on the calling thread, which blocks meanwhile. Thread-locals do not carry."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    context_thread(run, name).join()
    if error:
        raise error[0]
    return result[0]


def context_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A started daemon thread running ``target()`` in a copy of the caller's context (torch's
    config overrides are context variables, which a bare thread would not see)."""
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name=name, daemon=True)
    thread.start()
    return thread
