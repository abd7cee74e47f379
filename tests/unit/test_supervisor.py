"""The process supervisor behind ``pdserve up``, the serving benchmark and the test stack: ready
waits that name the failing process, stop order and the kill after the grace period."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from pdserve.supervisor import (
    ProcessExitedError,
    ProcessSpec,
    ProcessSupervisor,
    ReadyTimeoutError,
)
from tests.fixtures.servers import free_port, wait_until_sync


def python(name: str, code: str, log: Path | None = None, tier: int = 0) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, "-c", code], log_path=log, tier=tier)


SLEEPER = "import time; time.sleep(60)"
STUBBORN = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(60)"
)


def test_a_process_exiting_while_starting_is_named_with_the_end_of_its_log(
    tmp_path: Path,
) -> None:
    with ProcessSupervisor(poll_s=0.05) as sup:
        sup.spawn(python("router", SLEEPER))
        sup.spawn(python("decode-0", "print('no GPU here'); raise SystemExit(3)", tmp_path / "d"))
        with pytest.raises(ProcessExitedError) as info:
            sup.wait_ready(f"http://127.0.0.1:{free_port()}", timeout_s=30)
    assert info.value.process.name == "decode-0"
    assert "decode-0 exited with code 3 while starting" in str(info.value)
    assert "no GPU here" in str(info.value)


def test_ready_wait_times_out_with_the_last_answer_and_the_logs(tmp_path: Path) -> None:
    with ProcessSupervisor(poll_s=0.05) as sup:
        sup.spawn(python("router", f"print('listening'); {SLEEPER}", tmp_path / "r"))
        with pytest.raises(ReadyTimeoutError) as info:
            sup.wait_ready(f"http://127.0.0.1:{free_port()}", timeout_s=0.3, what="the stack")
    text = str(info.value)
    assert text.startswith("the stack was not ready within 0.3 s (last answer of http://")
    assert "ConnectError" in text and "--- router\nlistening" in text


def test_ready_when_the_url_answers_and_the_condition_holds(tmp_path: Path) -> None:
    (tmp_path / "ready").write_text("{}")
    port = free_port()
    server = f"-m http.server {port} --bind 127.0.0.1 --directory {tmp_path}".split()
    checked: list[int] = []

    def accept(response: object) -> bool:
        checked.append(1)
        return len(checked) >= 2  # e.g. "every worker registered", true on the second poll

    with ProcessSupervisor(poll_s=0.05) as sup:
        sup.spawn(ProcessSpec("http", [sys.executable, *server], log_path=tmp_path / "log"))
        assert sup.wait_ready(f"http://127.0.0.1:{port}", timeout_s=30, accept=accept)
    assert len(checked) == 2
    assert all(not p.running for p in sup.processes)


def test_ready_wait_returns_false_when_asked_to_stop() -> None:
    with ProcessSupervisor(poll_s=0.05) as sup:
        sup.spawn(python("router", SLEEPER))
        assert not sup.wait_ready("http://127.0.0.1:1", timeout_s=30, stopping=lambda: True)


def test_stop_signals_higher_tiers_first_and_kills_after_the_grace_period(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    sup = ProcessSupervisor(grace_s=0.5, poll_s=0.05, notify=notes.append)
    router = sup.spawn(python("router", SLEEPER, tier=0))
    worker = sup.spawn(python("worker", STUBBORN, tmp_path / "w", tier=1))
    wait_until_sync(lambda: "up" in worker.log(), 10, interval_s=0.02, what="its SIGTERM handler")
    start = time.monotonic()
    sup.stop()
    assert time.monotonic() - start >= 0.5
    assert notes == ["worker did not stop in 0.5 s; killing it"]
    assert worker.returncode == -signal.SIGKILL and router.returncode == -signal.SIGTERM
    sup.stop()  # idempotent


def test_a_process_killed_on_purpose_is_not_a_crash() -> None:
    with ProcessSupervisor(poll_s=0.05) as sup:
        a = sup.spawn(python("decode-0", SLEEPER))
        b = sup.spawn(python("decode-1", "raise SystemExit(1)"))
        a.kill()
        b.popen.wait(30)
        assert sup.crashed() is b
        assert sup.watch(lambda: False) is b
        assert sup.watch(lambda: True) is None
