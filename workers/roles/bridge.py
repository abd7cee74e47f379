"""Bridge from the engine thread to the worker's asyncio event loop.

The engine calls a request's sink on its own step thread; :class:`OutputStream` turns those
calls into an async iterator on the event loop (``loop.call_soon_threadsafe``), so the sink
never blocks the engine. A draining worker interrupts its streams
(:meth:`OutputStream.interrupt`): the reader then gets :class:`StreamInterrupted` instead of
waiting for the next output.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.workers.engine.engine import EngineOutput
    from pdserve.workers.roles.timing import EngineClock


class StreamInterrupted(Exception):
    """Raised by :meth:`OutputStream.next` once the stream was interrupted (worker draining)."""


class OutputStream:
    """Async iterator over one request's :class:`EngineOutput` objects.

    ``choices``: the choices the request runs here, as indices (a migrated request runs only
    some, ``GenerationRequest.choices``) or as a count ``n`` (choices ``0..n-1``,
    ``SamplingParams.n``); their outputs interleave, each naming its choice
    (``EngineOutput.index``). The stream is :attr:`done` after every choice's final output (one
    carrying ``finish_reason`` or ``error``), or, with ``single`` (prefill mode: one output for
    the whole request), after the first output.

    Create it on the event loop; pass :meth:`sink` to ``Engine.add_request``. Only the event
    loop reads it (:meth:`next` or ``async for``) and interrupts it (:meth:`interrupt`).
    ``clock`` (created just before ``add_request``) sees every output read: the request's
    engine phases (:class:`~pdserve.workers.roles.timing.EngineClock`).
    """

    def __init__(
        self,
        *,
        single: bool = False,
        choices: int | Iterable[int] = 1,
        clock: EngineClock | None = None,
    ) -> None:
        self.clock = clock
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[EngineOutput | None] = asyncio.Queue()  # None: interrupted
        self._single = single
        self._unfinished = set(range(choices) if isinstance(choices, int) else choices)
        self.interrupted = False

    @property
    def done(self) -> bool:
        """True once every choice's final output has been read."""
        return not self._unfinished

    @property
    def unfinished(self) -> frozenset[int]:
        """The choices whose final output has not been read yet."""
        return frozenset(self._unfinished)

    def interrupt(self) -> None:
        """Make the reader's next :meth:`next` raise :class:`StreamInterrupted` once the outputs
        already queued are read, waking it if it waits; idempotent. Event loop only."""
        if not self.interrupted:
            self.interrupted = True
            self._queue.put_nowait(None)

    def sink(self, output: EngineOutput) -> None:
        """Called on the engine thread; never blocks."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, output)

    async def next(self, timeout: float | None) -> EngineOutput:
        """The next output; raises ``TimeoutError`` after ``timeout`` seconds,
        :class:`StreamInterrupted` after :meth:`interrupt`."""
        out = await asyncio.wait_for(self._queue.get(), timeout)
        if out is None:
            self._queue.put_nowait(None)  # every later call raises too
            raise StreamInterrupted
        if self.clock is not None:
            self.clock.observe(out)
        if self._single:
            self._unfinished.clear()
        elif out.finish_reason is not None or out.error is not None:
            self._unfinished.discard(out.index)
        return out

    async def __aiter__(self) -> AsyncIterator[EngineOutput]:
        while not self.done:
            yield await self.next(None)
