"""HTTP error mapping for the OpenAI API: every failure is a JSON ``{"error": {...}}`` body.

- :class:`PdserveError` -> its ``status`` and envelope (400, 404, 502, 503, 504, ...).
- FastAPI's ``RequestValidationError`` (wrong types, missing fields, invalid JSON) -> 400 (not
  FastAPI's 422) with ``param`` naming the first offending field, e.g. ``messages[0].content``.
- Starlette ``HTTPException`` (unknown route 404, wrong method 405) -> its status, enveloped.
- Anything else -> 500 ``internal_error`` with a generic message naming the request id; the
  exception (and its traceback) goes to the log under that id, never to the client. The server
  keeps serving.

Every error body carries the request id (``error.request_id``) and every error response the
``X-Request-Id`` header: the client's own ``X-Request-Id`` when it sent one, else one generated
here (:func:`request_id`). The router and the workers install the same handlers
(:func:`install_error_handlers`); nothing else registers exception handlers.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdserve.errors import (
    AuthenticationError,
    InvalidRequestError,
    PdserveError,
    QueueFullError,
)
from pdserve.protocol import ErrorBody, ErrorEnvelope

log = logging.getLogger(__name__)


REQUEST_ID_HEADER = "X-Request-Id"
_MAX_CLIENT_ID = 128  # a longer client id is replaced (it is echoed into logs and bodies)


def request_id(request: Request) -> str:
    """The request's id: the client's ``X-Request-Id`` (when printable and at most 128
    characters), else a generated ``req-<hex>``. Computed once per request (cached on
    ``request.state``), so every log line and the error body agree."""
    cached = getattr(request.state, "request_id", None)
    if isinstance(cached, str):
        return cached
    given = request.headers.get(REQUEST_ID_HEADER, "").strip()
    rid = given if given and len(given) <= _MAX_CLIENT_ID and given.isprintable() else None
    rid = rid or f"req-{uuid.uuid4().hex}"
    request.state.request_id = rid
    return rid


def error_response(exc: PdserveError, rid: str | None = None) -> JSONResponse:
    """``exc`` as its status and OpenAI envelope naming request ``rid`` (also sent as the
    ``X-Request-Id`` header); a 429 carries ``Retry-After`` (seconds), a 401
    ``WWW-Authenticate: Bearer``."""
    headers: dict[str, str] = {}
    if isinstance(exc, QueueFullError):
        headers["Retry-After"] = str(exc.retry_after_s)
    elif isinstance(exc, AuthenticationError):  # InvalidAPIKeyError too
        headers["WWW-Authenticate"] = "Bearer"
    if rid is not None:
        headers[REQUEST_ID_HEADER] = rid
    return JSONResponse(exc.to_json(rid), status_code=exc.status, headers=headers or None)


def internal_error(rid: str) -> PdserveError:
    """The generic 500 a client gets for an unexpected failure: it names the request id and
    nothing of the exception (which the caller logs with its traceback under ``rid``)."""
    return PdserveError(f"internal error (request id {rid})")


_TYPE_TAGS = {"str", "int", "float", "bool", "bytes", "none", "dict", "list"}


def _is_type_tag(part: str) -> bool:
    """Pydantic adds the union member to a location (``content.str``, ``prompt.list[int]``);
    field names in the schemas are lower snake case, type tags are not."""
    return part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper()


def field_path(loc: Sequence[Any]) -> str:
    """``("body", "messages", 0, "content", "str")`` -> ``messages[0].content``."""
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and _is_type_tag(p))]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out


def _drop_other_union_members(errors: Sequence[Any]) -> Sequence[Any]:
    """A union field (``stop: str | list[str]``) fails once per member; when a member got the
    input's type right and failed on its value (too long, too many), the other members' "not
    a valid <type>" errors say nothing: drop them."""

    def is_type_error(e: Any) -> bool:
        return str(e.get("type", "")).endswith("_type")

    value_errors = [field_path(e.get("loc", ())) for e in errors if not is_type_error(e)]
    kept = [
        e
        for e in errors
        if not is_type_error(e)
        or not any(
            v == (path := field_path(e.get("loc", ()))) or v.startswith((path + ".", path + "["))
            for v in value_errors
        )
    ]
    return kept or errors


def validation_error(errors: Sequence[Any]) -> InvalidRequestError:
    """The first validation error as a 400, naming the field and what was wrong."""
    if not errors:
        return InvalidRequestError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return InvalidRequestError(
            f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}"
        )
    errors = _drop_other_union_members(errors)
    first = errors[0]
    param = field_path(first.get("loc", ())) or None
    if param is None and first.get("type") == "missing":
        return InvalidRequestError("the request needs a JSON body")
    # A union field fails once per member: report them together, e.g. "a valid string; or ..."
    same = [e for e in errors if (field_path(e.get("loc", ())) or None) == param]
    msg = "; or ".join(dict.fromkeys(e.get("msg", "invalid value") for e in same))
    others = len(errors) - len(same)
    more = f" (and {others} more error{'s' if others > 1 else ''})" if others else ""
    where = f"{param}: " if param else ""
    return InvalidRequestError(f"{where}{msg}{more}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers described in the module docstring on ``app``."""

    @app.exception_handler(PdserveError)
    async def _pdserve(request: Request, exc: PdserveError) -> JSONResponse:
        rid = request_id(request)
        if exc.status >= 500:
            log.warning("request %s failed: %s (%s)", rid, exc.message, exc.code)
        return error_response(exc, rid)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()), request_id(request))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        rid = request_id(request)
        body = ErrorEnvelope(
            error=ErrorBody(
                message=str(exc.detail),
                type="invalid_request_error",
                code="not_found" if exc.status_code == 404 else None,
                request_id=rid,
            )
        )
        headers = {**(exc.headers or {}), REQUEST_ID_HEADER: rid}
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id(request)
        log.exception("request %s: unexpected error while serving it", rid)
        return error_response(internal_error(rid), rid)
