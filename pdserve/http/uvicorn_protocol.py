"""The HTTP/1.1 protocols of pdserve's servers: uvicorn's httptools and h11 protocols with a
header deadline (and, for httptools, a bound on the header bytes).

uvicorn times out a connection only while it is idle after a response (``timeout_keep_alive``):
a client that connects and never finishes its request headers (sending a byte now and then, or
nothing at all) holds a socket and its buffers forever, before any API key is checked. Here the
headers of every request must be complete within :data:`HEADER_TIMEOUT_S` of the connection
opening, or on a keep-alive connection of the request's first byte (an idle keep-alive
connection stays governed by ``timeout_keep_alive``); else the connection is closed. The request
body is not covered (the body limit and the request deadline bound it), and neither is a
response being streamed.

The same bound as nginx's ``client_header_timeout`` (60 s there) and Go's
``http.Server.ReadHeaderTimeout``. A reverse proxy in front (see docs/reliability.md) is still
the place for per-client connection limits.

:class:`HeaderDeadlineHttpToolsProtocol` is what the servers speak (:func:`server_protocol`):
llhttp's C parser (httptools) costs a fraction of h11's pure-Python one per request, which is
most of what a relayed stream costs the router. llhttp sets no limit on header size, so that
protocol also refuses a request line plus headers over :data:`MAX_HEADER_BYTES` with 431 (h11
has its own limit, 16 KiB of unparsed input). :class:`HeaderDeadlineH11Protocol` stays for
``--http h11``.

Use: ``uvicorn.Config(app, http=server_protocol(), ...)``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
"""Seconds a client has to send a request's complete headers (from the connection opening or
the previous response's end)."""

MAX_HEADER_BYTES = 64 * 1024
"""Bytes a request's line and headers may take (names and values); more is refused with 431
(nginx's default allows 4 x 8 KiB, Node.js 16 KiB)."""

HttpImpl = Literal["httptools", "h11"]
"""The HTTP/1.1 parser a server uses (``--http``)."""


class _HeaderDeadline:
    """The header deadline shared by both protocols (module docstring). Needs the protocol's
    ``loop``, ``transport`` and ``client``; event-loop only."""

    header_timeout_s = HEADER_TIMEOUT_S
    _header_deadline: asyncio.TimerHandle | None = None
    _between_requests = True  # no request's headers started since the last response
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _request_bytes_arrive(self) -> None:
        if self._between_requests and self._header_deadline is None:
            self._arm_header_deadline()  # a keep-alive connection's next request begins

    def _headers_complete(self) -> None:
        self._between_requests = False
        self._disarm_header_deadline()

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.info(
            "closing the connection from %s: no complete request headers within %.0f s",
            peer,
            self.header_timeout_s,
        )
        self.transport.close()


class HeaderDeadlineH11Protocol(_HeaderDeadline, H11Protocol):
    """uvicorn's :class:`H11Protocol` that closes a connection whose request headers are not
    complete within :data:`HEADER_TIMEOUT_S` (see the module docstring). Event-loop only, as
    its base."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        self._request_bytes_arrive()
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: its cycle started
            self._headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request's cycle
        if self.cycle is None or self.cycle.response_complete:
            self._between_requests = True  # the next request's first byte arms the deadline


class HeaderDeadlineHttpToolsProtocol(_HeaderDeadline, HttpToolsProtocol):
    """uvicorn's :class:`HttpToolsProtocol` with the header deadline and a bound of
    :data:`MAX_HEADER_BYTES` on a request's line and headers (431 past it, then the connection
    is closed); see the module docstring. Event-loop only, as its base."""

    max_header_bytes = MAX_HEADER_BYTES
    _header_bytes = 0
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._request_bytes_arrive()
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._header_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._count_header_bytes(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._count_header_bytes(len(name) + len(value) + 4):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        super().on_headers_complete()
        self._headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request's cycle
        if self.cycle is None or self.cycle.response_complete:
            self._between_requests = True  # the next request's first byte arms the deadline

    def _count_header_bytes(self, n: int) -> bool:
        """Count ``n`` more header bytes; False (and the request refused) past the bound."""
        if self._refused:
            return False
        self._header_bytes += n
        if self._header_bytes <= self.max_header_bytes:
            return True
        self._refused = True
        self._disarm_header_deadline()
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.info(
            "refusing a request from %s: its line and headers pass %d bytes",
            peer,
            self.max_header_bytes,
        )
        msg = b"Request Header Fields Too Large"
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(msg)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + msg
        )
        self.transport.close()
        return False


def server_protocol(impl: HttpImpl = "httptools") -> type[asyncio.Protocol]:
    """The uvicorn ``http`` protocol class of ``impl`` (both with the header deadline)."""
    return HeaderDeadlineHttpToolsProtocol if impl == "httptools" else HeaderDeadlineH11Protocol
