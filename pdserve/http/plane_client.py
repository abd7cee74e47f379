"""The router's HTTP/1.1 client for the worker request plane: POST a JSON body, stream the answer.

The router calls its workers over plain HTTP/1.1 on a private network (docs/architecture/
workers.md, "Worker process"): one POST per leg (``/internal/generate``, ``/internal/context``,
...) whose answer is JSON or an NDJSON stream. :class:`WirePlane` does exactly that and no
more, on an ``asyncio.Protocol`` with httptools' response parser (llhttp, the parser the servers
use): a keep-alive pool per worker address, the request written in one ``write``, body bytes
handed over as they arrive, no per-request objects beyond the response. A general client
(httpx: redirects, auth flows, cookies, proxies, HTTP/2, its own locking per connection) spent
about a third of the router's CPU per request on this leg (docs/benchmarks.md, "The router's own
cost"). :class:`HttpxPlane` puts an ``httpx.AsyncClient`` behind the same interface: the unit
tests serve fake workers in-process through httpx's ASGI transport, and
``router.worker_client: httpx`` keeps it selectable.

Interface (:class:`RequestPlane`): ``await plane.post(url, body, timeout_s=...,
connect_timeout_s=...)`` returns a :class:`PlaneResponse` once the status line and headers are
in; its body is read with ``aiter_bytes()`` or ``aread()``, and ``aclose()`` must be called: a
response read to its end goes back to the pool (its connection is reused), any other is
dropped (closing the connection is how the router tells a worker to abort a stream). Errors:
:class:`PlaneConnectError` (no connection could be opened: the request never left),
``TimeoutError`` (``timeout_s`` passed before the headers), :class:`PlaneError` (anything else:
a connection broken or closed early, a malformed or oversized response head).

Bounds: a response head is at most :data:`MAX_HEAD_BYTES` (plus one read); a body is buffered up to
:data:`READ_HIGH_WATER` bytes before the socket stops being read (TCP flow control holds the
worker); the pool keeps at most ``max_idle_per_host`` idle connections per address, each for
``keepalive_s`` seconds (below the workers' keep-alive: :mod:`pdserve.http.keepalive`), and
checks an idle connection's socket before reusing it (a close the loop has not delivered yet).
Only ``http://`` URLs (the request plane has no TLS; the cluster key's bearer token authenticates
each call).
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Protocol, cast
from urllib.parse import urlsplit

import httptools

if TYPE_CHECKING:
    import httpx

MAX_HEAD_BYTES = 64 * 1024
"""The most bytes a response's status line and headers may take (a larger head: PlaneError)."""

READ_HIGH_WATER = 1 << 20
"""Unread body bytes above which a connection stops reading its socket until they are taken."""

_MAX_TARGETS = 4096  # parsed URLs kept (workers x paths); the cache is cleared past it


class PlaneError(Exception):
    """The request plane failed after a connection was open: it broke or closed before the
    response ended, or the response was malformed."""


class PlaneConnectError(PlaneError):
    """No connection to the worker could be opened (refused, unreachable, connect timeout):
    the request was never sent."""


class PlaneResponse(Protocol):
    """An answer whose status line and headers are in; the body follows."""

    status_code: int

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; raises PlaneError if the connection breaks first."""
        ...

    async def aread(self) -> bytes:
        """The whole (rest of the) body."""
        ...

    async def aclose(self) -> None:
        """Release the response (idempotent): back to the pool if read to its end, else the
        connection is closed."""
        ...


class RequestPlane(Protocol):
    """POST a body to a worker (:class:`WirePlane`, :class:`HttpxPlane`)."""

    async def post(
        self, url: str, body: bytes, *, timeout_s: float, connect_timeout_s: float
    ) -> PlaneResponse:
        """Send ``body`` (JSON) to ``url``; the response once its head is in. Raises
        PlaneConnectError, TimeoutError (``timeout_s`` seconds passed), PlaneError."""
        ...

    async def aclose(self) -> None:
        """Close every connection."""
        ...


class _Connection(asyncio.Protocol):
    """One keep-alive connection, carrying one request at a time. The parser's callbacks fill
    the current response's state; :meth:`wait` sleeps until the next callback."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, plane: WirePlane, addr: tuple[str, int]
    ) -> None:
        self._loop = loop
        self._plane = plane
        self.addr = addr  # the pool's key
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.error: str | None = None  # why the connection cannot go on (it is closed)
        self.idle_since = 0.0
        self.active = False  # a request is on it
        self.status = 0
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self._head_bytes = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._fd = -1

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._fd = sock.fileno() if sock is not None else -1

    def data_received(self, data: bytes) -> None:
        if not self.active:  # a worker sends nothing unasked: the connection is unusable
            self._fail("data on an idle connection")
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed HTTP response: {exc}")
            return
        if not self.head_done:  # the parser keeps no header bytes; this bounds the wait for them
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(f"response head over {MAX_HEAD_BYTES} bytes")
                return
        if self.buffered > READ_HIGH_WATER and not self._paused and self.transport is not None:
            self.transport.pause_reading()
            self._paused = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            self.error = "connection closed by the worker" + (f" ({exc!r})" if exc else "")
        self._plane._forget(self)
        self._wake()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # the client's side
    def start(self, request: bytes) -> None:
        """Send ``request`` (head and body) as the connection's next exchange."""
        assert self.transport is not None and not self.active
        self.active = True
        self.status, self.head_done, self.complete = 0, False, False
        self._head_bytes = 0
        self.transport.write(request)

    async def wait(self) -> None:
        """Until the next parser event or the connection's end."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        """The body bytes received and not yet taken (resumes reading)."""
        body = self.body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def readable(self) -> bool:
        """Whether the socket has something to read that the loop has not delivered yet: on an
        idle connection, the worker closed it (or wrote unasked). Checked before reuse, as
        httpcore does, so a request is not sent on a connection the worker just dropped."""
        if self._fd < 0:
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        try:
            return bool(poller.poll(0))
        except OSError:
            return True

    def reusable(self) -> bool:
        """Whether the exchange ended cleanly on a connection that stays open."""
        return self.complete and self.keep_alive and self.error is None

    def close(self, why: str = "closed by the router") -> None:
        if self.error is None:
            self.error = why
        if self.transport is not None:
            self.transport.close()

    def _fail(self, why: str) -> None:
        self.close(why)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _WireResponse:
    """A :class:`PlaneResponse` on a :class:`_Connection` of ``plane``."""

    def __init__(self, conn: _Connection, plane: WirePlane) -> None:
        self._conn = conn
        self._plane = plane
        self._released = False
        self.status_code = conn.status

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.body:
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                raise PlaneError(conn.error)
            else:
                await conn.wait()

    async def aread(self) -> bytes:
        return b"".join([data async for data in self.aiter_bytes()])

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        self._plane._release(self._conn)


class WirePlane:
    """:class:`RequestPlane` over httptools on asyncio (module docstring).

    ``headers``: sent with every request (the protocol version, the cluster key's bearer
    token, the content type); ``keepalive_s``: how long an idle connection is kept;
    ``max_idle_per_host``: idle connections kept per worker address. Ownership: the caller
    closes it (:meth:`aclose`) on the loop that used it. Not thread-safe (one event loop)."""

    def __init__(
        self, headers: Mapping[str, str], *, keepalive_s: float, max_idle_per_host: int = 128
    ) -> None:
        self._headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
        self._keepalive_s = keepalive_s
        self._max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._live: set[_Connection] = set()
        self._targets: dict[str, tuple[tuple[str, int], bytes, bytes]] = {}

    async def post(
        self, url: str, body: bytes, *, timeout_s: float, connect_timeout_s: float
    ) -> PlaneResponse:
        """See :meth:`RequestPlane.post`."""
        addr, host, path = self._target(url)
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n" % (
            path, host, self._headers, len(body),
        )  # fmt: skip
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                conn = self._take(addr) or await self._connect(addr, connect_timeout_s)
                conn.start(head + body)
                while not conn.head_done:
                    if conn.error is not None:
                        raise PlaneError(conn.error)
                    await conn.wait()
        except BaseException:
            if conn is not None:
                conn.close("request failed")
            raise
        return _WireResponse(conn, self)

    async def aclose(self) -> None:
        """Close every connection, idle or in use."""
        for conn in list(self._live):
            conn.close("client closed")
        self._idle.clear()

    def idle_connections(self) -> int:
        """How many idle connections the pool holds, still open (all addresses)."""
        return sum(c.error is None for v in self._idle.values() for c in v)

    def _target(self, url: str) -> tuple[tuple[str, int], bytes, bytes]:
        hit = self._targets.get(url)
        if hit is not None:
            return hit
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise PlaneConnectError(f"the request plane speaks http:// only, not {url!r}")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        hit = ((parts.hostname, parts.port or 80), parts.netloc.encode(), path.encode())
        if len(self._targets) >= _MAX_TARGETS:
            self._targets.clear()
        self._targets[url] = hit
        return hit

    def _take(self, addr: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(addr)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.error is None and now - conn.idle_since < self._keepalive_s:
                if not conn.readable():
                    return conn
            conn.close("stale: idle too long, or closed by the worker")
        return None

    async def _connect(self, addr: tuple[str, int], connect_timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        where = f"{addr[0]}:{addr[1]}"
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop, self, addr), *addr)
        except TimeoutError:
            raise PlaneConnectError(
                f"connect to {where} timed out ({connect_timeout_s} s)"
            ) from None
        except OSError as exc:
            raise PlaneConnectError(f"connect to {where} failed: {exc}") from exc
        self._live.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        conn.active = False
        if not conn.reusable():
            conn.close()
            return
        conn.body.clear()
        conn.buffered = 0
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(conn.addr, [])
        if len(idle) < self._max_idle:
            idle.append(conn)
        else:
            conn.close("pool full")

    def _forget(self, conn: _Connection) -> None:
        self._live.discard(conn)


class HttpxPlane:
    """:class:`RequestPlane` over an ``httpx.AsyncClient`` (owned by the caller), sending
    ``headers`` with every request; httpx's errors become this module's."""

    def __init__(self, http: httpx.AsyncClient, headers: Mapping[str, str]) -> None:
        self._http = http
        self._headers = dict(headers)

    async def post(
        self, url: str, body: bytes, *, timeout_s: float, connect_timeout_s: float
    ) -> PlaneResponse:
        """See :meth:`RequestPlane.post`."""
        import httpx

        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, connect_timeout_s))
        request = self._http.build_request(
            "POST", url, content=body, headers=self._headers, timeout=timeout
        )
        async with _httpx_errors():
            async with asyncio.timeout(timeout_s):
                return _HttpxResponse(await self._http.send(request, stream=True))

    async def aclose(self) -> None:
        """Nothing: the caller owns the httpx client."""


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status_code = response.status_code

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async with _httpx_errors():
            async for data in self._response.aiter_bytes():
                yield data

    async def aread(self) -> bytes:
        async with _httpx_errors():
            return await self._response.aread()

    async def aclose(self) -> None:
        await self._response.aclose()


class _httpx_errors:  # noqa: N801 (used as a context manager, named like one)
    """httpx's errors as this module's: connect failures -> PlaneConnectError, timeouts ->
    TimeoutError, the rest -> PlaneError."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, tp: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:  # fmt: skip
        """Never swallows: re-raises httpx's errors as this module's, lets the rest through."""
        import httpx

        if exc is None or not isinstance(exc, httpx.HTTPError):
            return
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            raise PlaneConnectError(f"{exc!r}") from exc
        if isinstance(exc, httpx.TimeoutException):
            raise TimeoutError(f"{exc!r}") from exc
        raise PlaneError(f"{exc!r}") from exc
