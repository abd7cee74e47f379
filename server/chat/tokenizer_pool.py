"""The router's tokenizer pool: chat templating and tokenization off the event loop.

A multi-megabyte prompt takes seconds to tokenize (5 MB of byte-level text: about 1 s with
``encode_batch_fast``, 4-5 s through ``transformers``' ``encode``). On the event loop that stalls
every stream the router relays. :class:`TokenizerPool` runs that work on a small thread pool
instead; the loop only awaits the result.

Why threads and not processes: the Hugging Face fast tokenizer's batch encode
(``encode_batch`` / ``encode_batch_fast``, which :mod:`.preprocess` calls) releases the GIL for
the whole Rust encode, so the loop keeps running while a thread tokenizes (measured in
``tests/e2e/test_stack_tokenizer_stall.py``). What still holds the GIL: the chat template
(jinja, pure Python; string concatenation, milliseconds even for a 5 MB message), turning the
ids into a Python list (about 70 ms for 5 M tokens, skipped for a prompt that cannot fit the
context window) and freeing the encoding (about 25 ms for 5 M tokens). A process pool would
remove those too but would copy every prompt and its ids between processes and hold a second
tokenizer per process.

Admission (never an unbounded backlog): a request is admitted while the work already waiting
or running stays under both bounds, else it is refused at once with 429 ``tokenizer_busy``
(``Retry-After``):

- ``max_backlog_bytes``: the request bodies (bytes) waiting or being tokenized. Tokenization
  time grows with the text, so this bounds how long an admitted request waits. A request is
  always admitted into an empty pool, so one body up to ``router.max_request_bytes`` is never
  refused for its size alone.
- ``max_backlog_requests``: the number of requests waiting or being tokenized.

The bounds hold until the work really finishes: a client that disconnects while its prompt is
being tokenized frees its share only when the thread is done with it.

Lifecycle: created by the router's lifespan (step 1), :meth:`close` in step 3 (idempotent;
queued work is cancelled, running work is not waited for). Thread-safety: :meth:`run` is called
on the event loop; the accounting is shared with the pool's threads under a lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from pdserve.errors import QueueFullError

T = TypeVar("T")

BACKLOG_BODIES = 4
"""The byte backlog bound in full-size bodies: ``max_backlog_bytes = BACKLOG_BODIES x
router.max_request_bytes`` (:func:`backlog_bytes`)."""

MAX_BACKLOG_REQUESTS = 1024
"""Requests waiting or being tokenized at most (each small prompt takes well under a
millisecond; the byte bound is the one an attacker meets first)."""


def backlog_bytes(max_request_bytes: int) -> int:
    """The pool's byte bound for bodies of at most ``max_request_bytes`` bytes."""
    return BACKLOG_BODIES * max_request_bytes


class TokenizerPool:
    """A bounded thread pool for request preprocessing (module docstring).

    ``threads``: worker threads (each tokenizes one prompt at a time); ``max_backlog_bytes``
    and ``max_backlog_requests``: the admission bounds. Raises ValueError on a bound < 1.
    """

    def __init__(
        self,
        threads: int,
        *,
        max_backlog_bytes: int,
        max_backlog_requests: int = MAX_BACKLOG_REQUESTS,
    ) -> None:
        if threads < 1 or max_backlog_bytes < 1 or max_backlog_requests < 1:
            raise ValueError("threads and the backlog bounds must be at least 1")
        self.threads = threads
        self.max_backlog_bytes = max_backlog_bytes
        self.max_backlog_requests = max_backlog_requests
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="pdserve-tokenize")
        self._lock = threading.Lock()
        self._bytes = 0
        self._requests = 0
        self._closed = False

    @property
    def backlog(self) -> tuple[int, int]:
        """``(requests, bytes)`` waiting or being tokenized now."""
        with self._lock:
            return self._requests, self._bytes

    async def run(self, size: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a pool thread, for a request of ``size`` bytes; its result, or the
        exception it raised (a typed :class:`~pdserve.errors.PdserveError` passes unchanged).

        Raises :class:`~pdserve.errors.QueueFullError` (429, code ``tokenizer_busy``) at once
        when admitting it would pass a bound, RuntimeError after :meth:`close`. Cancelling the
        caller cancels work that has not started; started work runs to its end and keeps its
        share of the backlog until then.
        """
        size = max(size, 0)
        self._admit(size)
        try:
            future: Future[T] = self._executor.submit(fn, *args)
        except BaseException:
            self._release(size)
            raise
        future.add_done_callback(lambda _: self._release(size))
        return await asyncio.wrap_future(future)

    def _admit(self, size: int) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the tokenizer pool is closed")
            full = self._requests >= self.max_backlog_requests or (
                self._requests > 0 and self._bytes + size > self.max_backlog_bytes
            )
            if full:
                busy = (
                    f"the router's tokenizer is busy ({self._requests} requests, "
                    f"{self._bytes} bytes waiting or being tokenized); retry shortly"
                )
                raise QueueFullError(busy, code="tokenizer_busy", public=busy)
            self._requests += 1
            self._bytes += size

    def _release(self, size: int) -> None:
        with self._lock:
            self._requests -= 1
            self._bytes -= size

    def close(self) -> None:
        """Refuse new work, cancel queued work, leave running work to finish on its own
        (its result is dropped); idempotent."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
