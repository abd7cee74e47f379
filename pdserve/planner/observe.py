"""What the planner sees of a live deployment: the router's Prometheus metrics (``GET
/metrics``, :mod:`pdserve.router.router_metrics`; of every router replica, summed), sampled twice and
turned into the workload and the latencies of the window between (:class:`Observation`), as a
Prometheus ``rate()`` would.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

MAX_METRICS_BYTES = 8 * 2**20
"""A /metrics answer longer than this is refused (the router's is a few tens of KiB)."""


@dataclass
class Snapshot:
    """One sample of the router's metrics: counter totals, the running gauge, the cumulative
    bucket counts of the TTFT and ITL histograms (``{upper bound s: count}``) and the usable
    workers per role; ``at`` is ``time.monotonic()``."""

    at: float
    finished: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    running: float = 0.0
    ttft: dict[float, float] = field(default_factory=dict)
    itl: dict[float, float] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)


def parse_metrics(text: str, at: float | None = None) -> Snapshot:
    """A :class:`Snapshot` of a router's ``/metrics`` text. Raises ValueError for text that is
    not the Prometheus exposition format."""
    snap = Snapshot(time.monotonic() if at is None else at)
    hist = {
        "pdserve_time_to_first_token_seconds": snap.ttft,
        "pdserve_inter_token_latency_seconds": snap.itl,
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve_requests_total":
                snap.finished += s.value
            elif s.name == "pdserve_prompt_tokens_total":
                snap.prompt_tokens = s.value
            elif s.name == "pdserve_generation_tokens_total":
                snap.generation_tokens = s.value
            elif s.name == "pdserve_requests_running":
                snap.running = s.value
            elif s.name == "pdserve_workers":
                snap.workers[s.labels.get("role", "")] = int(s.value)
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in hist:
                hist[s.name[: -len("_bucket")]][float(s.labels["le"])] = s.value
    return snap


def merge_snapshots(snaps: list[Snapshot]) -> Snapshot:
    """One snapshot of several routers serving the same workers: counters, the running gauge
    and histogram buckets summed; the workers per role the most any router sees. Raises
    ValueError for no snapshot."""
    if not snaps:
        raise ValueError("no router answered")
    out = Snapshot(max(s.at for s in snaps))
    for s in snaps:
        out.finished += s.finished
        out.prompt_tokens += s.prompt_tokens
        out.generation_tokens += s.generation_tokens
        out.running += s.running
        for mine, theirs in ((out.ttft, s.ttft), (out.itl, s.itl)):
            for bound, count in theirs.items():
                mine[bound] = mine.get(bound, 0.0) + count
        for role, n in s.workers.items():
            out.workers[role] = max(out.workers.get(role, 0), n)
    return out


def histogram_quantile(
    q: float, before: Mapping[float, float], after: Mapping[float, float]
) -> float | None:
    """The ``q`` quantile (0-1) of the observations between two samples of a cumulative
    histogram, interpolated linearly inside its bucket as Prometheus' ``histogram_quantile``
    does (the ``+Inf`` bucket answers its lower bound). None when nothing was observed."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if b == float("inf"):
                return lower
            inside = c - below
            return lower + (b - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = b, c
    return lower


@dataclass(frozen=True)
class Observation:
    """The window between two snapshots: ``window_s`` seconds; ``request_rate`` requests
    arriving per second (finished + the change in running); mean prompt and output tokens per
    request: the window's prompt tokens (counted as requests start) and generated tokens
    (counted as they stream) over the requests that arrived, the ratio of two flow rates (in a
    short window the requests that finished are not the ones that started; None without
    arrivals); TTFT and ITL 90th percentiles, seconds
    (None without samples); ``running`` now; usable ``workers`` per role now; ``finished``
    requests in the window (how much the percentiles can be trusted)."""

    window_s: float
    request_rate: float
    mean_prompt: float | None
    mean_output: float | None
    ttft_p90: float | None
    itl_p90: float | None
    running: float
    workers: dict[str, int]
    finished: float = 0.0


def observe(before: Snapshot, after: Snapshot) -> Observation:
    """The :class:`Observation` of the window from ``before`` to ``after``. A counter that went
    down (the router restarted) counts from zero."""

    def delta(a: float, b: float) -> float:
        return b - a if b >= a else b

    window = max(1e-9, after.at - before.at)
    done = delta(before.finished, after.finished)
    arrived = max(0.0, done + after.running - before.running)
    restarted = after.finished < before.finished
    ttft_before = {} if restarted else before.ttft
    itl_before = {} if restarted else before.itl
    return Observation(
        window_s=window,
        request_rate=arrived / window,
        mean_prompt=delta(before.prompt_tokens, after.prompt_tokens) / arrived if arrived else None,
        mean_output=(
            delta(before.generation_tokens, after.generation_tokens) / arrived if arrived else None
        ),
        ttft_p90=histogram_quantile(0.9, ttft_before, after.ttft),
        itl_p90=histogram_quantile(0.9, itl_before, after.itl),
        running=after.running,
        workers=dict(after.workers),
        finished=done,
    )
