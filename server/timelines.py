"""The router's side of a request's timeline (:mod:`pdserve.observability.tracing`): the request span that
the HTTP handler opens (continuing a client's W3C ``traceparent``), its GenAI attributes, and
the phase line logged when the response ends.

The router's phases tile the request from the handler's start to the response's end:
``tokenize`` (receiving and validating the body, applying the chat template, tokenizing), ``route`` (the routing decision,
including any wait for a worker), then either ``prefill`` (the prefill leg, until P's first
token) and ``decode_first`` (the decode leg until its first chunk: D's KV pull and first step)
or ``first_token`` (a worker that prefills itself), then ``decode`` (until the last token) and
``respond`` (the rest of the response). ``retry`` and ``migration`` are the time lost to a
failed leg. Names with a dot are a worker's own phases of the phase before the dot
(``prefill.queue``, ``decode.kv_pull``; :mod:`pdserve.workers.roles.timing`): they break that
phase down and do not add to the total.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol, TypeVar

from starlette.requests import Request

from pdserve.errors import ClientDisconnectedError
from pdserve.observability.logs import bind_request
from pdserve.observability.tracing import Timeline

if TYPE_CHECKING:
    from starlette.requests import Request

    from pdserve.protocol import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


def received_ns(request: Request) -> int:
    """When the request's head arrived (``time.time_ns()``, stamped by the public plane's
    guard before the body is read and validated), else now."""
    stamped = getattr(request.state, "received_ns", None)
    return stamped if isinstance(stamped, int) else time.time_ns()


def request_timeline(
    request: Request,
    operation: str,
    model: str,
    request_id: str,
    prompt_tokens: int,
    sampling: SamplingParams,
    start_ns: int,
) -> Timeline:
    """The request's timeline, started at ``start_ns`` (``time.time_ns()`` when the handler
    began) with its ``tokenize`` phase ending now; names the request on this task's log
    lines. ``operation``: GenAI's ``gen_ai.operation.name`` (``chat``, ``text_completion``)."""
    timeline = Timeline(
        f"{operation} {model}",
        traceparent=request.headers.get("traceparent"),
        start_ns=start_ns,
        attributes={
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "pdserve",
            "gen_ai.request.model": model,
            "gen_ai.response.id": request_id,
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.choice.count": sampling.n,
            "pdserve.request_id": request_id,
        },
    )
    if sampling.seed is not None:
        timeline.set(gen_ai_request_seed=sampling.seed)
    timeline.mark("tokenize")
    span = timeline.span
    bind_request(request_id, f"{span.get_span_context().trace_id:032x}" if span else None)
    return timeline


def end_request(timeline: Timeline, request_id: str, *, phase_log: bool) -> None:
    """End the request's timeline (``respond`` ends now) and log its phase line at info
    (``phase_log``). Idempotent."""
    if timeline.finished_ns is not None:
        return
    timeline.mark("respond")
    timeline.finish()
    if phase_log:
        outcome = f"failed ({timeline.error})" if timeline.error else "done"
        log.info("req %s: %s; phases %s", request_id, outcome, timeline.summary())


def closer(
    close: Callable[[], Awaitable[None]], timeline: Timeline, request_id: str, *, phase_log: bool
) -> Callable[[], Awaitable[None]]:
    """An ``on_close`` for a streamed response: ``close`` (the transaction's), then
    :func:`end_request`; idempotent as both are."""

    async def closed() -> None:
        try:
            await close()
        finally:
            end_request(timeline, request_id, phase_log=phase_log)

    return closed


async def started(
    start: Awaitable[T], timeline: Timeline, request_id: str, *, phase_log: bool
) -> T:
    """Await the router's start of the request; a failure (an HTTP error answer follows) ends
    the timeline with it."""
    try:
        return await start
    except BaseException as exc:
        timeline.fail(repr(exc))
        end_request(timeline, request_id, phase_log=phase_log)
        raise


@asynccontextmanager
async def collecting(
    close: Callable[[], Awaitable[None]], timeline: Timeline, request_id: str, *, phase_log: bool
) -> AsyncIterator[None]:
    """Around collecting a response that is not streamed: a failure marks the timeline, and
    the transaction (``close``) and then the timeline end however the block ends."""
    try:
        yield
    except BaseException as exc:
        timeline.fail(repr(exc))
        raise
    finally:
        try:
            await close()
        finally:
            end_request(timeline, request_id, phase_log=phase_log)


DISCONNECT_POLL_S = 0.5
"""How often a request that waits (its start, or a non-streamed response) checks whether its
client is still connected (seconds)."""


class _Closable(Protocol):
    async def aclose(self) -> None: ...


S = TypeVar("S", bound=_Closable)


async def unless_disconnected(request: Request, start: Awaitable[S]) -> S:
    """Await the router's start of a request (``start``: it may wait in the fair queue, for a
    worker, or for the prefill leg) unless its client disconnects first (checked every
    :data:`DISCONNECT_POLL_S`): then the start is cancelled, a transaction it opened meanwhile
    is closed, and :class:`~pdserve.errors.ClientDisconnectedError` is raised."""
    task = asyncio.ensure_future(start)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnectedError("the client disconnected before the first token")
    finally:
        if not task.done():
            task.cancel()
            try:
                opened = await task
            except BaseException:  # cancelled, or failed on its own: nothing is open
                pass
            else:
                await opened.aclose()
