"""The chaos suite's tools: ``pdserve up`` as a subprocess, its children found through /proc,
a steady streaming load with known greedy output, the workers' KV pools read from /metrics, and
the fault table.

- :class:`UpStack`: ``python -m pdserve.cli up`` on the tiny model with N prefill + M decode
  workers and short timeouts (lease, registration TTL, request deadline, restart backoff) from
  a config file, children found by their command lines (``/proc/<pid>/task/*/children``,
  ``--worker-id prefill-0``). A role with one worker gets a fixed port; the workers of a role
  with several share the config file, so they pick their own (port 0), and each one's URL is
  read from its discovery record on etcd, checked against the ports its current process listens
  on (``/proc/<pid>/fd``, ``/proc/<pid>/net/tcp``), so a restarted worker's stale record is
  never used. Worker ``/metrics`` show the KV pools, the router's the migrations.
- :class:`Load`: ``lanes`` streaming completions in flight at all times (greedy, ``ignore_eos``),
  each outcome classified: ``ok`` (a complete stream whose text equals the prompt's solo greedy
  output), ``failed`` (an explicit error: HTTP status, in-band SSE error, refused or broken
  connection), ``hung`` (no end within the request deadline plus :data:`GRACE_S`),
  ``mismatched`` (a complete-looking stream with other text, or one cut off without an error).

The faults, their checks and the table: :mod:`tests.support.chaos_faults`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.discovery.etcd import PREFIX as ETCD_WORKERS
from tests.support.procfs import children, cmdline, listening_ports
from tests.support.servers import free_port, wait_until_sync

MODEL = "tiny-llama"
GRACE_S = 5.0
"""How long past its deadline a request may take before it counts as hung."""
KINDS = ("ok", "failed", "hung", "mismatched")
LANES = 8
"""Streams in flight at all times."""
MAX_TOKENS = 32
RECOVER_S = 40.0
"""A new request succeeds within this many seconds of the fault's end (a restart included)."""
QUIESCE_S = 15.0
"""After the load stops, the pools are clean within this (the 3 s lease and some)."""
FAIL_FAST_S = 3.0
"""Where failures are expected (the router killed, the control plane restarted): a request
sent after the fault ended fails within this."""
READY_S = 60.0
"""A restarted worker is ready (its /ready, the router's view) within this of its new pid."""


# --- pdserve up ---------------------------------------------------------------------------------


def process_name(argv: list[str]) -> str | None:
    """``router`` (or a replica's ``--router-name``) or the ``--worker-id`` of a pdserve
    child's argv, else None."""
    for flag in ("--worker-id", "--router-name"):
        if flag in argv[:-1]:
            return argv[argv.index(flag) + 1]
    if "pdserve.cli" in argv and "router" in argv[argv.index("pdserve.cli") :]:
        return "router"
    return None


@dataclass(frozen=True)
class Migrations:
    """The router's ``pdserve_router_migrations_total`` summed per leg (``prefill``,
    ``decode``) and its ``pdserve_router_migration_seconds`` count and sum (a migrated decode
    leg's failure to the new worker's first token)."""

    legs: Counter[str] = field(default_factory=Counter)
    timed: int = 0
    seconds: float = 0.0

    def since(self, before: Migrations) -> Migrations:
        """What was counted after ``before``; a router restarted since counts from zero, so
        then what it counted since its start."""
        if any(self.legs[k] < n for k, n in before.legs.items()) or self.timed < before.timed:
            return self
        return Migrations(self.legs - before.legs, self.timed - before.timed,
                          self.seconds - before.seconds)  # fmt: skip


def role_of(name: str) -> str:
    """``prefill`` of ``prefill-1``."""
    return name.rsplit("-", 1)[0]


@dataclass
class UpStack:
    """``pdserve up`` with ``prefill`` prefill and ``decode`` decode workers on the tiny model,
    named ``prefill-0..N-1`` and ``decode-0..M-1`` (module docstring for their URLs)."""

    model_dir: Path
    log_dir: Path
    discovery: str = "embedded"
    lease_s: float = 3.0
    ttl_s: float = 3.0
    request_timeout_s: float = 12.0
    prefill: int = 1
    decode: int = 1
    routers: int = 1
    """Router replicas (``--routers``), named ``router-<i>`` when more than one."""
    port: int = field(default_factory=free_port)
    worker_ports: dict[str, int] = field(default_factory=dict)
    """Worker name -> its fixed port: the only worker of its role (default: a free port)."""
    proc: subprocess.Popen[bytes] | None = None
    _found: dict[str, tuple[int, str]] = field(default_factory=dict, repr=False)
    """Worker name -> (pid, URL) found through its discovery record."""

    def __post_init__(self) -> None:
        counts = {"prefill": self.prefill, "decode": self.decode}
        for role, n in counts.items():
            if n == 1:
                self.worker_ports.setdefault(f"{role}-0", free_port())
        if any(n > 1 for n in counts.values()) and not self.discovery.startswith("etcd://"):
            raise ValueError("several workers of a role need etcd discovery (their URLs)")

    @property
    def names(self) -> list[str]:
        """Every worker's name, prefill first."""
        return [f"prefill-{i}" for i in range(self.prefill)] + [
            f"decode-{i}" for i in range(self.decode)
        ]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_dir / "up.log"

    def worker_url(self, name: str) -> str:
        """``name``'s request-plane URL now; LookupError while it has none (not running, not
        registered yet, or only its previous incarnation's record is there)."""
        if name in self.worker_ports:
            return f"http://127.0.0.1:{self.worker_ports[name]}"
        pid = self.pids().get(name)
        if pid is None:
            raise LookupError(f"{name} is not running")
        found = self._found.get(name)
        if found is not None and found[0] == pid:
            return found[1]
        record = self.records().get(name)
        if record is None:
            raise LookupError(f"{name} has no discovery record")
        url = str(record["http_url"])
        if urlsplit(url).port not in listening_ports(pid):
            raise LookupError(f"{name}'s record ({url}) is not its process {pid}'s")
        self._found[name] = (pid, url)
        return url

    def records(self) -> dict[str, dict[str, object]]:
        """Worker id -> its discovery record (JSON) on etcd now, read through etcd's JSON
        gateway; httpx.HTTPError when etcd does not answer."""
        gateway = "http://" + self.discovery.removeprefix("etcd://")
        prefix = ETCD_WORKERS.encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        body = {
            "key": base64.b64encode(prefix).decode(),
            "range_end": base64.b64encode(end).decode(),
        }
        r = httpx.post(f"{gateway}/v3/kv/range", json=body, timeout=2.0, trust_env=False)
        r.raise_for_status()
        out = {}
        for kv in r.json().get("kvs", []):
            record = json.loads(base64.b64decode(kv["value"]))
            out[str(record["worker_id"])] = record
        return out

    def start(self, timeout_s: float = 120.0) -> None:
        """Start ``up`` and wait for its ``ready`` line; AssertionError (with the log's end)
        when it exits or is not ready in time."""
        config = {
            "discovery": {"url": self.discovery, "registration_ttl_s": self.ttl_s},
            "kv_cache": {"lease_s": self.lease_s, "budget_mb": 16},
            # every request through the prefill -> decode hand-off, the path the faults hit
            "router": {"request_timeout_s": self.request_timeout_s, "local_prefill_max_tokens": 0},
            **{
                role: {"replicas": n, "port": self.worker_ports.get(f"{role}-0", 0)}
                for role, n in (("prefill", self.prefill), ("decode", self.decode))
            },
            "supervisor": {"restart_backoff_s": 0.2, "restart_backoff_max_s": 2.0},
            "transfer": {"timeout_s": 5.0},
        }
        file = self.log_dir / "up.yaml"
        file.write_text(yaml.safe_dump(config))
        argv = [
            sys.executable, "-m", "pdserve.cli", "--log-level", "info", "up",
            "--config", str(file), "--model", str(self.model_dir),
            "--served-model-name", MODEL, "--port", str(self.port), "--no-compile",
            "--routers", str(self.routers),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"pdserve up exited {self.proc.returncode}:\n{self.tail()}")
            return "pdserve: ready." in self.log.read_text(errors="replace")

        wait_until_sync(ready, timeout_s, interval_s=0.2, what=lambda: f"up ready:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def pids(self) -> dict[str, int]:
        """``router`` / worker id -> pid of up's children now."""
        assert self.proc is not None
        found = {}
        for pid in children(self.proc.pid):
            name = process_name(cmdline(pid))
            if name is not None:
                found[name] = pid
        return found

    def pid(self, name: str) -> int:
        pids = self.pids()
        assert name in pids, f"{name} is not running under up: {pids}\n{self.tail()}"
        return pids[name]

    def stop(self) -> None:
        """SIGTERM ``up`` (it stops its children) and wait; SIGKILL whatever is left."""
        if self.proc is None:
            return
        left = self.pids() if self.proc.poll() is None else {}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for name, pid in left.items():
            if cmdline(pid) and process_name(cmdline(pid)) == name:
                os.kill(pid, signal.SIGKILL)

    # -- state ----------------------------------------------------------------------------------

    def metrics(self, url: str) -> dict[str, float]:
        """``name{label="v"}`` -> value of one process's /metrics."""
        text = httpx.get(f"{url}/metrics", timeout=2.0, trust_env=False).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def pools(self) -> dict[str, dict[str, int]]:
        """Per worker: KV blocks ``free``, ``used``, ``parked`` requests (leases), ``total``;
        a worker that does not answer (or has no URL yet) is left out."""
        out = {}
        for name in self.names:
            try:
                m = self.metrics(self.worker_url(name))
            except (httpx.HTTPError, LookupError):
                continue
            state = {s: int(m.get(f'pdserve_kv_blocks{{state="{s}"}}', -1)) for s in
                     ("free", "used", "parked")}  # fmt: skip
            out[name] = {**state, "total": state["free"] + state["used"]}
        return out

    def quiet(self) -> bool:
        """Every worker answers and holds no used block and no parked request."""
        pools = self.pools()
        return len(pools) == len(self.names) and all(
            p["used"] == 0 and p["parked"] == 0 for p in pools.values()
        )

    def router_view(self) -> dict[str, list[str]]:
        """The router's ``/ready`` body (usable worker ids per role, 200 or 503); {} when it
        does not answer."""
        try:
            r = httpx.get(f"{self.url}/ready", timeout=2.0, trust_env=False)
            return dict(r.json())
        except (httpx.HTTPError, ValueError):
            return {}

    def worker_ready(self, name: str) -> bool:
        """``name``'s own ``/ready`` answers 200 and the router's view lists it."""
        try:
            r = httpx.get(f"{self.worker_url(name)}/ready", timeout=2.0, trust_env=False)
        except (httpx.HTTPError, LookupError):
            return False
        return r.status_code == 200 and name in self.router_view().get(role_of(name), [])

    def migrations(self) -> Migrations:
        """The router's migration counters now (zeros when it does not answer)."""
        try:
            m = self.metrics(self.url)
        except httpx.HTTPError:
            return Migrations()
        legs: Counter[str] = Counter()
        for key, value in m.items():
            if key.startswith("pdserve_router_migrations_total{"):
                legs[key.split('leg="', 1)[1].split('"', 1)[0]] += int(value)
        return Migrations(
            legs,
            int(m.get("pdserve_router_migration_seconds_count", 0)),
            m.get("pdserve_router_migration_seconds_sum", 0.0),
        )

    def serves(self, timeout_s: float = 5.0) -> bool:
        """One short completion succeeds now."""
        body = {"model": MODEL, "prompt": [72, 105], "max_tokens": 4, "temperature": 0}
        try:
            r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout_s,
                           trust_env=False)  # fmt: skip
        except httpx.HTTPError:
            return False
        return r.status_code == 200


# --- load ---------------------------------------------------------------------------------------


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of printable byte tokens (the tiny model's ids 32..126), 12-40 long."""
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randrange(12, 40))] for _ in range(n)]


@dataclass(frozen=True)
class Outcome:
    """One request of the load: its prompt's index, monotonic start and end, its kind
    (:data:`KINDS`) and, for a failure, what the client saw."""

    prompt: int
    start: float
    end: float
    kind: str
    detail: str = ""


CONNECT_RETRIES = 2
"""Retries of a request whose connection failed before any answer (``retries=True``): the
``openai`` client's default ``max_retries``."""
PRE_ANSWER_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError,
                     httpx.WriteError)  # fmt: skip
"""What a request whose connection was refused or reset before any answer raises."""


async def stream_one(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int, expected: str | None,
    deadline_s: float, index: int = 0, *, retries: bool = False,
) -> tuple[Outcome, str]:  # fmt: skip
    """One streamed greedy completion, classified (module docstring); also its text. With
    ``retries``, a connection refused or reset before the answer's status line is tried again
    up to :data:`CONNECT_RETRIES` times (as the ``openai`` client does), and a stream broken
    after it is ``failed`` with ``broken mid-stream: <error>``."""
    t0 = time.monotonic()
    for attempt in range(CONNECT_RETRIES + 1 if retries else 1):
        try:
            outcome, text = await _stream_once(client, prompt, max_tokens, expected, deadline_s,
                                               index, raise_pre_answer=retries)  # fmt: skip
        except PRE_ANSWER_ERRORS as exc:
            if attempt == CONNECT_RETRIES:
                return Outcome(index, t0, time.monotonic(), "failed", type(exc).__name__), ""
            await asyncio.sleep(0.05 * 2**attempt)
            continue
        return Outcome(index, t0, outcome.end, outcome.kind, outcome.detail), text
    raise AssertionError("unreachable")


async def _stream_once(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int, expected: str | None,
    deadline_s: float, index: int, *, raise_pre_answer: bool,
) -> tuple[Outcome, str]:  # fmt: skip
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0 = time.monotonic()
    parts: list[str] = []
    done, finish, error = False, None, None

    def out(kind: str, detail: str = "") -> tuple[Outcome, str]:
        end = time.monotonic()
        if kind != "hung" and end - t0 > deadline_s + GRACE_S:
            kind, detail = "hung", f"ended after {end - t0:.1f} s ({kind}: {detail})"
        return Outcome(index, t0, end, kind, detail), "".join(parts)

    answered = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            answered = True
            if r.status_code != 200:
                return out("failed", f"HTTP {r.status_code} {_code(await r.aread())}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                for choice in chunk.get("choices", []):
                    parts.append(choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
    except httpx.TimeoutException as exc:
        return out("hung", f"client timeout: {type(exc).__name__}")
    except httpx.HTTPError as exc:
        if raise_pre_answer and not answered and isinstance(exc, PRE_ANSWER_ERRORS):
            raise
        if raise_pre_answer and answered:
            return out("failed", f"broken mid-stream: {type(exc).__name__}")
        return out("failed", type(exc).__name__)
    if error is not None:
        return out("failed", f"SSE error {error.get('code')}")
    if not done or finish is None:
        return out("mismatched", f"stream cut off without an error (done={done}, finish={finish})")
    if expected is not None and "".join(parts) != expected:
        return out("mismatched", f"text differs from the solo greedy output: {''.join(parts)!r}")
    return out("ok")


def _code(body: bytes) -> str:
    """The OpenAI error body's ``code`` (or ``type``), else the body's start."""
    try:
        err = json.loads(body)["error"]
        return str(err.get("code") or err.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return repr(body[:80])


def client_for(url: str, lanes: int, deadline_s: float) -> httpx.AsyncClient:
    """A client for ``lanes`` streams whose read timeout is the deadline plus :data:`GRACE_S`."""
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(deadline_s + GRACE_S, connect=5.0),
        limits=httpx.Limits(max_connections=lanes + 2),
        trust_env=False,
    )


def solo_outputs(
    url: str, prompts: list[list[int]], max_tokens: int, deadline_s: float
) -> list[str]:
    """Each prompt's greedy output, one request at a time (the reference)."""

    async def main() -> list[str]:
        texts = []
        async with client_for(url, 1, deadline_s) as client:
            for i, p in enumerate(prompts):
                outcome, text = await stream_one(client, p, max_tokens, None, deadline_s, i)
                assert outcome.kind == "ok", outcome
                texts.append(text)
        return texts

    return asyncio.run(main())


class Load:
    """``lanes`` streams in flight at all times from a background thread, until :meth:`stop`;
    ``retries``: each request retries a connection refused or reset before its answer
    (:func:`stream_one`)."""

    def __init__(self, url: str, prompts: list[list[int]], expected: list[str], *,
                 max_tokens: int, deadline_s: float, lanes: int = 8,
                 retries: bool = False) -> None:  # fmt: skip
        self.url, self.prompts, self.expected = url, prompts, expected
        self.max_tokens, self.deadline_s, self.lanes = max_tokens, deadline_s, lanes
        self.retries = retries
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Start no new request; wait for those in flight (each ends by its deadline)."""
        self._stop.set()
        self._thread.join(self.deadline_s + 2 * GRACE_S)
        assert not self._thread.is_alive(), "the load did not stop"

    def count(self, kind: str = "ok", since: float = 0.0) -> int:
        return sum(1 for o in list(self.outcomes) if o.kind == kind and o.start >= since)

    def slowest_failure(self, since: float) -> float:
        """Seconds the slowest failed request sent at ``since`` or later took (0: none)."""
        slow = [o.end - o.start for o in self.outcomes if o.kind == "failed" and o.start >= since]
        return max(slow, default=0.0)

    def split_ok(self, start: float, end: float) -> tuple[list[float], list[float]]:
        """The end-to-end seconds of the successful requests: those in flight at some time
        between ``start`` and ``end`` (monotonic), and the others."""
        during: list[float] = []
        calm: list[float] = []
        for o in list(self.outcomes):
            if o.kind == "ok":
                (during if o.start <= end and o.end >= start else calm).append(o.end - o.start)
        return during, calm

    def failures(self) -> Counter[str]:
        """What the failed requests saw: ``HTTP 503 no_worker``, ``SSE error kv_...``,
        ``ConnectError``, ... -> count."""
        return Counter(o.detail for o in self.outcomes if o.kind == "failed")

    async def _main(self) -> None:
        async with client_for(self.url, self.lanes, self.deadline_s) as client:
            await asyncio.gather(*(self._lane(client, lane) for lane in range(self.lanes)))

    async def _lane(self, client: httpx.AsyncClient, lane: int) -> None:
        i = lane
        while not self._stop.is_set():
            k = i % len(self.prompts)
            outcome, _ = await stream_one(client, self.prompts[k], self.max_tokens,
                                          self.expected[k], self.deadline_s, k,
                                          retries=self.retries)  # fmt: skip
            self.outcomes.append(outcome)
            i += self.lanes
            if outcome.kind != "ok":
                await asyncio.sleep(0.25)  # pace retries of a failing service (not a wait)
