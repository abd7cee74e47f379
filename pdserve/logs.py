"""Process logging: text or JSON lines, with the request id on every line about a request.

``--log-format json`` (``observability.log_format``) writes one JSON object a line
(python-json-logger) with ``time``, ``level``, ``logger``, ``process``, ``message`` and, on a
line about a request, ``request_id`` (the router's response id, which every worker uses as
the internal request's id) and, when that request is traced, ``trace_id``. The id comes from
the context (:func:`bind_request`: the router's and workers' request handlers set it), else
from the message itself (lines written off the request's task, such as the engine thread's,
name it as ``req ID`` or ``request ID``). uvicorn's own loggers join the root handler then
(:func:`uvicorn_log_config`).
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
from typing import Any

REQUEST: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar(
    "pdserve_request", default=None
)
_NAMED = re.compile(r"\b(?:req|request) ([A-Za-z0-9][\w.#:-]*\d[\w.#:-]*)")  # an id has a digit
_JSON = False


def bind_request(request_id: str, trace_id: str | None = None) -> None:
    """Name the request this task (and the tasks it starts) works for, and its trace (32 hex
    digits) when traced; a request handler's task is the request's own, so nothing needs
    resetting."""
    REQUEST.set((request_id, trace_id))


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (context or message; None: not about a request) and ``trace_id``
    (the current OpenTelemetry span's, when one is recording) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = REQUEST.get()
        rid, trace_id = bound if bound is not None else (None, None)
        if rid is None:
            found = _NAMED.search(record.getMessage())
            rid = found.group(1).rstrip(":;,.") if found else None
        record.request_id = rid
        record.trace_id = trace_id
        return True


def configure_logging(level: str, fmt: str = "text") -> None:
    """(Re)configure the root logger: ``level`` (debug, info, warning), ``fmt`` text or json.
    Called once the configuration is read; replaces earlier handlers."""
    global _JSON
    _JSON = fmt == "json"
    handler = logging.StreamHandler(sys.stderr)
    if _JSON:
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "{asctime}{levelname}{name}{process}{message}{request_id}{trace_id}",
                style="{",
                rename_fields={
                    "asctime": "time",
                    "levelname": "level",
                    "name": "logger",
                },
            )
        )
        handler.addFilter(RequestIdFilter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s")
        )
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
    # One line per worker call at INFO is noise; keep httpx's warnings.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def uvicorn_log_config() -> dict[str, Any] | None:
    """What ``uvicorn.Config(log_config=...)`` gets: uvicorn's own format for text logs, None
    for JSON (its loggers then propagate to the root's JSON handler)."""
    if _JSON:
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
