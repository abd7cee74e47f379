"""A discrete-event simulation of a pdserve deployment: the router, each worker's scheduler and
its steps, the KV hand-offs, driven by a workload and timed by a :class:`Profile`.

What it models, after the code it stands for:

- **Router** (:func:`pdserve.router.policy.choose_route`): a request whose prompt is at most
  ``local_prefill_max_tokens`` (or any request when there is no prefill worker) goes to the least
  loaded decode worker, which prefills it itself (conditional disaggregation); any other to the
  least loaded prefill worker, then, at its first token, to the least loaded decode worker.
  "Least loaded" is the router's own in-flight count per worker, ties to the lowest index.
  Every request costs ``router_s`` before it reaches a worker; a leg's answer reaches the client
  ``leg_s`` after the worker produced it.
- **Worker** (:class:`pdserve.workers.engine.scheduler.Scheduler`, continuous batching): FCFS
  admission up to ``max_num_seqs`` running; each step runs every decode sequence (one token
  each) and fills the rest of ``max_num_batched_tokens`` with prefill chunks, the partly
  prefilled sequences first; a sequence whose last prompt chunk ran samples its first token in
  that step. A new request waits for the step in flight to end. The step's time is
  :meth:`EngineProfile.step_s` of work, done at full speed unless the workers of a shared host
  in a step have more threads than it has cores: then they share the cores (processor
  sharing: each progresses at ``cores / busy threads``, re-planned whenever a step starts or
  ends).
- **Hand-off**: the prefill leg ends at the first token; the decode worker pulls the prompt's
  blocks (:meth:`Profile.handoff_s`, beside its steps: the transceiver has its own thread), then
  the sequence joins its queue as a decode sequence (the first token is fed back, no prefill).

Not modelled: KV pool capacity (admission never waits for blocks, nothing is preempted), the
prefix cache (every prompt is computed in full), speculative decoding, failures and migration.
Times are seconds from the start of the simulation.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.planner.profile import EngineProfile, Profile

JITTER = 0.05
"""Relative standard deviation of a step's time around the profile's (real steps vary by a few
per cent). Without it, requests that start together in a closed loop stay in lockstep forever,
prefilled in one step each round, which real servers drift out of within a few rounds."""


@dataclass(frozen=True)
class Deployment:
    """One candidate configuration. ``cores``: the cores of the one host every worker shares
    (each worker then gets ``max(1, cores // workers)`` threads, as ``pdserve up`` splits them,
    and steps run ``busy threads / cores`` times slower while the workers in a step together
    have more threads than the host has cores); None: each worker on hardware of its own, at
    the profile's most threads."""

    prefill: int
    decode: int
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    local_prefill_max_tokens: int = 256
    cores: int | None = None
    threads_per_worker: int | None = None
    """Threads each worker runs, when fixed beforehand (``up --autoscale`` sizes every worker
    for the maximum count); None: the host's share, or the profile's most without a host."""

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def threads(self, profile: Profile) -> int:
        """Threads per worker: :attr:`threads_per_worker`, else the host's share, else the
        profile's most."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        if self.cores is None:
            return profile.engines[-1].threads
        return max(1, self.cores // self.workers)

    def label(self) -> str:
        return (
            f"{self.prefill}P+{self.decode}D chunk {self.max_num_batched_tokens} "
            f"local<={self.local_prefill_max_tokens}"
        )


@dataclass(frozen=True)
class LengthDist:
    """Token counts drawn uniformly from ``low..high`` (inclusive; equal for a fixed length).
    Parsed from ``"N"`` or ``"LOW:HIGH"`` (:meth:`parse`; ValueError otherwise)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        lo, _, hi = str(text).partition(":")
        low, high = int(lo), int(hi or lo)
        if low < 1 or high < low:
            raise ValueError(f"token count {text!r}: give N or LOW:HIGH with 1 <= LOW <= HIGH")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class Workload:
    """``num_requests`` requests with prompt and output lengths from ``input_len`` and
    ``output_len``, arriving as a Poisson process of ``request_rate`` requests/s or, with
    ``concurrency``, as a closed loop keeping that many in flight (exactly one of the two)."""

    input_len: LengthDist
    output_len: LengthDist
    num_requests: int = 200
    request_rate: float | None = None
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.request_rate is None) == (self.concurrency is None):
            raise ValueError("a workload has a request rate or a concurrency, not both")


@dataclass
class SimRequest:
    """One simulated request; ``token_s`` the times its client sees each token."""

    rid: int
    arrival: float
    prompt: int
    output: int
    computed: int = 0
    generated: int = 0
    decoding: bool = False
    mode: str = "full"
    token_s: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_s[0] - self.arrival

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:], strict=False)]

    @property
    def e2e(self) -> float:
        return self.token_s[-1] - self.arrival


class _Worker:
    """One simulated engine (see the module docstring)."""

    def __init__(
        self, sim: Simulation, role: str, index: int, engine: EngineProfile, threads: int
    ) -> None:
        self.sim, self.role, self.index = sim, role, index
        self.engine, self.threads = engine, threads
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.in_flight = 0
        self.busy = False
        self.busy_s = 0.0
        self.remaining = 0.0  # work left of the step in flight, seconds at full speed
        self.token = 0  # bumped at each re-plan: older end events are stale
        self._step: tuple[float, list[SimRequest], list[tuple[SimRequest, int, int]]] | None = None

    def submit(self, req: SimRequest, mode: str) -> None:
        req.mode, req.computed = mode, req.prompt if mode == "resume" else 0
        req.decoding = mode == "resume"
        self.waiting.append(req)
        self.maybe_step()

    def maybe_step(self) -> None:
        """Start a step after whatever else happens at this instant (requests arriving together
        join the same step), unless one runs or nothing waits."""
        if self.busy or not (self.waiting or self.running):
            return
        self.busy = True
        self.sim.at(self.sim.now, self._start_step)

    def _start_step(self) -> None:
        d = self.sim.deployment
        while self.waiting and len(self.running) < d.max_num_seqs:
            self.running.append(self.waiting.popleft())
        rows = [r for r in self.running if r.decoding]
        budget = d.max_num_batched_tokens - len(rows)
        chunks: list[tuple[SimRequest, int, int]] = []
        for r in self.running:
            if r.decoding or budget <= 0:
                continue
            n = min(budget, r.prompt - r.computed)
            chunks.append((r, n, r.computed))
            budget -= n
        context = sum(r.prompt + r.generated for r in rows) / len(rows) if rows else 0.0
        work = self.engine.step_s([(n, c) for _, n, c in chunks], len(rows), context)
        if self.sim.jitter:
            work *= max(0.5, self.sim.noise.gauss(1.0, self.sim.jitter))
        self._step = (self.sim.now, rows, chunks)
        self.sim.step_started(self, work)

    def finish(self, token: int) -> None:
        """The step's end event; a stale one (the step was re-planned since) does nothing."""
        if token != self.token or self._step is None:
            return
        began, rows, chunks = self._step
        self._step = None
        self.busy_s += self.sim.now - began
        self.sim.step_ended(self)
        self._end_step(rows, chunks)

    def _end_step(self, rows: list[SimRequest], chunks: list[tuple[SimRequest, int, int]]) -> None:
        now = self.sim.now
        self.busy = False
        for r in rows:
            r.generated += 1
            r.token_s.append(now)
            if r.generated >= r.output:
                self._leave(r)
                self.sim.finished(r, self)
        for r, n, _ in chunks:
            r.computed += n
            if r.computed < r.prompt:
                continue
            r.generated, r.decoding = 1, True
            if r.mode == "prefill":  # the prefill leg ends at the first token
                self._leave(r)
                self.sim.prefilled(r, self)
                continue
            r.token_s.append(now)
            if r.generated >= r.output:
                self._leave(r)
                self.sim.finished(r, self)
        self.maybe_step()

    def _leave(self, r: SimRequest) -> None:
        self.running.remove(r)
        self.in_flight -= 1


class Simulation:
    """Run ``workload`` through ``deployment`` timed by ``profile``; :meth:`run` returns the
    finished requests. Raises ValueError for a deployment without a decode worker."""

    def __init__(
        self, profile: Profile, deployment: Deployment, workload: Workload, jitter: float = JITTER
    ) -> None:
        if deployment.decode < 1:
            raise ValueError("a deployment needs at least one decode worker")
        self.profile, self.deployment, self.workload = profile, deployment, workload
        threads = deployment.threads(profile)
        engine = profile.engine(threads)
        self.jitter = jitter
        self.noise = random.Random(workload.seed + 1)
        self._stepping: list[_Worker] = []  # workers in a step, sharing the host's cores
        self._since = 0.0
        self._factor = 1.0
        self.prefill = [
            _Worker(self, "prefill", i, engine, threads) for i in range(deployment.prefill)
        ]
        self.decode = [
            _Worker(self, "decode", i, engine, threads) for i in range(deployment.decode)
        ]
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.done: list[SimRequest] = []
        rng = random.Random(workload.seed)
        self._todo = deque(
            SimRequest(i, 0.0, workload.input_len.draw(rng), workload.output_len.draw(rng))
            for i in range(workload.num_requests)
        )
        self._rng = rng

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    # --- processor sharing of one host's cores -------------------------------------------------

    def _advance(self) -> None:
        """Take the work done since the last change off every step in flight."""
        done = (self.now - self._since) / self._factor
        for w in self._stepping:
            w.remaining = max(0.0, w.remaining - done)
        self._since = self.now

    def _replan(self) -> None:
        cores = self.deployment.cores
        threads = sum(w.threads for w in self._stepping)
        self._factor = max(1.0, threads / cores) if cores else 1.0
        for w in self._stepping:
            w.token += 1
            self.at(self.now + w.remaining * self._factor, lambda w=w, t=w.token: w.finish(t))  # type: ignore[misc]

    def step_started(self, worker: _Worker, work: float) -> None:
        """``worker`` starts a step of ``work`` seconds at full speed; every step in flight is
        re-planned at the new sharing factor."""
        self._advance()
        worker.remaining = work
        self._stepping.append(worker)
        self._replan()

    def step_ended(self, worker: _Worker) -> None:
        self._advance()
        self._stepping.remove(worker)
        self._replan()

    @staticmethod
    def _least_loaded(workers: Sequence[_Worker]) -> _Worker:
        return min(workers, key=lambda w: (w.in_flight, w.index))

    def _arrive(self, req: SimRequest) -> None:
        req.arrival = self.now
        self.at(self.now + self.profile.router_s, lambda: self._route(req))

    def _route(self, req: SimRequest) -> None:
        local = req.prompt <= self.deployment.local_prefill_max_tokens or not self.prefill
        pool = self.decode if local else self.prefill
        worker = self._least_loaded(pool)
        worker.in_flight += 1
        worker.submit(req, "full" if local else "prefill")

    def prefilled(self, req: SimRequest, worker: _Worker) -> None:
        """The prefill leg's first token: to the client after a leg; the decode leg opens."""
        req.token_s.append(self.now + self.profile.leg_s)
        if req.output <= 1:
            self.finished(req, worker)
            return
        d = self._least_loaded(self.decode)
        d.in_flight += 1
        ready = self.now + self.profile.leg_s + self.profile.handoff_s(req.prompt)
        self.at(ready, lambda: d.submit(req, "resume"))

    def finished(self, req: SimRequest, worker: _Worker) -> None:
        self.done.append(req)
        if self.workload.concurrency is not None and self._todo:
            self._arrive(self._todo.popleft())

    def run(self) -> list[SimRequest]:
        """Simulate to the last request's end; returns the requests in finishing order."""
        w = self.workload
        if w.concurrency is not None:
            for _ in range(min(w.concurrency, len(self._todo))):
                self._arrive(self._todo.popleft())
        else:
            rate = float(w.request_rate or 1.0)
            t = 0.0
            while self._todo:
                req = self._todo.popleft()
                self.at(t, lambda r=req: self._arrive(r))  # type: ignore[misc]
                t += self._rng.expovariate(rate)
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return self.done

    def utilization(self) -> dict[str, float]:
        """Busy share of the simulated time per role (mean over its workers)."""
        span = self.now or 1.0
        return {
            role: sum(x.busy_s for x in ws) / (span * len(ws))
            for role, ws in (("prefill", self.prefill), ("decode", self.decode))
            if ws
        }


def _pct(values: Sequence[float], q: float) -> float | None:
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(done: Sequence[SimRequest], slo: Any | None = None) -> dict[str, Any]:
    """The figures ``pdserve bench serve`` reports, predicted: TTFT/ITL/TPOT/E2E p50 and p90
    (ms), output tokens/s and requests/s over the span from the first arrival to the last end,
    and with ``slo`` (:class:`pdserve.bench.serving.bench_serve.Slo`-like: ``ttft_s``, ``tpot_s``,
    ``itl_s``) goodput: the share and rate of requests meeting every target."""
    if not done:
        return {"requests": 0}
    start = min(r.arrival for r in done)
    span = max(r.token_s[-1] for r in done) - start
    itl = [g for r in done for g in r.itl]
    tpot = [(r.e2e - r.ttft) / (len(r.token_s) - 1) for r in done if len(r.token_s) > 1]

    def ms(values: Sequence[float]) -> dict[str, float | None]:
        return {f"p{q}": None if (v := _pct(values, q)) is None else v * 1e3 for q in (50, 90)}

    out: dict[str, Any] = {
        "requests": len(done),
        "span_s": span,
        "output_tokens_per_s": sum(len(r.token_s) for r in done) / span if span else None,
        "requests_per_s": len(done) / span if span else None,
        "ttft_ms": ms([r.ttft for r in done]),
        "itl_ms": ms(itl),
        "tpot_ms": ms(tpot),
        "e2e_ms": ms([r.e2e for r in done]),
    }
    if slo is not None:
        good = sum(_meets(r, slo) for r in done)
        out["goodput"] = {
            "good": good,
            "fraction": good / len(done),
            "requests_per_s": good / span if span else None,
        }
    return out


def _meets(r: SimRequest, slo: Any) -> bool:
    if slo.ttft_s is not None and r.ttft > slo.ttft_s:
        return False
    n = len(r.token_s)
    if slo.tpot_s is not None and n > 1 and (r.e2e - r.ttft) / (n - 1) > slo.tpot_s:
        return False
    itl90 = _pct(r.itl, 90)
    return slo.itl_s is None or itl90 is None or itl90 <= slo.itl_s


def simulate(
    profile: Profile,
    deployment: Deployment,
    workload: Workload,
    slo: Any | None = None,
    jitter: float = JITTER,
) -> dict[str, Any]:
    """One simulation's :func:`summarize` plus ``utilization`` per role."""
    sim = Simulation(profile, deployment, workload, jitter)
    out = summarize(sim.run(), slo)
    out["utilization"] = sim.utilization()
    return out
