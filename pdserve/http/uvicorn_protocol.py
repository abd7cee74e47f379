"""The HTTP/1.1 protocol of pdserve's servers: uvicorn's h11 protocol with a header deadline.

uvicorn times out a connection only while it is idle after a response (``timeout_keep_alive``):
a client that connects and never finishes its request headers (sending a byte now and then, or
nothing at all) holds a socket and its buffers forever, before any API key is checked. Here the
headers of every request must be complete within :data:`HEADER_TIMEOUT_S` of the connection
opening, or on a keep-alive connection of the request's first byte (an idle keep-alive
connection stays governed by ``timeout_keep_alive``); else the connection is closed. The request body is not covered (the body limit and the request deadline bound it),
and neither is a response being streamed.

The same bound as nginx's ``client_header_timeout`` (60 s there) and Go's
``http.Server.ReadHeaderTimeout``. A reverse proxy in front (see docs/reliability.md) is still
the place for per-client connection limits.

Use: ``uvicorn.Config(app, http=HeaderDeadlineH11Protocol, ...)``. The class is the h11
implementation on purpose: the protocol a server speaks does not change with whether
``httptools`` happens to be installed.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
"""Seconds a client has to send a request's complete headers (from the connection opening or
the previous response's end)."""


class HeaderDeadlineH11Protocol(H11Protocol):
    """uvicorn's :class:`H11Protocol` that closes a connection whose request headers are not
    complete within :data:`HEADER_TIMEOUT_S` (see the module docstring). Event-loop only, as
    its base."""

    header_timeout_s = HEADER_TIMEOUT_S
    _header_deadline: asyncio.TimerHandle | None = None
    _between_requests = True  # no request's headers started since the last response

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._between_requests and self._header_deadline is None:
            self._arm_header_deadline()  # a keep-alive connection's next request begins
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: its cycle started
            self._between_requests = False
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request's cycle
        if self.cycle is None or self.cycle.response_complete:
            self._between_requests = True  # the next request's first byte arms the deadline

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

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
