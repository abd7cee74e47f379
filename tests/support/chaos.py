"""The chaos suite's tools: ``pdserve up`` as a subprocess, its children found through /proc,
a steady streaming load with known greedy output, the workers' KV pools read from /metrics, and
the fault table.

- :class:`UpStack`: ``python -m pdserve.cli up`` on the tiny model with short timeouts (lease,
  registration TTL, request deadline, restart backoff) from a config file, fixed worker ports
  (their ``/metrics`` show the KV pools), children found by their command lines
  (``/proc/<pid>/task/*/children``, ``--worker-id prefill-0``).
- :class:`Load`: ``lanes`` streaming completions in flight at all times (greedy, ``ignore_eos``),
  each outcome classified: ``ok`` (a complete stream whose text equals the prompt's solo greedy
  output), ``failed`` (an explicit error: HTTP status, in-band SSE error, refused or broken
  connection), ``hung`` (no end within the request deadline plus :data:`GRACE_S`),
  ``mismatched`` (a complete-looking stream with other text, or one cut off without an error).
- :class:`Row` / :func:`table`: one line per fault.
"""

from __future__ import annotations

import asyncio
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

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import free_port, wait_until_sync

MODEL = "tiny-llama"
GRACE_S = 5.0
"""How long past its deadline a request may take before it counts as hung."""
KINDS = ("ok", "failed", "hung", "mismatched")


# --- pdserve up ---------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The child pids of ``pid`` (every thread's), [] when it is gone."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return out


def cmdline(pid: int) -> list[str]:
    """The argv of ``pid`` ([] when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def process_name(argv: list[str]) -> str | None:
    """``router`` or the ``--worker-id`` of a pdserve child's argv, else None."""
    if "--worker-id" in argv[:-1]:
        return argv[argv.index("--worker-id") + 1]
    if "pdserve.cli" in argv and "router" in argv[argv.index("pdserve.cli") :]:
        return "router"
    return None


@dataclass
class UpStack:
    """``pdserve up`` with one prefill and one decode worker on the tiny model."""

    model_dir: Path
    log_dir: Path
    discovery: str = "embedded"
    lease_s: float = 3.0
    ttl_s: float = 3.0
    request_timeout_s: float = 12.0
    port: int = field(default_factory=free_port)
    worker_ports: dict[str, int] = field(
        default_factory=lambda: {"prefill-0": free_port(), "decode-0": free_port()}
    )
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.log_dir / "up.log"

    def worker_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.worker_ports[name]}"

    def start(self, timeout_s: float = 120.0) -> None:
        """Start ``up`` and wait for its ``ready`` line; AssertionError (with the log's end)
        when it exits or is not ready in time."""
        config = {
            "discovery": {"url": self.discovery, "registration_ttl_s": self.ttl_s},
            "kv_cache": {"lease_s": self.lease_s, "budget_mb": 16},
            # every request through the prefill -> decode hand-off, the path the faults hit
            "router": {"request_timeout_s": self.request_timeout_s, "local_prefill_max_tokens": 0},
            "prefill": {"port": self.worker_ports["prefill-0"]},
            "decode": {"port": self.worker_ports["decode-0"]},
            "supervisor": {"restart_backoff_s": 0.2, "restart_backoff_max_s": 2.0},
            "transfer": {"timeout_s": 5.0},
        }
        file = self.log_dir / "up.yaml"
        file.write_text(yaml.safe_dump(config))
        argv = [
            sys.executable, "-m", "pdserve.cli", "--log-level", "info", "up",
            "--config", str(file), "--model", str(self.model_dir),
            "--served-model-name", MODEL, "--port", str(self.port), "--no-compile",
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
        a worker that does not answer is left out."""
        out = {}
        for name in self.worker_ports:
            try:
                m = self.metrics(self.worker_url(name))
            except httpx.HTTPError:
                continue
            state = {s: int(m.get(f'pdserve_kv_blocks{{state="{s}"}}', -1)) for s in
                     ("free", "used", "parked")}  # fmt: skip
            out[name] = {**state, "total": state["free"] + state["used"]}
        return out

    def quiet(self) -> bool:
        """Every worker answers and holds no used block and no parked request."""
        pools = self.pools()
        return len(pools) == len(self.worker_ports) and all(
            p["used"] == 0 and p["parked"] == 0 for p in pools.values()
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


async def stream_one(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int, expected: str | None,
    deadline_s: float, index: int = 0,
) -> tuple[Outcome, str]:  # fmt: skip
    """One streamed greedy completion, classified (module docstring); also its text."""
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

    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
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
    """``lanes`` streams in flight at all times from a background thread, until :meth:`stop`."""

    def __init__(self, url: str, prompts: list[list[int]], expected: list[str], *,
                 max_tokens: int, deadline_s: float, lanes: int = 8) -> None:  # fmt: skip
        self.url, self.prompts, self.expected = url, prompts, expected
        self.max_tokens, self.deadline_s, self.lanes = max_tokens, deadline_s, lanes
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
                                          self.expected[k], self.deadline_s, k)  # fmt: skip
            self.outcomes.append(outcome)
            i += self.lanes
            if outcome.kind != "ok":
                await asyncio.sleep(0.25)  # pace retries of a failing service (not a wait)


# --- the table ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One fault's line of the table: outcomes by kind, KV blocks still used after the quiesce
    wait, seconds to the first successful request after the fault's end."""

    fault: str
    counts: Counter[str]
    leaked: int
    recover_s: float
    gap_fail_s: float = 0.0
    """The slowest failure among the requests sent after the fault ended (the gap)."""
    failures: Counter[str] = field(default_factory=Counter)

    def seen(self) -> str:
        """The explicit failures, most common first: ``HTTP 503 no_worker x12, ...``."""
        return ", ".join(f"{what} x{n}" for what, n in self.failures.most_common()) or "-"

    def line(self) -> str:
        c = self.counts
        return (f"| {self.fault:<34} | {c['ok']:>4} | {c['failed']:>6} | {c['hung']:>4} | "
                f"{c['mismatched']:>10} | {self.leaked:>13} | {self.recover_s:>9.1f} | "
                f"{self.gap_fail_s:>13.2f} |")  # fmt: skip


HEADER = (
    "| fault                              |   ok | failed | hung | mismatched | blocks leaked |"
    " recover s | gap failure s |\n|------------------------------------|-----:|-------:|-----:|"
    "-----------:|--------------:|----------:|--------------:|"
)


def table(rows: list[Row]) -> str:
    """The fault table, then what each fault's failed requests saw."""
    seen = [f"- {r.fault}: {r.seen()}" for r in rows]
    return "\n".join([HEADER, *(r.line() for r in rows), "", "failed requests saw:", *seen])
