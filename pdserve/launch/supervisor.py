"""Child processes started, waited for, watched and stopped in one way: the supervisor under
every stack (:mod:`pdserve.launch.stack`, which ``pdserve up``, the benchmarks and the tests' stack
build on).

Lifecycle of the processes of one :class:`ProcessSupervisor`::

    1 SPAWN   spawn(ProcessSpec): argv, environment, stdout + stderr into a log file (or the
              supervisor's own streams), optionally in a session of its own (a terminal's
              Ctrl-C then reaches only the supervisor, which stops the children in order)
    2 READY   wait_ready(url): poll GET {url}/ready until it answers 200 (and ``accept`` holds);
              a process that exits meanwhile raises ProcessExitedError with the end of its
              log, the deadline raises ReadyTimeoutError with the last answer and the logs
    3 WATCH   watch(stopping, policy): until a process exits unexpectedly (returned) or the
              caller asks to stop (None). With a :class:`RestartPolicy`, a process that exits
              is started again from its :class:`ProcessSpec` after a backoff (doubling from
              ``backoff_s`` to ``backoff_max_s``), in its place in the start order, each
              restart announced through ``notify``; only a process past ``limit`` restarts
              within ``window_s`` is returned. ``stopping`` is polled during a backoff too, so
              Ctrl-C stops promptly
    4 STOP    stop(): by tier, highest first (workers before the router they deregister
              from); within a tier SIGTERM in reverse start order, one shared grace period,
              then SIGKILL for what is left. Idempotent; also run on leaving the ``with`` block

Every child gets ``PDSERVE_RESTARTS=<n>`` in its environment (:data:`RESTARTS_ENV`): 0 at the
first start, the process's restart count after that; :mod:`pdserve.observability.prometheus` exports it as
``pdserve_process_restarts``.

Thread-safety: none; drive a supervisor from one thread. A signal handler should only set the
flag that ``stopping`` reads.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from pdserve.config.settings import SupervisorSettings

logger = logging.getLogger(__name__)

LOG_TAIL_CHARS = 4000
"""How much of a process's log an error message quotes."""

RESTARTS_ENV = "PDSERVE_RESTARTS"
"""The environment variable that tells a child how many times it was restarted."""


def pdserve_argv(args: Sequence[str], *, log_level: str) -> list[str]:
    """The argv that runs the ``pdserve`` command line with this interpreter."""
    return [sys.executable, "-m", "pdserve.cli", "--log-level", log_level, *args]


@dataclass(frozen=True)
class ProcessSpec:
    """How to start one child. ``env`` None inherits this process's environment;
    ``log_path`` None inherits its stdout and stderr, else both go to that file (truncated).
    ``tier``: processes stop in tiers, highest first (see the module docstring)."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    log_path: Path | None = None
    new_session: bool = False
    tier: int = 0
    popen_kwargs: Mapping[str, object] = field(default_factory=dict)
    """More keyword arguments for :class:`subprocess.Popen` (e.g. ``stdin``, ``preexec_fn``)."""


class ManagedProcess:
    """One child process. Owns nothing but the ``popen`` handle; the log file belongs to the
    caller. ``stopped`` is set once it was asked to stop on purpose (:meth:`kill`, the
    supervisor's stop): its exit is then expected, not a crash. ``restarts``: how many times
    its spec was started before this one."""

    def __init__(
        self, spec: ProcessSpec, popen: subprocess.Popen[bytes], restarts: int = 0
    ) -> None:
        self.spec = spec
        self.popen = popen
        self.name = spec.name
        self.log_path = spec.log_path
        self.tier = spec.tier
        self.restarts = restarts
        self.stopped = False

    @classmethod
    def start(cls, spec: ProcessSpec, restarts: int = 0) -> ManagedProcess:
        """Start ``spec`` with ``PDSERVE_RESTARTS=<restarts>`` added to its environment; a
        restart appends to the log file instead of truncating it. Raises OSError when its
        executable cannot be run."""
        env = dict(os.environ if spec.env is None else spec.env)
        env[RESTARTS_ENV] = str(restarts)
        kwargs: dict[str, object] = {"env": env, "start_new_session": spec.new_session}
        kwargs.update(spec.popen_kwargs)
        if spec.log_path is None:
            popen = subprocess.Popen(list(spec.argv), **kwargs)  # type: ignore[call-overload]
        else:
            # The child holds its own descriptor; a restart keeps the earlier runs' lines.
            with open(spec.log_path, "ab" if restarts else "wb") as out:
                popen = subprocess.Popen(  # type: ignore[call-overload]
                    list(spec.argv), stdout=out, stderr=subprocess.STDOUT, **kwargs
                )
        return cls(spec, popen, restarts)

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, returncode={self.returncode})"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), None while it runs."""
        return self.popen.poll()

    @property
    def running(self) -> bool:
        return self.returncode is None

    @property
    def crashed(self) -> bool:
        """It exited without being asked to stop."""
        return not self.stopped and not self.running

    def log(self) -> str:
        """The whole log file ("" without one, or before the file exists)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n_chars: int = LOG_TAIL_CHARS) -> str:
        return self.log()[-n_chars:]

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 15.0) -> None:
        """Send ``sig`` (default SIGKILL) on purpose and wait for the exit; raises
        subprocess.TimeoutExpired when it outlives ``timeout_s``."""
        self.stopped = True
        if self.running:
            self.popen.send_signal(sig)
            self.popen.wait(timeout_s)


class ProcessExitedError(RuntimeError):
    """A supervised process exited while it was expected to run ``during`` something (e.g.
    "while starting"); the message quotes the end of its log."""

    def __init__(self, process: ManagedProcess, during: str) -> None:
        self.process = process
        message = f"{process.name} exited with code {process.returncode} {during}"
        if tail := process.log_tail():
            message += f"; the end of {process.log_path}:\n{tail}"
        super().__init__(message)


class ReadyTimeoutError(TimeoutError):
    """The processes did not become ready before the deadline."""


@dataclass(frozen=True)
class RestartPolicy:
    """When :meth:`ProcessSupervisor.watch` starts an exited process again.

    A process may be restarted ``limit`` times within any ``window_s`` seconds (0: never);
    the n-th restart within the window waits ``backoff_s * 2**(n-1)`` seconds, at most
    ``backoff_max_s``. Raises ValueError on a negative limit or a non-positive duration.
    """

    limit: int = 5
    window_s: float = 300.0
    backoff_s: float = 0.5
    backoff_max_s: float = 15.0

    def __post_init__(self) -> None:
        if self.limit < 0 or min(self.window_s, self.backoff_s, self.backoff_max_s) <= 0:
            raise ValueError(f"invalid restart policy {self}")

    @classmethod
    def from_settings(cls, s: SupervisorSettings) -> RestartPolicy:
        """The policy of the ``supervisor`` settings section."""
        return cls(
            s.restart_limit, s.restart_window_s, s.restart_backoff_s, s.restart_backoff_max_s
        )

    def delay_s(self, restart: int) -> float:
        """Seconds before restart number ``restart`` (1-based) within the window."""
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(0, restart - 1)))


class _RestartLedger:
    """Restart times of one process name (monotonic seconds), pruned to the policy's window."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.times: deque[float] = deque()

    def recent(self, now: float) -> int:
        while self.times and self.times[0] <= now - self.policy.window_s:
            self.times.popleft()
        return len(self.times)


class ProcessSupervisor:
    """Starts, waits for, watches and stops a set of child processes (module docstring).

    ``grace_s``: how long a SIGTERM'd tier may take before SIGKILL; ``poll_s``: the interval
    of every wait; ``notify`` receives one line per process that had to be killed (default:
    this module's logger).
    """

    def __init__(
        self,
        *,
        grace_s: float = 10.0,
        poll_s: float = 0.3,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._notify = notify or logger.warning
        self.processes: list[ManagedProcess] = []
        """In start order; a restarted process takes its predecessor's place."""
        self._ledgers: dict[str, _RestartLedger] = {}
        self._retiring: dict[int, tuple[ManagedProcess, float]] = {}

    def __enter__(self) -> ProcessSupervisor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def spawn(self, spec: ProcessSpec) -> ManagedProcess:
        """Start ``spec`` and supervise it; raises OSError when it cannot be started."""
        process = ManagedProcess.start(spec)
        self.processes.append(process)
        return process

    def crashed(self) -> ManagedProcess | None:
        """The first process, in start order, that exited without being asked to."""
        return next((p for p in self.processes if p.crashed), None)

    def wait_until(
        self,
        ready: Callable[[], bool],
        *,
        timeout_s: float,
        what: str,
        stopping: Callable[[], bool] | None = None,
        detail: Callable[[], str] | None = None,
    ) -> bool:
        """Poll ``ready()`` every ``poll_s`` until it holds (True) or ``stopping()`` does
        (False). Raises ProcessExitedError when a process crashes first, ReadyTimeoutError
        naming ``what``, ``detail()`` and the end of every log after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            if stopping is not None and stopping():
                return False
            if (dead := self.crashed()) is not None:
                raise ProcessExitedError(dead, "while starting")
            if ready():
                return True
            if time.monotonic() >= deadline:
                message = f"{what} was not ready within {timeout_s:g} s"
                if detail is not None:
                    message += f" ({detail()})"
                logs = [f"--- {p.name}\n{t}" for p in self.processes if (t := p.log_tail(3000))]
                raise ReadyTimeoutError("\n".join([message, *logs]))
            time.sleep(self.poll_s)

    def wait_ready(
        self,
        url: str,
        *,
        timeout_s: float,
        what: str | None = None,
        accept: Callable[[httpx.Response], bool] | None = None,
        stopping: Callable[[], bool] | None = None,
    ) -> bool:
        """:meth:`wait_until` ``GET {url}/ready`` answers 200 and ``accept(response)`` holds
        (it may make requests of its own; an httpx error, ValueError or KeyError in it counts
        as not ready). True when ready, False when ``stopping()`` came first."""
        last = "no answer"

        def answered() -> bool:
            nonlocal last
            try:
                r = client.get(f"{url}/ready")
                last = f"HTTP {r.status_code} {r.text[:300]}"
                return r.status_code == 200 and (accept is None or accept(r))
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                return False

        with httpx.Client(timeout=2.0) as client:
            return self.wait_until(
                answered,
                timeout_s=timeout_s,
                what=what or url,
                stopping=stopping,
                detail=lambda: f"last answer of {url}/ready: {last}",
            )

    def watch(
        self,
        stopping: Callable[[], bool],
        policy: RestartPolicy | None = None,
        tick: Callable[[], None] | None = None,
    ) -> ManagedProcess | None:
        """Block until ``stopping()`` holds (None) or a process exits without being asked to.
        ``tick()`` runs once per poll on this thread (the autoscaler's actuator starts and
        retires processes there, so the supervisor stays single-threaded).
        Without ``policy`` that process is returned at once. With one it is started again from
        its spec after the policy's backoff, in its place in :attr:`processes` (``notify`` gets
        ``"NAME exited with code C; restarting in D s (restart N of at most L in W s)"``), and
        returned only when it exits once more than ``policy.limit`` restarts within
        ``policy.window_s`` allow. Raises OSError when a restart cannot run the executable."""
        due: dict[int, float] = {}  # id(exited process) -> monotonic time of its restart
        while not stopping():
            now = time.monotonic()
            for dead in [p for p in self.processes if p.crashed and id(p) not in due]:
                if policy is None:
                    return dead
                ledger = self._ledgers.setdefault(dead.name, _RestartLedger(policy))
                n = ledger.recent(now) + 1
                if n > policy.limit:
                    return dead
                ledger.times.append(now)
                delay = policy.delay_s(n)
                due[id(dead)] = now + delay
                self._notify(
                    f"{dead.name} exited with code {dead.returncode}; restarting in {delay:g} s "
                    f"(restart {n} of at most {policy.limit} in {policy.window_s:g} s)"
                )
            for i, p in enumerate(self.processes):
                if due.get(id(p), now + 1) <= now:
                    del due[id(p)]
                    self.processes[i] = ManagedProcess.start(p.spec, restarts=p.restarts + 1)
                    logger.info("%s restarted (pid %d)", p.name, self.processes[i].pid)
            self._reap_retired()
            if tick is not None:
                tick()
            wake = min(due.values(), default=now + self.poll_s)
            time.sleep(max(0.01, min(self.poll_s, wake - time.monotonic())))
        return None

    def retire(self, process: ManagedProcess, timeout_s: float) -> None:
        """Stop ``process`` on purpose without waiting: SIGTERM now (a worker drains: docs/
        reliability.md), SIGKILL if it still runs ``timeout_s`` later (checked by
        :meth:`watch`), and it leaves :attr:`processes` once it exited. Never restarted."""
        process.stopped = True
        if process.running:
            process.popen.send_signal(signal.SIGTERM)
        self._retiring[id(process)] = (process, time.monotonic() + timeout_s)

    def _reap_retired(self) -> None:
        now = time.monotonic()
        for key, (p, deadline) in list(self._retiring.items()):
            if p.running and now >= deadline:
                self._notify(f"{p.name} did not drain in time; killing it")
                p.popen.kill()
            if not p.running:
                del self._retiring[key]
                if p in self.processes:
                    self.processes.remove(p)

    def recent_restarts(self, name: str) -> int:
        """Restarts of process ``name`` within the last :meth:`watch` policy's window."""
        ledger = self._ledgers.get(name)
        return 0 if ledger is None else ledger.recent(time.monotonic())

    def stop(self) -> None:
        """Stop every process: by tier, highest first; SIGTERM in reverse start order, one
        grace period per tier, then SIGKILL. Idempotent."""
        for tier in sorted({p.tier for p in self.processes}, reverse=True):
            self._stop_tier([p for p in reversed(self.processes) if p.tier == tier])

    def _stop_tier(self, tier: list[ManagedProcess]) -> None:
        for p in tier:
            p.stopped = True
            if p.running:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in tier:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._notify(f"{p.name} did not stop in {self.grace_s:g} s; killing it")
                p.popen.kill()
                p.popen.wait()
