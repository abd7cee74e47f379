"""The process supervisor behind ``pdserve up``, the serving benchmark and the test stack: ready
waits that name the failing process, stop order, the kill after the grace period, and restarts
(backoff, limit, PDSERVE_RESTARTS, a prompt stop during a backoff) with real short-lived
children."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from pdserve.config.settings import SupervisorSettings
from pdserve.launch.supervisor import (
    ProcessExitedError,
    ProcessSpec,
    ProcessSupervisor,
    ReadyTimeoutError,
    RestartPolicy,
)
from tests.support.servers import free_port, wait_until_sync


def python(name: str, code: str, log: Path | None = None, tier: int = 0) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, "-c", code], log_path=log, tier=tier)


# Children that stay up: their sleep is what they do (the supervisor stops them), not a wait.
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


# --- restarts (WATCH with a RestartPolicy) -------------------------------------------------------

# Stays up (its sleep, as SLEEPER's) once it crashed ``crashes`` times.
COUNT_RUNS = (
    "import os, pathlib, sys, time; log = pathlib.Path(sys.argv[1]); "
    "log.open('a').write(os.environ['PDSERVE_RESTARTS'] + '\\n'); "
    "n = len(log.read_text().split()); time.sleep(60) if n > {crashes} else sys.exit(3)"
)


def counting(name: str, runs: Path, crashes: int) -> ProcessSpec:
    """A process that appends its PDSERVE_RESTARTS to ``runs`` and exits with 3 for the first
    ``crashes`` runs, then stays up."""
    code = COUNT_RUNS.format(crashes=crashes)
    return ProcessSpec(name, [sys.executable, "-c", code, str(runs)])


def test_policy_backoff_doubles_up_to_its_maximum() -> None:
    policy = RestartPolicy(limit=9, backoff_s=0.5, backoff_max_s=3.0)
    assert [policy.delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RestartPolicy(limit=-1)
    settings = SupervisorSettings(restart_limit=2, restart_window_s=9, restart_backoff_s=0.1)
    assert RestartPolicy.from_settings(settings) == RestartPolicy(2, 9.0, 0.1, 15.0)


def test_an_exited_process_is_restarted_in_its_place_with_backoff_and_its_count(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    runs = tmp_path / "runs"
    policy = RestartPolicy(limit=5, window_s=60, backoff_s=0.1, backoff_max_s=0.2)
    with ProcessSupervisor(poll_s=0.02, notify=notes.append) as sup:
        sup.spawn(python("router", SLEEPER))
        sup.spawn(counting("prefill-0", runs, crashes=3))
        sup.spawn(python("decode-0", SLEEPER))
        start = time.monotonic()
        assert (
            sup.watch(lambda: runs.is_file() and len(runs.read_text().split()) >= 4, policy) is None
        )
        elapsed = time.monotonic() - start
        names = [p.name for p in sup.processes]
        restarted = sup.processes[1]
        assert names == ["router", "prefill-0", "decode-0"]  # the start (and stop) order holds
        assert restarted.running and restarted.restarts == 3
        assert sup.recent_restarts("prefill-0") == 3
    assert runs.read_text().split() == ["0", "1", "2", "3"]  # PDSERVE_RESTARTS of each run
    assert notes == [
        "prefill-0 exited with code 3; restarting in 0.1 s (restart 1 of at most 5 in 60 s)",
        "prefill-0 exited with code 3; restarting in 0.2 s (restart 2 of at most 5 in 60 s)",
        "prefill-0 exited with code 3; restarting in 0.2 s (restart 3 of at most 5 in 60 s)",
    ]
    assert elapsed >= 0.5  # the backoffs were waited
    assert all(not p.running for p in sup.processes)


def test_past_the_limit_the_process_is_returned_and_nothing_else_restarts(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    policy = RestartPolicy(limit=2, window_s=60, backoff_s=0.05)
    with ProcessSupervisor(poll_s=0.02, notify=notes.append) as sup:
        sup.spawn(python("router", SLEEPER))
        sup.spawn(python("prefill-0", "raise SystemExit(3)"))
        dead = sup.watch(lambda: False, policy)
        assert dead is not None and dead.name == "prefill-0" and dead.returncode == 3
        assert dead.restarts == 2 and len(notes) == 2
        assert sup.processes[0].running


def test_restart_limit_zero_returns_the_first_exit() -> None:
    with ProcessSupervisor(poll_s=0.02) as sup:
        sup.spawn(python("decode-0", "raise SystemExit(3)"))
        dead = sup.watch(lambda: False, RestartPolicy(limit=0))
        assert dead is not None and dead.restarts == 0


def test_stopping_during_a_backoff_returns_promptly_without_restarting(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    asked = 0.0

    def stopping() -> bool:
        nonlocal asked
        # Ask to stop once the exit was seen (the backoff of 30 s is running).
        if not asked and notes:
            asked = time.monotonic()
        return bool(asked)

    notes: list[str] = []
    policy = RestartPolicy(limit=3, backoff_s=30, backoff_max_s=30)
    with ProcessSupervisor(poll_s=0.05, notify=notes.append) as sup:
        sup.spawn(counting("decode-0", runs, crashes=1))
        assert sup.watch(stopping, policy) is None
        assert time.monotonic() - asked < 1.0
        assert "restarting in 30 s" in notes[0]
    assert runs.read_text().split() == ["0"]  # never started again


def test_a_restarted_process_appends_to_its_log(tmp_path: Path) -> None:
    log, runs = tmp_path / "log", tmp_path / "runs"
    code = COUNT_RUNS.format(crashes=1).replace("; n =", "; print('run', flush=True); n =")
    spec = ProcessSpec("w", [sys.executable, "-c", code, str(runs)], log_path=log)
    policy = RestartPolicy(limit=2, backoff_s=0.05)
    with ProcessSupervisor(poll_s=0.02) as sup:
        sup.spawn(spec)
        sup.watch(lambda: len(sup.processes[0].log().split()) >= 2, policy)
    assert log.read_text().split() == ["run", "run"]


# --- retire (the autoscaler's scale-down) ------------------------------------------------------


def test_a_retired_process_is_signalled_not_restarted_and_leaves_once_it_exited(
    tmp_path: Path,
) -> None:
    ticks: list[int] = []
    policy = RestartPolicy(limit=5, window_s=60, backoff_s=0.01, backoff_max_s=0.01)
    with ProcessSupervisor(poll_s=0.02) as sup:
        keep = sup.spawn(python("decode-0", SLEEPER))
        gone = sup.spawn(python("decode-1", SLEEPER))
        stubborn = sup.spawn(python("decode-2", STUBBORN, tmp_path / "stubborn.log"))
        wait_until_sync(lambda: "up" in stubborn.log_tail(), 30, what="the stubborn child")
        sup.retire(gone, timeout_s=30)  # SIGTERM ends a sleeper at once
        sup.retire(stubborn, timeout_s=0.3)  # ignores SIGTERM: killed past its timeout

        def done() -> bool:
            ticks.append(1)
            return len(sup.processes) == 1

        assert sup.watch(done, policy, tick=lambda: ticks.append(0)) is None
        assert sup.processes == [keep] and keep.running
        assert gone.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
        assert sup.crashed() is None and 0 in ticks  # the tick ran on the watch's polls
