"""The JSON-log relay: ``python -m pdserve.observability.log_relay PID`` copies its stdin to its stdout one
line at a time, every line a JSON object.

A serving process in JSON log mode (:func:`pdserve.observability.logs.relay_output_as_json`) points its
stderr (and stdout) at a pipe into this process, whose stdout is the process's original
stderr. A line that already is a JSON object (a log record) passes unchanged; any other line
(a C++ library's warning, a ``print``, Python's last words before a fatal error) becomes a
record of the same shape as the log's: ``{"time", "level": "WARNING", "logger": "stderr",
"process": PID, "message": the line, "request_id": null, "trace_id": null}``. A line longer
than :data:`MAX_LINE_BYTES` is cut into records of that size; empty lines are dropped.

It imports only the standard library, ignores SIGINT and SIGTERM (the process it serves is
stopped by them, and whatever that process writes on its way out must still come through), and
exits when every writer of the pipe has closed it: the served process and the children that
inherited its streams.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import BinaryIO

MAX_LINE_BYTES = 65536
"""Longest line relayed as one record; the rest of a longer line follows in further records."""


def record(line: bytes, process: int, now: float) -> bytes:
    """``line`` (without its newline) as one JSON line: unchanged when it is a JSON object,
    else wrapped into a ``stderr`` record of ``process`` at ``now`` (UNIX seconds) whose
    ``time`` is formatted as the log's (``2025-01-31 12:00:00,123``, local time)."""
    if line.startswith(b"{"):
        try:
            if isinstance(json.loads(line), dict):
                return line + b"\n"
        except ValueError:
            pass
    millis = int(now % 1 * 1000)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{millis:03d}"
    wrapped = {
        "time": stamp,
        "level": "WARNING",
        "logger": "stderr",
        "process": process,
        "message": line.decode("utf-8", "backslashreplace"),
        "request_id": None,
        "trace_id": None,
    }
    return json.dumps(wrapped, ensure_ascii=False).encode() + b"\n"


def relay(source: BinaryIO, sink: BinaryIO, process: int) -> None:
    """Copy ``source`` to ``sink`` line by line as :func:`record` makes them, flushing each,
    until ``source`` ends."""
    while raw := source.readline(MAX_LINE_BYTES):
        line = raw.rstrip(b"\r\n")
        if line.strip():
            sink.write(record(line, process, time.time()))
            sink.flush()


def main(argv: list[str]) -> int:
    """``argv``: the served process's id. Returns the exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    process = int(argv[0]) if argv else 0
    try:
        relay(sys.stdin.buffer, sys.stdout.buffer, process)
    except BrokenPipeError:  # the original stderr is gone: nothing left to write to
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
