"""The public plane's door: client API keys and the request body limit, as ASGI middleware.

:class:`PublicPlaneGuard` wraps the router app. For a request under ``/v1`` it checks, before
anything reads the body:

1. the client API key (:class:`pdserve.security.APIKeys`, constant-time): without
   ``Authorization: Bearer KEY`` naming a configured key the answer is 401 ``invalid_api_key``
   with ``WWW-Authenticate: Bearer`` (no key configured: every request passes); the key's
   :class:`~pdserve.security.Tenant` goes to ``request.state.tenant`` for the router's fair
   queue;
2. the body size against ``router.max_request_bytes``: a ``Content-Length`` above it is a 413
   ``request_too_large`` at once; a body without one (chunked) is counted as it arrives, and
   the first chunk past the limit stops reading it and answers 413, so nothing beyond the
   limit is ever buffered.

``/health``, ``/ready`` and ``/metrics`` (and the internal routes) pass untouched: probes and
scrapers carry no key. The key, like every secret, is never logged.
"""

from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.config.hosts import is_loopback
from pdserve.errors import (
    InvalidAPIKeyError,
    InvalidRequestError,
    PdserveError,
    RequestTooLargeError,
)
from pdserve.http.error_responses import error_response, request_id
from pdserve.security import APIKeys, bearer

log = logging.getLogger(__name__)

PUBLIC_PREFIX = "/v1"
"""The routes the guard protects (the OpenAI API)."""


TOKENIZER_PATHS = ("/tokenize", "/detokenize")
"""vLLM's tokenizer routes: on the public plane too (they cost tokenizer time)."""


def is_public(path: str) -> bool:
    """Whether ``path`` is on the public plane: ``/v1`` and :data:`TOKENIZER_PATHS`."""
    return path == PUBLIC_PREFIX or path.startswith(PUBLIC_PREFIX + "/") or path in TOKENIZER_PATHS


def log_auth_mode(api_keys: APIKeys, host: str) -> None:
    """One startup line on how ``/v1`` is protected (the count of keys, never a key); a
    warning when it is open on an address other machines can reach."""
    if api_keys.enabled:
        log.info("API keys: %d configured; /v1 requires Authorization: Bearer", len(api_keys))
    elif is_loopback(host):
        log.info("/v1 is open (no API key); the router listens on loopback %s only", host)
    else:
        log.warning(
            "/v1 is open (no API key) on %s: anyone who reaches this port may use the model; "
            "set --api-key, --api-key-file or PDSERVE_API_KEY",
            host,
        )


class _BodyTooLarge(Exception):
    """Raised from ``receive`` into the app when the body passes the limit."""


class PublicPlaneGuard:
    """ASGI middleware: API key, then body size, for ``/v1`` requests (module docstring)."""

    def __init__(self, app: ASGIApp, *, api_keys: APIKeys, max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["received_ns"] = time.time_ns()  # the request's timeline
        request = Request(scope)
        authorization = request.headers.get("authorization")
        tenant = self.api_keys.tenant_of(authorization)
        scope["state"]["tenant"] = tenant  # the router's fair queue (request.state.tenant)
        if tenant is None:
            why = "Invalid API key" if bearer(authorization) else "Missing API key"
            exc: PdserveError = InvalidAPIKeyError(
                f"{why}: send the header Authorization: Bearer YOUR_KEY"
            )
            await self._refuse(exc, scope, receive, send)
            return
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                exc = InvalidRequestError(f"invalid Content-Length {length[:40]!r}")
                await self._refuse(exc, scope, receive, send)
                return
            if int(length) > self.max_body_bytes:
                await self._refuse(self._too_large(int(length)), scope, receive, send)
                return
        await self._limited(scope, receive, send)

    def _too_large(self, size: int | None) -> RequestTooLargeError:
        got = f" ({size} bytes)" if size is not None else ""
        return RequestTooLargeError(
            f"the request body is too large{got}: at most {self.max_body_bytes} bytes "
            "(router.max_request_bytes)"
        )

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app with a ``receive`` that counts the body; past the limit, the app's own
        answer (to the exception it got) is dropped and a 413 goes out instead."""
        received = 0
        too_large = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    too_large = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if too_large:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if too_large and not started:
            await self._refuse(self._too_large(None), scope, receive, send)

    @staticmethod
    async def _refuse(exc: PdserveError, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(exc, request_id(Request(scope)), public=True)
        await response(scope, receive, send)
