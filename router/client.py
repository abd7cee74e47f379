"""Typed HTTP calls from the router to a worker's request plane.

One method per worker endpoint (see docs/architecture/workers.md, "Worker process"):

- :meth:`WorkerClient.context`  ``POST /internal/context``  -> :class:`ContextResponse`
- :meth:`WorkerClient.context_stream` ``POST /internal/context/stream`` -> :class:`ContextStream`
- :meth:`WorkerClient.generate` ``POST /internal/generate`` -> :class:`GenerationStream`
- :meth:`WorkerClient.release`  ``POST /internal/release``  -> bool (best effort, never raises)
- :meth:`WorkerClient.lend`     ``POST /internal/kv/lend``  -> handle or None (best effort)

Every call is bounded by the request's wall-clock ``deadline`` (UNIX seconds): each network
operation waits at most the time left, and a call that runs out of time raises
:class:`DeadlineExceededError`. A worker's error envelope becomes the matching typed error
(:func:`error_from_envelope`); a connection that could not be opened raises
:class:`WorkerUnreachableError` (the request never reached the worker, so it is safe to retry
elsewhere); any other transport failure raises :class:`WorkerError`.

The calls go over a :class:`~pdserve.http.plane_client.RequestPlane`: the lean HTTP/1.1
client :class:`~pdserve.http.plane_client.WirePlane` by default, or an ``httpx.AsyncClient``
(the unit tests' in-process fake workers; ``router.worker_client: httpx``).

The ``/internal/*`` routes are internal: every call carries ``Authorization: Bearer`` with the
cluster key's token (:class:`pdserve.security.ClusterKey`). A worker holding another secret
answers 401, which surfaces as :class:`WorkerError` (502) naming the worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
from pydantic import ValidationError

from pdserve.errors import (
    CapacityError,
    DeadlineExceededError,
    ErrorEnvelope,
    HandleError,
    IntegrityError,
    InvalidRequestError,
    LayoutMismatchError,
    PdserveError,
    QueueFullError,
    TransferError,
    WorkerError,
    WorkerUnreachableError,
)
from pdserve.http.keepalive import ROUTER_KEEPALIVE_S
from pdserve.http.plane_client import (
    HttpxPlane,
    PlaneConnectError,
    PlaneError,
    PlaneResponse,
    RequestPlane,
    WirePlane,
)
from pdserve.kv_lend import LendRequest, LendResponse
from pdserve.protocol import (
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    ContextFailed,
    ContextRequest,
    ContextResponse,
    ContextStarted,
    GenerationChunk,
    GenerationRequest,
    ReleaseRequest,
    TransferHandle,
    WorkerRecord,
)

if TYPE_CHECKING:
    from pdserve.security import ClusterKey

log = logging.getLogger(__name__)

HEADERS = {PROTOCOL_HEADER: str(PROTOCOL_VERSION)}

_TRANSFER_ERRORS: dict[str, type[TransferError]] = {
    cls.code: cls for cls in (LayoutMismatchError, HandleError, IntegrityError)
}
"""The TransferError subclass of a worker's ``kv_*`` code (another ``kv_*``: TransferError)."""


def _remaining(deadline: float) -> float:
    return deadline - time.time()


def error_from_envelope(leg: str, status: int, body: bytes) -> PdserveError:
    """Map a worker's non-200 answer to a typed error, keeping its message and code.

    ``leg`` names the worker in the message, e.g. ``"prefill worker p0"``. 400 stays 400 (the
    worker refused the request itself), 429 -> :class:`QueueFullError` (the worker's queue is
    full: the client may retry), 503 -> :class:`CapacityError`, 504 ->
    :class:`DeadlineExceededError`, a ``kv_*`` code -> :class:`TransferError` (the subclass of
    that code, e.g. :class:`IntegrityError`), anything else -> :class:`WorkerError` (502).
    """
    try:
        err = ErrorEnvelope.model_validate_json(body).error
        message, code = err.message, err.code
    except ValidationError:
        message, code = body[:200].decode(errors="replace") or "(empty body)", None
    text = f"{leg} answered HTTP {status}: {message}"
    cls: type[PdserveError]
    if status == 400:
        cls = InvalidRequestError
    elif status == 429:
        cls = QueueFullError
    elif status == 503:
        cls = CapacityError
    elif status == 504:
        cls = DeadlineExceededError
    elif code and code.startswith("kv_"):
        cls = _TRANSFER_ERRORS.get(code, TransferError)
    else:
        cls = WorkerError
    # A worker's refusal of the request itself (400) is the client's business: its own words
    # reach the client, without the worker's name; anything else shows the class's public text.
    return cls(text, code=code, public=message if status == 400 else None)


def _transport_error(leg: str, exc: Exception, deadline: float) -> PdserveError:
    if _remaining(deadline) <= 0 or isinstance(exc, TimeoutError):
        return DeadlineExceededError(f"{leg} did not answer before the request deadline")
    if isinstance(exc, PlaneConnectError):
        return WorkerUnreachableError(f"{leg} unreachable: {exc}")
    return WorkerError(f"{leg} failed: {exc}")


FINISH_WAIT_S = 0.25
"""Seconds :meth:`GenerationStream.finish` waits for the end of a finished request's body."""


class GenerationStream:
    """An open ``/internal/generate`` NDJSON stream. Closing it (:meth:`aclose`) drops the
    connection, which makes the decode worker abort the request and free its blocks."""

    def __init__(self, response: PlaneResponse, *, leg: str, deadline: float) -> None:
        self._response = response
        self._leg = leg
        self._deadline = deadline
        self.closed = False
        self.lost: str | None = None  # lose(): why this stream may be given up
        self._grace_s = 0.0
        self._read: asyncio.Timeout | None = None  # the read in progress, if any
        self._lines: NdjsonLines | None = None  # the body's lines, once chunks() began

    def lose(self, reason: str, grace_s: float = 0.0) -> None:
        """Give the stream up from outside its reader once it is silent for ``grace_s``
        seconds (the worker left discovery: stopped or partitioned, its connection may never
        break; a draining worker that deregistered but still streams is not given up): from
        now on a read that waits longer raises :class:`WorkerError` naming ``reason``. Call
        on the event loop."""
        self.lost, self._grace_s = reason, grace_s
        if self._read is not None and not self._read.expired():
            when = asyncio.get_running_loop().time() + grace_s
            self._read.reschedule(min(when, self._read.when() or when))

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """Yield chunks as they arrive; each read waits at most until the deadline.

        Raises :class:`DeadlineExceededError` past the deadline, :class:`WorkerError` on a broken
        connection, a line that is not a ``GenerationChunk``, or after :meth:`lose`.
        """
        lines = self._lines = ndjson_lines(self._response)
        while True:
            if lines.buffered():  # at hand: no read, so no timeout to arm
                line = await anext(lines)
                if line.strip():
                    yield _chunk(self._leg, line)
                continue
            try:
                wait = max(_remaining(self._deadline), 0.0)
                if self.lost is not None:
                    wait = min(wait, self._grace_s)
                async with asyncio.timeout(wait) as self._read:
                    line = await anext(lines)
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                if self.lost is not None:
                    raise WorkerError(f"{self._leg} given up: {self.lost}") from None
                raise _transport_error(self._leg, exc, self._deadline) from exc
            except PlaneError as exc:
                if self.lost is not None:
                    raise WorkerError(f"{self._leg} given up: {self.lost}") from None
                raise WorkerError(f"{self._leg} broke its stream (worker gone?): {exc}") from exc
            finally:
                self._read = None
            if line.strip():
                yield _chunk(self._leg, line)

    def buffered(self) -> bool:
        """Whether the next line of the stream is already read: the next chunk of
        :meth:`chunks` comes without waiting on the network."""
        return self._lines is not None and self._lines.buffered()

    async def finish(self, wait_s: float = FINISH_WAIT_S) -> None:
        """Close a stream whose request finished (its last chunk was read): first read what is
        left of the body, which the worker ends right after that chunk, so that the connection
        goes back to the client's pool for the next request instead of being dropped (a new
        connection per request cost the router a TCP connect and the worker an accept). More
        data, an error, or no end within ``wait_s`` seconds drops the connection, as
        :meth:`aclose` does. Idempotent."""
        if self.closed:
            return
        if self._lines is not None:
            try:
                async with asyncio.timeout(wait_s):
                    async for line in self._lines:
                        if line.strip():
                            break  # not the end: the connection is dropped below
            except (PlaneError, TimeoutError, RuntimeError):  # RuntimeError: being read
                pass
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (idempotent)."""
        if not self.closed:
            self.closed = True
            await self._response.aclose()


def _chunk(leg: str, line: bytes) -> GenerationChunk:
    """The chunk on one NDJSON line; WorkerError if it is not one."""
    try:
        return GenerationChunk.model_validate_json(line)
    except ValidationError as exc:
        raise WorkerError(f"{leg} sent a malformed chunk: {line[:200]!r}") from exc


class NdjsonLines:
    """The lines of an NDJSON body (bytes, without the ``\n``), split on ``\n`` only: an
    async iterator over ``response``'s body, which it reads as needed.

    httpx's ``aiter_lines`` also splits on U+0085, U+2028, U+2029 and U+001C-U+001E (Python's
    ``str.splitlines``), and JSON leaves the first three unescaped inside strings: a token whose
    text holds one (a byte-level vocabulary has U+0085) cut a worker's chunk in two. Memory:
    the last read and the longest line, held as its parts until its ``\n`` arrives.
    :meth:`buffered` says whether the next line is already at hand (no read needed). Raises
    what ``response``'s body iteration raises (PlaneError)."""

    def __init__(self, response: PlaneResponse | httpx.Response) -> None:
        self._body = response.aiter_bytes()
        self._data = b""  # the last read
        self._start = 0  # where its unread part begins
        self._parts: list[bytes] = []  # an unfinished line's earlier parts
        self._ended = False

    def __aiter__(self) -> NdjsonLines:
        return self

    def buffered(self) -> bool:
        """Whether the next line is already read (the next :meth:`__anext__` does no I/O)."""
        return self._data.find(b"\n", self._start) >= 0

    async def __anext__(self) -> bytes:
        while True:
            end = self._data.find(b"\n", self._start)
            if end >= 0:
                self._parts.append(self._data[self._start : end])
                self._start = end + 1
                line = b"".join(self._parts)
                self._parts.clear()
                return line
            if self._start < len(self._data):
                self._parts.append(self._data[self._start :])
            self._data, self._start = b"", 0
            if self._ended:
                raise StopAsyncIteration
            try:
                self._data = await anext(self._body)
            except StopAsyncIteration:
                self._ended = True
                if self._parts:  # a last line without its \n
                    line = b"".join(self._parts)
                    self._parts.clear()
                    return line
                raise


def ndjson_lines(response: PlaneResponse | httpx.Response) -> NdjsonLines:
    """``response``'s body as NDJSON lines (:class:`NdjsonLines`)."""
    return NdjsonLines(response)


class ContextStream:
    """An open ``/internal/context/stream`` NDJSON answer: the streamed handle first
    (:meth:`started`), then the context phase's answer (:meth:`response`). Closing it
    (:meth:`aclose`) drops the connection, which makes the prefill worker abort the request
    (its streamed pulls end with TransferFailed)."""

    def __init__(self, response: PlaneResponse, *, leg: str, req: ContextRequest) -> None:
        self._response = response
        self._lines = ndjson_lines(response)
        self._leg = leg
        self._req = req

    async def started(self) -> TransferHandle:
        """The streamed handle (the first line). Raises a typed error (the worker failed the
        request instead, a broken stream, the deadline)."""
        msg = await self._next()
        if not isinstance(msg, ContextStarted) or not msg.handle.streamed:
            raise WorkerError(f"{self._leg} did not start a streamed context phase")
        if msg.request_id != self._req.request_id:
            raise WorkerError(f"{self._leg} started request {msg.request_id!r}")
        return msg.handle

    async def response(self) -> ContextResponse:
        """The context phase's answer (checked as :meth:`WorkerClient.context` checks it).
        Raises the worker's typed error (ContextFailed), WorkerError, DeadlineExceededError."""
        msg = await self._next()
        if not isinstance(msg, ContextResponse):
            raise WorkerError(f"{self._leg} answered {type(msg).__name__} twice")
        return _checked(self._leg, self._req, msg)

    async def aclose(self) -> None:
        """Close the connection (idempotent)."""
        await self._response.aclose()

    async def _next(self) -> ContextStarted | ContextResponse:
        deadline = self._req.deadline
        try:
            async with asyncio.timeout(max(_remaining(deadline), 0.0)):
                line = b""
                while not line.strip():
                    line = await anext(self._lines)
        except StopAsyncIteration:
            raise WorkerError(f"{self._leg} ended its context stream early") from None
        except TimeoutError as exc:
            raise _transport_error(self._leg, exc, deadline) from exc
        except PlaneError as exc:
            raise WorkerError(f"{self._leg} broke its context stream: {exc}") from exc
        try:
            kind = json.loads(line).get("type")
            if kind == "started":
                return ContextStarted.model_validate_json(line)
            if kind == "failed":
                failed = ContextFailed.model_validate_json(line)
                raise error_from_envelope(self._leg, failed.status, failed.body.encode())
            return ContextResponse.model_validate_json(line)
        except (ValidationError, ValueError, AttributeError) as exc:
            raise WorkerError(f"{self._leg} sent a malformed context line: {line[:200]!r}") from exc


class WorkerClient:
    """The router's side of the worker request plane.

    ``http``: None (the default) opens a :class:`~pdserve.http.plane_client.WirePlane` owned
    by this client (:meth:`aclose` closes it); an ``httpx.AsyncClient`` is used as it is and
    stays the caller's to close. ``key``: the cluster key whose bearer token every call
    carries. ``connect_timeout_s`` bounds opening a connection; ``release_timeout_s`` bounds a
    best-effort release (seconds).
    """

    def __init__(
        self,
        http: httpx.AsyncClient | None = None,
        *,
        key: ClusterKey,
        connect_timeout_s: float = 5.0,
        release_timeout_s: float = 5.0,
    ) -> None:
        headers = {**HEADERS, **key.http_headers(), "content-type": "application/json"}
        self._plane: RequestPlane = (
            WirePlane(headers, keepalive_s=ROUTER_KEEPALIVE_S)
            if http is None
            else HttpxPlane(http, headers)
        )
        self.connect_timeout_s = connect_timeout_s
        self.release_timeout_s = release_timeout_s

    async def aclose(self) -> None:
        """Close the connections of a plane this client opened (none: an httpx client's)."""
        await self._plane.aclose()

    async def context(self, worker: WorkerRecord, req: ContextRequest) -> ContextResponse:
        """Run the context phase on prefill ``worker``. Raises a typed error on failure, also
        when the answer has no handle though the request still needs its blocks (a choice
        unfinished)."""
        leg = f"prefill worker {worker.worker_id}"
        url = f"{worker.http_url}/internal/context"
        try:
            status, content = await self._call(url, _body(req), _remaining(req.deadline))
        except (PlaneError, TimeoutError) as exc:
            raise _transport_error(leg, exc, req.deadline) from exc
        if status != 200:
            raise error_from_envelope(leg, status, content)
        try:
            out = ContextResponse.model_validate_json(content)
        except ValidationError as exc:
            raise WorkerError(f"{leg} sent a malformed ContextResponse: {exc}") from exc
        return _checked(leg, req, out)

    async def context_stream(self, worker: WorkerRecord, req: ContextRequest) -> ContextStream:
        """Open the streamed context phase on prefill ``worker`` (``POST
        /internal/context/stream``): its first line, the streamed handle, is read by
        :meth:`ContextStream.started`, the answer by :meth:`ContextStream.response`. Raises a
        typed error when the worker refuses before admitting the request."""
        leg = f"prefill worker {worker.worker_id}"
        resp = await self._open(worker, "/internal/context/stream", _body(req), req.deadline, leg)
        return ContextStream(resp, leg=leg, req=req)

    async def _call(self, url: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        """POST ``body`` to ``url`` and read the whole answer within ``timeout_s`` seconds:
        (status, body). Raises PlaneError, TimeoutError."""
        async with asyncio.timeout(max(timeout_s, 0.0)):
            resp = await self._plane.post(
                url, body, timeout_s=max(timeout_s, 0.0), connect_timeout_s=self.connect_timeout_s
            )
            try:
                return resp.status_code, await resp.aread()
            finally:
                await resp.aclose()

    async def _open(
        self, worker: WorkerRecord, path: str, body: bytes, deadline: float, leg: str
    ) -> PlaneResponse:
        """POST ``body`` to ``path`` and return the streaming response once its status is 200;
        raises the typed error of any other status or of the transport."""
        try:
            resp = await self._plane.post(
                f"{worker.http_url}{path}",
                body,
                timeout_s=max(_remaining(deadline), 0.0),
                connect_timeout_s=self.connect_timeout_s,
            )
        except (PlaneError, TimeoutError) as exc:
            raise _transport_error(leg, exc, deadline) from exc
        if resp.status_code != 200:
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    content = await resp.aread()
            except (PlaneError, TimeoutError):
                content = b""
            finally:
                await resp.aclose()
            raise error_from_envelope(leg, resp.status_code, content)
        return resp

    async def generate(self, worker: WorkerRecord, req: GenerationRequest) -> GenerationStream:
        """Open the generation stream on ``worker`` (a decode worker; without a handle, a decode
        or colocated worker that prefills the prompt itself). Raises a typed error if the worker
        refuses the request before streaming (its HTTP status and envelope)."""
        leg = f"{worker.role.value} worker {worker.worker_id}"
        resp = await self._open(worker, "/internal/generate", _body(req), req.deadline, leg)
        return GenerationStream(resp, leg=leg, deadline=req.deadline)

    async def release(self, worker: WorkerRecord, req: ReleaseRequest) -> bool:
        """Ask prefill ``worker`` to free a parked request's blocks. Best effort: returns whether
        the worker released something; logs and returns False on any failure."""
        url = f"{worker.http_url}/internal/release"
        try:
            status, content = await self._call(url, _body(req), self.release_timeout_s)
            if status != 200:
                log.warning("release of %s on %s: HTTP %d %s", req.request_id, worker.worker_id,
                            status, content[:200].decode(errors="replace"))  # fmt: skip
                return False
            released = bool(json.loads(content).get("released", False))
        except (PlaneError, TimeoutError, ValueError, AttributeError) as exc:
            log.warning("release of %s on %s failed: %r", req.request_id, worker.worker_id, exc)
            return False
        log.debug("release of %s on %s: released=%s", req.request_id, worker.worker_id, released)
        return released

    async def lend(
        self, worker: WorkerRecord, req: LendRequest, timeout_s: float
    ) -> TransferHandle | None:
        """Ask ``worker`` to lease the prompt prefix ``req`` names (peer prefix pull,
        :mod:`pdserve.workers.roles.lending`). Best effort within ``timeout_s`` seconds: the
        handle, or None (nothing held there now, or any failure, logged), which costs the
        serving worker a recompute, never the request."""
        url = f"{worker.http_url}/internal/kv/lend"
        try:
            status, content = await self._call(url, _body(req), timeout_s)
            if status != 200:
                log.info("lend %s on %s: HTTP %d %s", req.request_id, worker.worker_id, status,
                         content[:200].decode(errors="replace"))  # fmt: skip
                return None
            handle = LendResponse.model_validate_json(content).handle
        except (PlaneError, TimeoutError, ValidationError) as exc:
            log.info("lend %s on %s failed: %r", req.request_id, worker.worker_id, exc)
            return None
        if handle is not None and handle.worker_id != worker.worker_id:
            log.warning("lend %s: %s answered another worker's handle", req.request_id,
                        worker.worker_id)  # fmt: skip
            return None
        return handle


def _body(req: ContextRequest | GenerationRequest | ReleaseRequest | LendRequest) -> bytes:
    """A request message's JSON body."""
    return req.__pydantic_serializer__.to_json(req)


def _checked(leg: str, req: ContextRequest, out: ContextResponse) -> ContextResponse:
    """Refuse an answer for another request, or without a handle where one is needed."""
    if out.request_id != req.request_id:
        raise WorkerError(f"{leg} answered for request {out.request_id!r}, not {req.request_id!r}")
    if out.finish_reason is None and out.handle is None:
        raise WorkerError(f"{leg} answered neither a finish reason nor a transfer handle")
    if req.sampling.n > 1 and out.handle is None:
        raise WorkerError(
            f"{leg} answered no transfer handle for a request of n={req.sampling.n} choices"
        )
    return out
