"""Process logging: text or JSON lines, with the request id on every line about a request.

``--log-format json`` (``observability.log_format``) writes one JSON object a line
(python-json-logger) with ``time``, ``level``, ``logger``, ``process``, ``message`` and, on a
line about a request, ``request_id`` (the router's response id, which every worker uses as
the internal request's id) and, when that request is traced, ``trace_id``. ``request_id`` is a
field of the log record, never text parsed out of the message (a client's ``X-Request-Id``
inside a message could otherwise name another request). It comes from, in order:

1. the call's ``extra={"request_id": ...}``;
2. the context (:func:`bind_request`: the router's and workers' request handlers set it);
3. the call's argument the format string names as the request, for lines written off the
   request's task (the engine thread's): the one formatted right after ``req `` or
   ``request `` (``log.info("req %s: done", rid)``) (:func:`request_argument`).

uvicorn's own loggers join the root handler then (:func:`uvicorn_log_config`), and Python
warnings become log records (``logging.captureWarnings``). What libraries write straight to the
process's stderr (C++ warnings of torch, gloo, NIXL, UCX) is no JSON; a serving process in
JSON mode therefore sends its stderr (and stdout) through :mod:`pdserve.observability.log_relay`
(:func:`relay_output_as_json`), which wraps each such line into a record.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import re
import subprocess
import sys
import threading
from types import TracebackType
from typing import Any

REQUEST: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar(
    "pdserve_request", default=None
)
_JSON = False
_RELAY: subprocess.Popen[bytes] | None = None

_PLACEHOLDER = re.compile(r"%(?:%|(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z])")
"""A ``%``-format placeholder (``%s``, ``%.1f``, ``%*d``, ``%%``); groups: a ``*`` width and
precision, each of which takes an argument of its own."""
_NAMES_REQUEST = re.compile(r"(?:^|\W)(?:req|request) $", re.IGNORECASE)
"""What a format string has just before the placeholder of the request's id."""


def bind_request(request_id: str, trace_id: str | None = None) -> None:
    """Name the request this task (and the tasks it starts) works for, and its trace (32 hex
    digits) when traced; a request handler's task is the request's own, so nothing needs
    resetting."""
    REQUEST.set((request_id, trace_id))


@functools.lru_cache(maxsize=4096)
def _request_argument_index(fmt: str) -> int | None:
    """The index of the argument ``fmt`` formats right after ``req `` / ``request ``, or None.
    Format strings are the code's constants, so the cache stays small."""
    index = 0
    for m in _PLACEHOLDER.finditer(fmt):
        if m.group() == "%%":
            continue
        if m.group().startswith("%("):
            return None  # mapping-style arguments: no positions
        index += (m.group(1) == "*") + (m.group(2) == "*")
        if _NAMES_REQUEST.search(fmt, 0, m.start()):
            return index
        index += 1
    return None


def request_argument(record: logging.LogRecord) -> str | None:
    """The request id a log call names through its arguments: the string argument its format
    string places right after ``req `` or ``request `` (``"req %s: %s"`` -> ``args[0]``), else
    None. Only the format (the code's constant) is searched, never the formatted message, so
    no argument's text (a client's header, an exception's message) can name a request."""
    if not isinstance(record.msg, str) or not isinstance(record.args, tuple) or not record.args:
        return None
    index = _request_argument_index(record.msg)
    if index is None or index >= len(record.args):
        return None
    value = record.args[index]
    return value if isinstance(value, str) else None


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (module docstring; None: not about a request) and ``trace_id`` (the
    bound request's trace, when it is traced) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = REQUEST.get()
        rid, trace_id = bound if bound is not None else (None, None)
        given = record.__dict__.get("request_id")
        if isinstance(given, str):
            rid = given
        elif rid is None:
            rid = request_argument(record)
        record.request_id = rid
        record.trace_id = trace_id
        return True


def configure_logging(level: str, fmt: str = "text") -> None:
    """(Re)configure the root logger: ``level`` (debug, info, warning), ``fmt`` text or json.
    Called once the configuration is read; replaces earlier handlers. JSON also routes Python
    warnings through logging; it leaves the process's streams alone (a serving process calls
    :func:`relay_output_as_json` too)."""
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
    logging.captureWarnings(_JSON)
    # One line per worker call at INFO is noise; keep httpx's warnings.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def relay_output_as_json(*, stdout: bool) -> None:
    """Keep this process's stderr (and with ``stdout``, its stdout) one JSON object a line:
    file descriptor 2 (and 1) becomes a pipe read by a :mod:`pdserve.observability.log_relay` process, which
    passes JSON object lines through and wraps any other line (a C++ library's warning, a
    ``print``) into a record on the original stderr. Uncaught exceptions (main thread and
    others) are logged as one record each instead of a traceback's lines. Child processes
    started afterwards inherit the pipe. Idempotent; call after :func:`configure_logging`
    with JSON.

    The relay is a process, not a thread, so what this process writes just before it dies
    (an abort's message, a fatal error) still comes out; it ends when every writer of the
    pipe has exited. Raises OSError when it cannot be started (the streams are then as they
    were)."""
    global _RELAY
    if _RELAY is not None:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    read, write = os.pipe()
    try:
        _RELAY = subprocess.Popen(
            [sys.executable, "-m", "pdserve.observability.log_relay", str(os.getpid())],
            stdin=read,
            stdout=2,
            stderr=2,
            start_new_session=False,
        )
        os.dup2(write, 2)
        if stdout:
            os.dup2(write, 1)
    finally:
        os.close(read)
        os.close(write)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("pdserve").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    exc_info = (args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)
    logging.getLogger("pdserve").error("uncaught exception in thread %s", name, exc_info=exc_info)


def uvicorn_log_config() -> dict[str, Any] | None:
    """What ``uvicorn.Config(log_config=...)`` gets: uvicorn's own format for text logs, None
    for JSON (its loggers then propagate to the root's JSON handler)."""
    if _JSON:
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
