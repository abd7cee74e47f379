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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


def context_thread(
    target: Callable[[], object], name: str, *, stack_bytes: int = 0
) -> threading.Thread:
    """A started daemon thread running ``target()`` in a copy of the caller's context (torch's
    config overrides are context variables, which a bare thread would not see).
    ``stack_bytes``: the thread's stack (0: the platform's default, usually ``ulimit -s``)."""
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name=name, daemon=True)
    start_with_stack(thread, stack_bytes)
    return thread


_STACK_LOCK = threading.Lock()


@contextmanager
def thread_stack(stack_bytes: int) -> Iterator[None]:
    """Threads started inside get a stack of ``stack_bytes`` (0: the default). Python sets the
    size of new threads process-wide, so it is set and restored under a lock; a thread another
    caller starts meanwhile may get the larger stack too (address space, not memory)."""
    if not stack_bytes:
        yield
        return
    with _STACK_LOCK:
        previous = threading.stack_size(stack_bytes)
        try:
            yield
        finally:
            threading.stack_size(previous)


def start_with_stack(thread: threading.Thread, stack_bytes: int) -> None:
    """Start ``thread`` with a stack of ``stack_bytes`` (0: the default; :func:`thread_stack`)."""
    with thread_stack(stack_bytes):
        thread.start()
