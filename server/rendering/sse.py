"""Server-sent events in the OpenAI dialect.

Every event is one ``data: <json>\\n\\n`` line; the stream ends with ``data: [DONE]\\n\\n``. A
failure after the stream started (HTTP 200 already sent) cannot change the status any more, so
it is reported in-band, the way OpenAI does: ``data: {"error": {...}}`` and then
``data: [DONE]``.

:class:`SSEResponse` is a ``StreamingResponse`` that always closes its body iterator when the
response ends, however it ends (finished, client disconnected, server shutting down), so the
generator's cleanup (closing the decode stream, releasing KV blocks) runs promptly instead of
whenever the garbage collector finalizes it, and then runs its ``on_close`` callback (which
covers a body that never started).

The Responses API (:mod:`.responses`) names its events instead: ``event: <type>`` before each
data line (:func:`encode_named_event`), and no ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

from pdserve.errors import PdserveError

DONE = b"data: [DONE]\n\n"

_COMPACT = json.JSONEncoder(
    separators=(",", ":")
)  # json.dumps(..., separators=) builds one per call


def encode_event(payload: dict[str, Any]) -> bytes:
    """One SSE data event carrying ``payload`` as compact JSON (ASCII: non-ASCII text, U+2028
    included, is escaped, so no client's line splitting can cut an event)."""
    return b"data: " + _COMPACT.encode(payload).encode() + b"\n\n"


def encode_named_event(name: str, payload: dict[str, Any]) -> bytes:
    """One named SSE event (the Responses API's form): ``event: <name>`` and the data line
    carrying ``payload``. ``name`` is one line (an event type, no newline)."""
    assert "\n" not in name and "\r" not in name
    return b"event: " + name.encode() + b"\n" + encode_event(payload)


def encode_error(exc: PdserveError, rid: str | None = None, *, public: bool = False) -> bytes:
    """The in-band error event: the same ``{"error": {...}}`` envelope an HTTP error carries,
    naming request ``rid``; ``public``: with the public message (the router's client streams)."""
    return encode_event(exc.to_json(rid, public=public))


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response over an async iterator of encoded events."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        headers: dict[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``on_close`` runs after the body iterator is closed, even if iteration never began
        (a client gone before the first byte): it must be idempotent and cancellation-safe."""
        super().__init__(
            content,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})},
        )
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self._on_close is not None:
                    await self._on_close()
