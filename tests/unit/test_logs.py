"""JSON logs (pdserve.observability.logs): the request id is a field of the record, taken from the context or
the argument the format names, never parsed out of a message's text; and what a process writes
to its stderr and stdout besides log records (a C++ library's warning, a print, its last words
before an abort) reaches the log as JSON lines, through the relay (pdserve.observability.log_relay)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from pdserve.observability import log_relay, logs


@pytest.fixture
def json_logs() -> Iterator[logging.Logger]:
    """A logger; the test configures JSON logging (to its captured stderr, which exists from
    the test's call on); the root logger's handlers and the context put back afterwards."""
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        yield logging.getLogger("pdserve.test")
    finally:
        logs.REQUEST.set(None)
        logs.configure_logging("info", "text")
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


def records(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines()]


CRAFTED = "x req chatcmpl-victim1"
"""A client's id (or any text an argument carries) that names another request."""


def test_the_request_id_is_the_argument_the_format_names_never_message_text(
    json_logs: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure_logging("info", "json")
    log = json_logs
    log.warning("request %s failed: %s (%s)", "req-abc1", f"upstream said {CRAFTED}", "code")
    log.warning("parked KV block %d of request %s changed hands (%.1f%%)", 3, "cmpl-5", 2.0)
    log.info("%*d items of req %s", 4, 12, "cmpl-6")  # a * width takes an argument of its own
    log.info("client said %s", CRAFTED)  # the text names a request; the format does not
    log.info(f"pre-formatted {CRAFTED}")  # noqa: G004 - nor here: no argument at all
    log.info("req %s: done", 42)  # not a string: no id
    log.info("req %(id)s", {"id": "cmpl-8"})  # mapping arguments: no positions
    log.info("on its own %s", "x", extra={"request_id": "cmpl-9"})
    got = [r["request_id"] for r in records(capsys)]
    assert got == ["req-abc1", "cmpl-5", "cmpl-6", None, None, None, None, "cmpl-9"]


def test_the_bound_request_names_its_task_lines_before_any_argument(
    json_logs: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure_logging("info", "json")
    logs.bind_request("cmpl-77", "ab" * 16)
    json_logs.info("req %s: a line naming another", "cmpl-1")
    json_logs.info("a line naming none")
    (first, second) = records(capsys)
    assert first["request_id"] == second["request_id"] == "cmpl-77"
    assert second["trace_id"] == "ab" * 16


def test_the_relay_passes_records_and_wraps_every_other_line() -> None:
    record = b'{"time": "t", "level": "INFO", "message": "m"}'
    assert log_relay.record(record, 7, 0.0) == record + b"\n"
    for line in (b"[W socket.cpp:464] [c10d] The server socket has failed", b"{not json",
                 b"[1, 2]", b"\xff\xfe bytes", b'"a string"'):  # fmt: skip
        wrapped = json.loads(log_relay.record(line, 7, 1.5))
        assert wrapped["logger"] == "stderr" and wrapped["process"] == 7
        assert wrapped["level"] == "WARNING" and wrapped["request_id"] is None
        assert wrapped["message"] == line.decode("utf-8", "backslashreplace")
        assert wrapped["time"].endswith(",500")


CHILD = textwrap.dedent(
    """
    import logging, os, sys, threading, warnings
    from pdserve.observability import logs
    logs.configure_logging("info", "json")
    logs.relay_output_as_json(stdout=True)
    logging.getLogger("child").info("req %s: started", "cmpl-1")
    os.write(2, b"[W ProcessGroupGloo.cpp:727] a C++ warning, straight to fd 2\\n")
    print("a print to stdout", flush=True)
    print("a print to stderr", file=sys.stderr, flush=True)
    warnings.warn("a Python warning")
    boom = threading.Thread(target=lambda: 1 / 0, name="boom")
    boom.start()
    boom.join()
    os.write(2, b"last words, then a sudden exit\\n")
    os._exit(70)  # no atexit, no flush: as a crash ends it
    """
)


def test_a_process_relaying_its_output_writes_only_json_lines_even_when_it_dies() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 70
    assert done.stdout == b""  # the child's stdout went through the relay too
    lines = done.stderr.decode().splitlines()
    parsed = [json.loads(line) for line in lines]  # every line is JSON
    messages = [r["message"] for r in parsed]
    assert any(r["request_id"] == "cmpl-1" and r["message"] == "req cmpl-1: started"
               for r in parsed)  # fmt: skip
    for text in ("a C++ warning, straight to fd 2", "a print to stdout", "a print to stderr",
                 "last words, then a sudden exit"):  # fmt: skip
        assert any(text in m for m in messages), (text, messages)
    assert any("a Python warning" in m for m in messages)
    (thread,) = [r for r in parsed if r["message"] == "uncaught exception in thread boom"]
    assert "ZeroDivisionError" in str(thread.get("exc_info"))
