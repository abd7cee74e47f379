"""SLO-driven autoscaling: every interval, observe the router's metrics, decide how many prefill
and decode workers the deployment should have, log why, export it, and let an actuator act.

:class:`Planner` decides (pure logic, fed :class:`~pdserve.planner.observe.Observation`):

1. **Prediction** (with a profile): the observed workload (mean prompt and output length; the
   arrival rate as Poisson arrivals, and the requests in flight as a closed loop, the larger
   answer kept) runs through the simulation (:mod:`pdserve.planner.simulate`) for every
   worker count within the bounds; the fewest workers whose predicted share of requests
   meeting both SLOs reaches ``attainment`` win (:func:`pdserve.planner.plan.recommend`), as
   Dynamo's SLA planner and DistServe size prefill and decode separately. No traffic at all: the
   minimum.
2. **Reaction**: an observed TTFT p90 above its SLO adds a prefill worker (a decode worker
   while no prefill worker may be added), an observed ITL p90 above its SLO a decode worker,
   where the prediction asked for no more workers: the model can be wrong, the measurement is
   not (where the prediction does add workers, its choice of roles stands).
   Without a profile this rule and its converse (both p90s under half their SLO: one worker
   fewer, decode first) are the whole policy. Both need a window of at least
   :data:`MIN_REACTION_REQUESTS` finished requests.
3. **Hysteresis**: more workers are asked for at once; fewer only after
   ``scale_down_intervals`` decisions in a row asked for fewer, and then one worker at a time,
   so that a dip does not drain a worker the next burst needs (each drain moves its KV and
   running sequences away: docs/reliability.md). After any change the counts hold for
   ``cooldown_s`` (Kubernetes' HPA and KEDA have the same stabilization): a starting worker
   loads its model, a draining one migrates its streams, and the windows in between measure
   neither the old deployment nor the new one.

:class:`AutoscaleLoop` runs the planner on a thread of its own against a metrics source and
hands each target to an actuator: ``pdserve up --autoscale`` starts and drains its own workers
(:mod:`pdserve.launch.launcher`); ``pdserve planner`` only exports
``pdserve_planner_desired_workers{role}`` for KEDA or an HPA to scale the Deployments.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.planner.observe import (
    MAX_METRICS_BYTES,
    Observation,
    Snapshot,
    merge_snapshots,
    observe,
    parse_metrics,
)
from pdserve.planner.plan import Targets, candidates, evaluate, recommend
from pdserve.planner.simulate import LengthDist, Workload

if TYPE_CHECKING:
    from pdserve.config.planner_settings import PlannerSettings
    from pdserve.config.settings import PdserveConfig
    from pdserve.planner.profile import Profile

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
MIN_REACTION_REQUESTS = 5
"""A window needs this many finished requests before its p90s may add a worker (with fewer, a
"p90" is one request's latency)."""


@dataclass(frozen=True)
class Decision:
    """Workers wanted per role and why (one line per rule that spoke)."""

    target: dict[str, int]
    reasons: list[str]
    predicted: dict[str, Any] | None = None

    def line(self, current: dict[str, int]) -> str:
        now = "+".join(f"{current.get(r, 0)}{r[0].upper()}" for r in ROLES)
        want = "+".join(f"{self.target[r]}{r[0].upper()}" for r in ROLES)
        verb = "keep" if now == want else f"scale {now} -> {want}"
        return f"planner: {verb}: " + "; ".join(self.reasons)


@dataclass
class Planner:
    """The decision rules of the module docstring. ``profile`` None: reaction only.
    ``chunk`` and ``local_prefill_max_tokens`` are the deployment's scheduler and router
    settings; ``cores``: the one host all workers share (``pdserve up``), None for workers on
    hardware of their own; ``threads_per_worker``: the threads each worker was given (``up``
    sizes them for the maximum count). ``sim_requests`` bounds the simulated requests per
    candidate."""

    settings: PlannerSettings
    profile: Profile | None = None
    chunk: int = 512
    local_prefill_max_tokens: int = 256
    max_num_seqs: int = 32
    cores: int | None = None
    threads_per_worker: int | None = None
    sim_requests: int = 200
    _fewer: int = field(default=0, init=False)
    _hold: int = field(default=0, init=False)

    @classmethod
    def for_config(
        cls,
        cfg: PdserveConfig,
        profile: Profile | None,
        *,
        cores: int | None,
        threads_per_worker: int | None = None,
    ) -> Planner:
        """The planner of a deployment configured by ``cfg`` (its ``planner`` section, the
        scheduler's step budget and sequence bound, the router's local-prefill threshold)."""
        return cls(
            cfg.planner,
            profile,
            chunk=cfg.scheduler.max_num_batched_tokens,
            local_prefill_max_tokens=cfg.router.local_prefill_max_tokens,
            max_num_seqs=cfg.scheduler.max_num_seqs,
            cores=cores,
            threads_per_worker=threads_per_worker,
        )

    @property
    def targets(self) -> Targets:
        s = self.settings
        return Targets(
            ttft_s=s.ttft_slo_ms / 1e3, itl_s=s.itl_slo_ms / 1e3, attainment=s.attainment
        )

    def bounds(self, role: str) -> tuple[int, int]:
        s = self.settings
        return (s.min_prefill, s.max_prefill) if role == "prefill" else (s.min_decode, s.max_decode)

    def _clamp(self, counts: dict[str, int]) -> dict[str, int]:
        return {r: min(max(counts.get(r, 0), self.bounds(r)[0]), self.bounds(r)[1]) for r in ROLES}

    def _best(self, profile: Profile, workload: Workload) -> tuple[dict[str, Any], bool]:
        (pmin, pmax), (dmin, dmax) = self.bounds("prefill"), self.bounds("decode")
        deps = candidates(
            range(pmin, pmax + 1),
            range(dmin, dmax + 1),
            [self.chunk],
            [self.local_prefill_max_tokens],
            max_num_seqs=self.max_num_seqs,
            cores=self.cores,
            threads_per_worker=self.threads_per_worker,
        )
        rows = evaluate(profile, deps, workload, self.targets)
        best, ok = recommend(rows, self.targets)
        if not ok:  # overloaded whatever the count: the most capacity, not the best per worker
            best = max(rows, key=lambda r: (r["goodput"]["fraction"], -(r["ttft_ms"]["p90"] or 0)))
        return best, ok

    def _predict(self, obs: Observation) -> tuple[dict[str, int], str, dict[str, Any]] | None:
        """The prediction for the window's demand, seen two ways, the larger answer kept: its
        arrival rate as Poisson arrivals (users that do not wait for each other), and the
        requests in flight as a closed loop (clients that send the next request when one
        ends: an overloaded deployment slows their arrivals down, so the rate alone would
        under-read them)."""
        if self.profile is None or not obs.mean_prompt or not obs.mean_output:
            return None
        prompt = LengthDist.parse(str(max(1, round(obs.mean_prompt))))
        output = LengthDist.parse(str(max(1, round(obs.mean_output))))
        n = int(min(self.sim_requests, max(30, obs.request_rate * 60)))
        views = []
        if obs.request_rate > 0:
            poisson = Workload(prompt, output, n, request_rate=obs.request_rate)
            views.append((f"{obs.request_rate:.2f} req/s", poisson))
        if round(obs.running) >= 1:
            c = round(obs.running)
            views.append((f"{c} in flight", Workload(prompt, output, max(n, 4 * c), concurrency=c)))
        if not views:
            return None
        answers = [(what, *self._best(self.profile, w)) for what, w in views]
        what, best, ok = max(answers, key=lambda a: (a[1]["workers"], a[1]["deployment"]["decode"]))
        dep = best["deployment"]
        why = (
            f"model: {what} of ~{obs.mean_prompt:.0f}+{obs.mean_output:.0f} tokens -> "
            f"{dep['prefill']}P+{dep['decode']}D predicted "
            f"{100 * best['goodput']['fraction']:.0f} % within SLO"
            + ("" if ok else " (best reachable, below the attainment target)")
        )
        return {"prefill": dep["prefill"], "decode": dep["decode"]}, why, best

    def decide(self, obs: Observation, current: dict[str, int]) -> Decision:
        """The target for the window ``obs`` given the ``current`` worker counts."""
        s = self.settings
        now = self._clamp(current)
        if self._hold > 0:
            self._hold -= 1
            return Decision(now, [f"cooling down after a change ({self._hold + 1} window(s) left)"])
        reasons: list[str] = []
        predicted = None
        idle = obs.request_rate == 0 and obs.running == 0
        if idle:
            want = {r: self.bounds(r)[0] for r in ROLES}
            reasons.append("idle: no request arrived or ran")
        elif (p := self._predict(obs)) is not None:
            want, why, predicted = p
            reasons.append(why)
        else:
            want = dict(now)
            calm = [
                v is not None and v < 0.5 * slo
                for v, slo in (
                    (obs.ttft_p90, s.ttft_slo_ms / 1e3),
                    (obs.itl_p90, s.itl_slo_ms / 1e3),
                )
            ]
            if self.profile is None and all(calm) and obs.finished >= MIN_REACTION_REQUESTS:
                role = "decode" if now["decode"] > self.bounds("decode")[0] else "prefill"
                want[role] -= 1
                reasons.append("TTFT and ITL p90 under half their SLOs")
        # the prediction already adds workers: it chose the roles; else a miss adds one (in a
        # window with enough requests to have a p90)
        growing = any(want[r] > now[r] for r in ROLES) or obs.finished < MIN_REACTION_REQUESTS
        if obs.ttft_p90 is not None and obs.ttft_p90 > s.ttft_slo_ms / 1e3 and not growing:
            role = "prefill" if now["prefill"] < self.bounds("prefill")[1] else "decode"
            want[role] = max(want[role], now[role] + 1)
            reasons.append(
                f"observed TTFT p90 {1e3 * obs.ttft_p90:.0f} ms > SLO {s.ttft_slo_ms:g} ms"
            )
        if obs.itl_p90 is not None and obs.itl_p90 > s.itl_slo_ms / 1e3 and not growing:
            want["decode"] = max(want["decode"], now["decode"] + 1)
            reasons.append(f"observed ITL p90 {1e3 * obs.itl_p90:.0f} ms > SLO {s.itl_slo_ms:g} ms")
        want = self._clamp(want)
        target = {r: max(want[r], now[r]) for r in ROLES}  # up at once
        if any(want[r] < now[r] for r in ROLES) and target == now:
            self._fewer += 1
            if self._fewer >= s.scale_down_intervals:
                role = max(ROLES, key=lambda r: (now[r] - want[r], r == "decode"))
                target[role] -= 1
                self._fewer = 0
                reasons.append(
                    f"fewer asked for {s.scale_down_intervals} intervals in a row: "
                    f"draining one {role} worker"
                )
            else:
                reasons.append(
                    f"fewer asked for ({self._fewer} of {s.scale_down_intervals} "
                    "intervals before a drain)"
                )
        else:
            self._fewer = 0
        if not reasons:
            reasons.append("within SLO")
        if target != now:
            self._hold = math.ceil(s.cooldown_s / s.interval_s)
        return Decision(target, reasons, predicted)


class PlannerMetrics:
    """The planner's own metrics, in a registry of their own (served on ``planner.port``):
    ``pdserve_planner_desired_workers{role}``, ``pdserve_planner_decisions_total{role,
    direction}`` (up, down), ``pdserve_planner_observed_request_rate``,
    ``pdserve_planner_observed_ttft_p90_seconds``, ``pdserve_planner_observed_itl_p90_seconds``,
    ``pdserve_planner_predicted_goodput_ratio`` (the chosen count's predicted share of requests
    within SLO; -1 without a prediction)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge(
            "pdserve_planner_desired_workers", "workers the planner wants", ["role"], registry=r
        )
        self.decisions = Counter(
            "pdserve_planner_decisions",
            "scaling decisions by direction",
            ["role", "direction"],
            registry=r,
        )
        self.rate = Gauge(
            "pdserve_planner_observed_request_rate",
            "requests/s arriving in the last interval",
            registry=r,
        )
        self.ttft = Gauge(
            "pdserve_planner_observed_ttft_p90_seconds", "TTFT p90 of the last interval", registry=r
        )
        self.itl = Gauge(
            "pdserve_planner_observed_itl_p90_seconds", "ITL p90 of the last interval", registry=r
        )
        self.goodput = Gauge(
            "pdserve_planner_predicted_goodput_ratio",
            "predicted share of requests within SLO",
            registry=r,
        )

    def record(self, obs: Observation, decision: Decision, current: dict[str, int]) -> None:
        for role in ROLES:
            self.desired.labels(role=role).set(decision.target[role])
            if decision.target[role] != current.get(role, 0):
                up = decision.target[role] > current.get(role, 0)
                self.decisions.labels(role=role, direction="up" if up else "down").inc()
        self.rate.set(obs.request_rate)
        self.ttft.set(obs.ttft_p90 if obs.ttft_p90 is not None else 0.0)
        self.itl.set(obs.itl_p90 if obs.itl_p90 is not None else 0.0)
        frac = decision.predicted["goodput"]["fraction"] if decision.predicted else -1.0
        self.goodput.set(frac)


def router_metrics_fetcher(url: str, timeout_s: float = 5.0) -> Callable[[], list[str]]:
    """A fetch function for :class:`AutoscaleLoop`: ``GET /metrics`` of every address the
    router URL's host name resolves to (a Kubernetes headless Service: every router replica,
    whose counters the planner sums; a plain host: the one router). It raises OSError when the
    name does not resolve, httpx.HTTPError when no router answers 200, ValueError for an answer
    over :data:`~pdserve.planner.observe.MAX_METRICS_BYTES`."""
    import socket
    from urllib.parse import urlsplit

    import httpx

    parts = urlsplit(url.rstrip("/"))
    host, port = (
        parts.hostname or "127.0.0.1",
        parts.port or (443 if parts.scheme == "https" else 80),
    )
    client = httpx.Client(timeout=timeout_s)

    def one(address: str) -> str:
        netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        target = f"{parts.scheme}://{netloc}{parts.path}/metrics"
        with client.stream("GET", target, headers={"Host": parts.netloc}) as r:
            r.raise_for_status()
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > MAX_METRICS_BYTES:
                    raise ValueError(f"{target}: /metrics passed {MAX_METRICS_BYTES} bytes")
        return body.decode()

    def fetch() -> list[str]:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = sorted({str(info[4][0]) for info in infos})
        texts, errors = [], []
        for address in addresses:
            try:
                texts.append(one(address))
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"{address}: {type(exc).__name__}: {exc}")
        if not texts:
            raise httpx.HTTPError("; ".join(errors) or f"{host} resolves to no address")
        if errors:
            logger.warning("planner: routers that did not answer: %s", "; ".join(errors))
        return texts

    return fetch


class AutoscaleLoop:
    """Every ``planner.settings.interval_s``: ``fetch()`` the routers' metrics (one text per
    router, summed: :func:`~pdserve.planner.observe.merge_snapshots`), observe the
    window since the last sample, decide, log the decision at info (at debug when it keeps
    the counts), record :class:`PlannerMetrics`, and call ``act(target)``. ``current()`` gives
    the worker counts the decision starts from. A failed fetch is logged and skipped (the next
    window then spans both intervals). :meth:`start` runs it on a daemon thread; :meth:`step`
    is one round (the tests drive it)."""

    def __init__(
        self,
        planner: Planner,
        fetch: Callable[[], list[str]],
        current: Callable[[], dict[str, int]],
        act: Callable[[dict[str, int]], None],
        metrics: PlannerMetrics | None = None,
    ) -> None:
        self.planner, self.fetch, self.current, self.act = planner, fetch, current, act
        self.metrics = metrics or PlannerMetrics()
        self.last: Snapshot | None = None
        self.decisions: list[Decision] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> Decision | None:
        """One round; the decision, or None on the first sample or a failed fetch."""
        try:
            snap = merge_snapshots([parse_metrics(text) for text in self.fetch()])
        except Exception as exc:  # noqa: BLE001 - any failure of the source skips a round
            logger.warning(
                "planner: cannot read the router's metrics: %s: %s", type(exc).__name__, exc
            )
            return None
        before, self.last = self.last, snap
        if before is None:
            return None
        obs = observe(before, snap)
        current = self.current()
        decision = self.planner.decide(obs, current)
        self.decisions.append(decision)
        del self.decisions[:-100]
        changed = decision.target != {r: current.get(r, 0) for r in ROLES}
        logger.log(logging.INFO if changed else logging.DEBUG, "%s", decision.line(current))
        self.metrics.record(obs, decision, current)
        self.act(decision.target)
        return decision

    def start(self) -> None:
        def run() -> None:
            self.step()
            while not self._stop.wait(self.planner.settings.interval_s):
                self.step()

        self._thread = threading.Thread(target=run, name="pdserve-planner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
