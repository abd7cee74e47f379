"""What the router's OpenAPI document declares: every status code each route can return, and
the bearer security of ``/v1`` when API keys are configured.

Status codes of the completion routes (``POST /v1/chat/completions``, ``POST /v1/completions``)
and where they come from:

- 200: JSON, or ``text/event-stream`` with ``stream: true`` (a failure after the first byte is
  an in-band error event, :mod:`pdserve.server.rendering.sse`);
- 400: invalid or unsupported request (validation, :mod:`.preprocess`; FastAPI's 422 is turned
  into 400 by :mod:`.errors`, so no route declares 422), or a worker refused it;
- 401: missing or wrong API key (only with keys configured; :mod:`.guard`);
- 404: unknown model; 413: body over ``router.max_request_bytes`` (:mod:`.guard`);
- 429: a worker's queue is full, or the router's tokenizer pool (:mod:`.tokenizer_pool`),
  with ``Retry-After``;
- 500: unexpected error (generic message naming the request id);
- 502: a worker leg or the KV transfer failed; 503: no live worker (``no_worker``), no
  capacity, discovery unavailable; 504: the request deadline passed.

A 499 (the client left before its answer) is never seen by a client, so it is not declared;
404/405 for unknown routes and methods are app-wide, not per route.

``POST /v1/responses`` returns the same statuses; its 200 stream is named events
(:func:`responses_api_responses`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pdserve.errors import ErrorEnvelope
from pdserve.server.guard import is_public

SECURITY_SCHEME = "bearerAuth"

Responses = dict[int | str, dict[str, Any]]


def _error(description: str, **extra: Any) -> dict[str, Any]:
    return {"model": ErrorEnvelope, "description": description, **extra}


_RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
}


SSE_EVENT = {
    "type": "object",
    "description": "one server-sent event (OpenAPI 3.1: the schema of each event)",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "a chunk as JSON (the completion object of the route, `.chunk` for "
            "chat), an error envelope after a failure, or `[DONE]` last",
        },
        "event": {"type": "string"},
    },
}


def v1_errors(*, secured: bool) -> Responses:
    """The error statuses every ``/v1`` route can return (401 only when ``secured``)."""
    out: Responses = {500: _error("unexpected error (the message names the request id)")}
    if secured:
        out[401] = _error(
            "missing or wrong API key (code invalid_api_key; WWW-Authenticate: Bearer)"
        )
    return out


def completion_responses(model: type[Any], *, secured: bool) -> Responses:
    """Every status a completion route returns (module docstring); 200 is ``model`` as JSON
    or, with ``stream: true``, server-sent events."""
    return {
        200: {
            "model": model,
            "description": "the completion; with stream=true a text/event-stream of chunks "
            "ending with `data: [DONE]`",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        },
        400: _error(
            "invalid request, unsupported field (code unsupported), prompt beyond the "
            "context window (code context_length_exceeded); param names the field"
        ),
        404: _error("unknown model (code model_not_found)"),
        413: _error("request body over router.max_request_bytes (code request_too_large)"),
        429: _error(
            "a worker's queue is full (code queue_full) or the router's tokenizer "
            "is busy (code tokenizer_busy)",
            headers=_RETRY_AFTER,
        ),
        502: _error("a worker leg or the KV transfer failed (worker_error, kv_*)"),
        503: _error(
            "no live worker for the model (no_worker), no capacity (no_capacity) or "
            "discovery unavailable"
        ),
        504: _error("the request deadline passed (deadline_exceeded)"),
        **v1_errors(secured=secured),
    }


def tokenizer_responses(model: type[Any], *, secured: bool) -> Responses:
    """Every status ``/tokenize`` and ``/detokenize`` return: 200 is ``model``."""
    return {
        200: {"model": model, "description": "the token ids, or the text"},
        400: _error("invalid request; param names the field"),
        404: _error("unknown model (code model_not_found)"),
        413: _error("request body over router.max_request_bytes (code request_too_large)"),
        429: _error("the router's tokenizer is busy (code tokenizer_busy)", headers=_RETRY_AFTER),
        **v1_errors(secured=secured),
    }


RESPONSES_SSE_EVENT = {
    "type": "object",
    "description": "one named server-sent event of the Responses API (OpenAPI 3.1: the schema "
    "of each event)",
    "required": ["event", "data"],
    "properties": {
        "event": {
            "type": "string",
            "description": "the event's type: response.created, response.in_progress, "
            "response.output_item.added, response.content_part.added, "
            "response.output_text.delta, response.output_text.done, "
            "response.content_part.done, response.function_call_arguments.delta, "
            "response.function_call_arguments.done, response.output_item.done, then "
            "response.completed or response.incomplete (after a failure: error, "
            "response.failed)",
        },
        "data": {
            "type": "string",
            "description": "the event as JSON: its type, sequence_number and fields",
        },
    },
}


def responses_api_responses(model: type[Any], *, secured: bool) -> Responses:
    """Every status ``POST /v1/responses`` returns: those of a completion route (module
    docstring), 200 being ``model`` as JSON or, with ``stream: true``, named server-sent
    events (:mod:`pdserve.server.responses.routes`)."""
    out = completion_responses(model, secured=secured)
    out[200] = {
        "model": model,
        "description": "the response; with stream=true a text/event-stream of named events "
        "ending with response.completed, response.incomplete or response.failed",
        "content": {"text/event-stream": {"schema": RESPONSES_SSE_EVENT}},
    }
    return out


def install_openapi(app: FastAPI, *, secured: bool) -> None:
    """Build ``app``'s document once, without FastAPI's undeclarable 422 (validation errors
    are 400 here) and, when ``secured``, with the bearer scheme on every ``/v1`` operation."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        for path, item in schema.get("paths", {}).items():
            for op in item.values():
                op.get("responses", {}).pop("422", None)
                if secured and is_public(path):
                    op["security"] = [{SECURITY_SCHEME: []}]
        components = schema.setdefault("components", {})
        schemas = components.get("schemas", {})
        text = repr(schema["paths"])
        for name in ("HTTPValidationError", "ValidationError"):
            if name in schemas and f"#/components/schemas/{name}'" not in text:
                del schemas[name]
        if secured:
            components.setdefault("securitySchemes", {})[SECURITY_SCHEME] = {
                "type": "http",
                "scheme": "bearer",
                "description": "a client API key (--api-key, PDSERVE_API_KEY)",
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
