"""HTTP error mapping for the OpenAI API: every failure is a JSON ``{"error": {...}}`` body.

- :class:`PdserveError` -> its ``status`` and envelope (400, 404, 502, 503, 504, ...).
- FastAPI's ``RequestValidationError`` (wrong types, missing fields, invalid JSON) -> 400 (not
  FastAPI's 422) with ``param`` naming the first offending field, e.g. ``messages[0].content``.
- Starlette ``HTTPException`` (unknown route 404, wrong method 405) -> its status, enveloped.
- Anything else -> 500 ``internal_error``, logged with its traceback; the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdserve.errors import InvalidRequestError, PdserveError, QueueFullError
from pdserve.protocol import ErrorBody, ErrorEnvelope

log = logging.getLogger(__name__)


def error_response(exc: PdserveError) -> JSONResponse:
    """``exc`` as its status and OpenAI envelope; a 429 carries ``Retry-After`` (seconds)."""
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QueueFullError) else None
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)


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
    async def _pdserve(_: Request, exc: PdserveError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("request failed: %s (%s)", exc.message, exc.code)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        body = ErrorEnvelope(
            error=ErrorBody(
                message=str(exc.detail),
                type="invalid_request_error",
                code="not_found" if exc.status_code == 404 else None,
            )
        )
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        body = ErrorEnvelope(
            error=ErrorBody(message=f"internal error: {exc!r}", type="internal_error")
        )
        return JSONResponse(body.model_dump(), status_code=500)
