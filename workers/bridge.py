"""Bridge from the engine thread to the worker's asyncio event loop.

The engine calls a request's sink on its own step thread; :class:`OutputStream` turns those
calls into an async iterator on the event loop (``loop.call_soon_threadsafe``), so the sink
never blocks the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.workers.engine import EngineOutput


class OutputStream:
    """Async iterator over one request's :class:`EngineOutput` objects, ending after the output
    that carries a ``finish_reason`` (or, in prefill mode, the single output).

    Create it on the event loop; pass :meth:`sink` to ``Engine.add_request``.
    """

    def __init__(self, *, single: bool = False) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._single = single
        self._done = False

    def sink(self, output: EngineOutput) -> None:
        """Called on the engine thread; never blocks."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, output)

    async def next(self, timeout: float | None) -> EngineOutput:
        """The next output; raises ``TimeoutError`` after ``timeout`` seconds."""
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def __aiter__(self) -> AsyncIterator[EngineOutput]:
        while not self._done:
            out = await self._queue.get()
            self._done = self._single or out.finish_reason is not None or out.error is not None
            yield out
