"""Several prompts in one ``/v1/completions`` request: one router transaction per prompt, their
events merged into one stream.

Each prompt runs as its own request (its own route, legs and deadline; id
``<request id>-<k>``), so the prompts of a batch spread over the workers like separate requests
would. Choice ``i`` of prompt ``k`` is choice ``k * n + i`` of the response (OpenAI's order).
Events reach the renderer as each transaction yields them, interleaved. A transaction that
fails ends the batch with its error (the others are closed); closing the batch closes all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Protocol

from pdserve.observability.tracing import Timeline
from pdserve.protocol import SamplingParams
from pdserve.router.request import TokenEvent
from pdserve.router.transaction import Transaction
from pdserve.security import Tenant


class Started(Protocol):
    """What the server reads of a started transaction (a router :class:`Transaction`)."""

    @property
    def request_id(self) -> str: ...

    def events(self) -> AsyncGenerator[TokenEvent, None]: ...

    def ready(self) -> bool:
        """Whether ``events()`` has its next event at hand (nothing to wait on)."""
        ...

    async def aclose(self) -> None: ...


class Starter(Protocol):
    """The router (:meth:`pdserve.router.router.Router.start`)."""

    async def start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        timeline: Timeline | None = None,
        session_id: str | None = None,
        tenant: Tenant | None = None,
        priority: int = 0,
    ) -> Transaction: ...


class BatchTransaction:
    """The transactions of a batch's prompts as one (:class:`Started`); ``n`` choices each."""

    def __init__(
        self, request_id: str, txns: Sequence[Started], n: int, timelines: Sequence[Timeline] = ()
    ):
        self._request_id = request_id
        self.txns = list(txns)
        self.n = n
        self.timelines = list(timelines)  # the prompts' (tracing), ended by aclose
        self._queue: asyncio.Queue[TokenEvent | BaseException | None] | None = None

    @property
    def request_id(self) -> str:
        return self._request_id

    @classmethod
    async def start(
        cls,
        router: Starter,
        request_id: str,
        prompts: Sequence[tuple[Sequence[int], SamplingParams]],
        timeline: Timeline | None = None,
        tenant: Tenant | None = None,
        priority: int = 0,
    ) -> BatchTransaction:
        """Start every prompt's transaction (concurrently); if one cannot start, close the
        others and raise its error (nothing has reached the client yet). Each prompt gets a
        timeline of its own, a child of ``timeline`` (span ``prompt K``), ended with the
        batch (:meth:`aclose`). ``tenant``, ``priority``: every prompt's place in the fair
        queue."""
        parent = timeline.traceparent() if timeline is not None else None
        timelines = [
            Timeline(f"prompt {k}", traceparent=parent, server=False) for k in range(len(prompts))
        ]
        results = await asyncio.gather(
            *(
                router.start(f"{request_id}-{k}", ids, s, tl, None, tenant, priority)
                for k, ((ids, s), tl) in enumerate(zip(prompts, timelines, strict=True))
            ),
            return_exceptions=True,
        )
        for tl, result in zip(timelines, results, strict=True):
            if isinstance(result, BaseException):
                tl.finish(repr(result))
        txns = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for txn in txns:
                await txn.aclose()
            raise errors[0]
        return cls(request_id, txns, prompts[0][1].n, timelines)

    async def events(self) -> AsyncGenerator[TokenEvent, None]:
        """Every transaction's events as they come, each choice renumbered ``k * n + i``."""
        queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()
        self._queue = queue

        async def pump(k: int, txn: Started) -> None:
            try:
                async for event in txn.events():
                    await queue.put(replace(event, index=k * self.n + event.index))
                await queue.put(None)
            except BaseException as exc:  # cancellation included: the consumer is gone
                await queue.put(exc)
                raise

        tasks = [asyncio.create_task(pump(k, t)) for k, t in enumerate(self.txns)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task

    def ready(self) -> bool:
        """Whether :meth:`events` has its next event at hand (one is queued)."""
        return self._queue is not None and not self._queue.empty()

    async def aclose(self) -> None:
        """Close every transaction (idempotent, as each one's ``aclose`` is) and end the
        prompts' timelines."""
        try:
            for txn in self.txns:
                await txn.aclose()
        finally:
            for timeline in self.timelines:
                timeline.finish()
