"""HTTP error mapping for the OpenAI API: every failure is a JSON ``{"error": {...}}`` body.

- :class:`PdserveError` -> its ``status`` and envelope (400, 404, 502, 503, 504, ...).
- FastAPI's ``RequestValidationError`` (wrong types, missing fields, invalid JSON) -> 400 (not
  FastAPI's 422) with ``param`` naming the first offending field, e.g. ``messages[0].content``.
- Starlette ``HTTPException`` (unknown route 404, wrong method 405) -> its status, enveloped.
- Anything else -> 500 ``internal_error`` with a generic message naming the request id; the
  exception (and its traceback) goes to the log under that id, never to the client. The server
  keeps serving.

On the public plane (the router's app: ``install_error_handlers(app, public=True)``) a body
carries :attr:`~pdserve.errors.PdserveError.public_message`, never an internal worker id,
address or peer; the full message goes to the log under the request id (a 5xx as a warning).

Every error body carries the request id (``error.request_id``) and every error response the
``X-Request-Id`` header: the client's own ``X-Request-Id`` when it is an id
(:data:`CLIENT_REQUEST_ID`: letters, digits and ``._:-``, at most 128 characters), else one
generated here (:func:`request_id`). A client's id is never refused, only replaced (the response
header says which id its request got): it lands in log lines, where spaces or quotes could fake
fields. vLLM takes the header verbatim. The router and the workers install the same handlers
(:func:`install_error_handlers`); nothing else registers exception handlers.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pdserve.errors import (
    AuthenticationError,
    ErrorBody,
    ErrorEnvelope,
    InvalidRequestError,
    PdserveError,
    QueueFullError,
)

log = logging.getLogger(__name__)


REQUEST_ID_HEADER = "X-Request-Id"
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""The client ``X-Request-Id`` values taken as the request's id (UUIDs, ULIDs, ``req_...``,
``trace:span``); any other is replaced by a generated one."""


def request_id(request: Request) -> str:
    """The request's id: the client's ``X-Request-Id`` when it matches
    :data:`CLIENT_REQUEST_ID`, else a generated ``req-<hex>``. Computed once per request
    (cached on ``request.state``), so every log line and the error body agree."""
    cached = getattr(request.state, "request_id", None)
    if isinstance(cached, str):
        return cached
    given = request.headers.get(REQUEST_ID_HEADER, "").strip()
    rid = given if CLIENT_REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex}"
    request.state.request_id = rid
    return rid


def error_response(
    exc: PdserveError, rid: str | None = None, *, public: bool = False
) -> JSONResponse:
    """``exc`` as its status and OpenAI envelope naming request ``rid`` (also sent as the
    ``X-Request-Id`` header); a 429 carries ``Retry-After`` (seconds), a 401
    ``WWW-Authenticate: Bearer``. ``public``: the body carries ``exc.public_message``."""
    headers: dict[str, str] = {}
    if isinstance(exc, QueueFullError):
        headers["Retry-After"] = str(exc.retry_after_s)
    elif isinstance(exc, AuthenticationError):  # InvalidAPIKeyError too
        headers["WWW-Authenticate"] = "Bearer"
    if rid is not None:
        headers[REQUEST_ID_HEADER] = rid
    body = exc.to_json(rid, public=public)
    return JSONResponse(body, status_code=exc.status, headers=headers or None)


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


def _is_type_error(e: Any) -> bool:
    return str(e.get("type", "")).endswith("_type")


def _ancestors(path: str) -> list[str]:
    """``path`` and every field above it: ``messages[0].content`` -> ``messages[0].content``,
    ``messages[0]``, ``messages``."""
    out = [path]
    for i in range(len(path) - 1, 0, -1):
        if path[i] in ".[":
            out.append(path[:i])
    return out


def _drop_other_union_members(errors: Sequence[Any], paths: Sequence[str]) -> list[int]:
    """A union field (``stop: str | list[str]``) fails once per member; when a member got the
    input's type right and failed on its value (too long, too many), the other members' "not
    a valid <type>" errors say nothing: drop them. ``paths[i]`` is ``field_path`` of
    ``errors[i]``; returns the indexes kept (all of them if none would be).

    Linear in the number of errors (a hostile body can carry hundreds of thousands, and this
    runs on the event loop): the fields at or above a value error go into one set, which each
    type error is looked up in once. A path's ancestors are bounded by the schemas' depth."""
    covered: set[str] = set()
    for e, path in zip(errors, paths, strict=True):
        if not _is_type_error(e):
            covered.update(_ancestors(path))
    kept = [i for i, e in enumerate(errors) if not _is_type_error(e) or paths[i] not in covered]
    return kept or list(range(len(errors)))


def _message(error: Any) -> str:
    """Pydantic's message for one error, without the "Value error, " it puts before the text
    of a schema validator's ValueError."""
    msg = str(error.get("msg", "invalid value"))
    return msg.removeprefix("Value error, ") if error.get("type") == "value_error" else msg


def validation_error(errors: Sequence[Any]) -> InvalidRequestError:
    """The first validation error as a 400, naming the field and what was wrong, with the
    count of the others. Time linear in ``len(errors)``."""
    if not errors:
        return InvalidRequestError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return InvalidRequestError(
            f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}"
        )
    paths = [field_path(e.get("loc", ())) for e in errors]
    kept = _drop_other_union_members(errors, paths)
    first = errors[kept[0]]
    param = paths[kept[0]] or None
    if param is None and first.get("type") == "missing":
        return InvalidRequestError("the request needs a JSON body")
    # A union field fails once per member: report them together, e.g. "a valid string; or ..."
    same = [errors[i] for i in kept if (paths[i] or None) == param]
    msg = "; or ".join(dict.fromkeys(_message(e) for e in same))
    others = len(kept) - len(same)
    more = f" (and {others} more error{'s' if others > 1 else ''})" if others else ""
    where = f"{param}: " if param else ""
    return InvalidRequestError(f"{where}{msg}{more}", param=param)


def log_failure(rid: str, exc: PdserveError, *, public: bool, what: str = "failed") -> None:
    """Log ``exc`` under request ``rid``: a 5xx as a warning, and on the public plane any
    error whose body hides part of its message (a 429 from a worker) at info."""
    if exc.status >= 500:
        log.warning("request %s %s: %s (%s)", rid, what, exc.message, exc.code)
    elif public and exc.public_message != exc.message:
        log.info("request %s %s: %s (%s)", rid, what, exc.message, exc.code)


def install_error_handlers(app: FastAPI, *, public: bool = False) -> None:
    """Register the handlers described in the module docstring on ``app``; ``public``: the
    bodies carry public messages (the router's client-facing app)."""

    @app.exception_handler(PdserveError)
    async def _pdserve(request: Request, exc: PdserveError) -> JSONResponse:
        rid = request_id(request)
        log_failure(rid, exc, public=public)
        return error_response(exc, rid, public=public)

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
