"""Prometheus metrics: ``GET /metrics`` on the router and on every worker.

Each app owns one :class:`prometheus_client.CollectorRegistry` (never the global default one),
so several apps in one process (tests) do not collide. Names follow Prometheus conventions:
seconds, ``_total`` counters, a ``pdserve_`` prefix.

Router (:class:`RouterMetrics`), per request:

- ``pdserve_requests_total{outcome}``: finished, failed (a typed error reached the client,
  as an HTTP status or an in-band SSE error), abandoned (the client went away)
- ``pdserve_time_to_first_token_seconds`` (TTFT: request in -> first token, which the prefill
  leg returns), ``pdserve_time_per_output_token_seconds`` (TPOT: (last - first token time) /
  (tokens - 1)), ``pdserve_inter_token_latency_seconds`` (ITL: gap between two chunks the
  router relays), ``pdserve_e2e_request_latency_seconds``
- ``pdserve_prompt_tokens_total``, ``pdserve_generation_tokens_total``,
  ``pdserve_requests_running``, ``pdserve_workers{role}`` (usable workers in the router's view)
- ``pdserve_worker_restarts_total{role}``: a known worker id registered again with a higher
  epoch (the worker restarted), as the router's view saw it
- ``pdserve_router_decisions_total{path}``: routing decisions by path: ``disaggregated``
  (prefill worker -> decode worker), ``local_prefill`` (a decode worker prefilled the prompt
  itself: a short prompt, or no usable prefill worker), ``colocated`` (a colocated worker);
  a retry after a connection error decides again
- KV-aware routing (``router.kv_overlap_weight > 0``): ``pdserve_router_kv_overlap_tokens
  {path,role}``, per decision the prompt tokens the chosen worker of each role (prefill,
  decode, colocated) was expected to hold cached; ``pdserve_router_kv_events_total{outcome}``
  (the workers' KV cache events: applied, gap, stale, unsynced, malformed);
  ``pdserve_router_kv_index_workers{state=all|synced}`` and ``pdserve_router_kv_index_blocks``
  (block hashes the router's index holds over all workers)

Worker (:class:`WorkerMetrics`): the engine's load read at scrape time
(``pdserve_kv_blocks{state=free|used|parked}``: ``free`` includes evictable prefix-cached
blocks, which any allocation may take; ``pdserve_num_requests_running``,
``pdserve_num_requests_waiting``), ``pdserve_kv_lease_expired_total``, the prefix cache's
counters (``pdserve_prefix_cache_queries_total``: admissions that looked up their prefix;
``pdserve_prefix_cache_query_tokens_total`` / ``pdserve_prefix_cache_hit_tokens_total``: tokens
looked up / found cached; ``pdserve_prefix_cache_blocks{state=cached|evictable}``,
``pdserve_prefix_cache_evictions_total``), ``pdserve_kv_events_total{result=sent|failed}`` and
``pdserve_kv_events_snapshots_total`` (the KV cache events a worker publishes for KV-aware
routing), and on decode workers
``pdserve_kv_transfer_seconds`` / ``pdserve_kv_transfer_bytes_total`` /
``pdserve_kv_transfer_failures_total{error}`` for every pull and
``pdserve_kv_transfer_blocks_skipped_total``: prompt blocks a pull left out because this
worker's prefix cache already held them (delta transfer). With KV cache tiers
(:mod:`pdserve.workers.kv.connector`), per ``tier`` (host, disk):
``pdserve_kv_tier_hit_tokens_total`` / ``pdserve_kv_tier_loaded_blocks_total`` (loaded into
the pool instead of recomputed), ``pdserve_kv_tier_stored_blocks_total`` (host: evicted blocks
kept; disk: files written), ``pdserve_kv_tier_evicted_blocks_total`` (dropped for room),
``pdserve_kv_tier_bytes`` / ``pdserve_kv_tier_blocks`` (held now); disk only:
``pdserve_kv_tier_corrupt_blocks_total`` (files that failed their digest or parse, removed and
recomputed), ``pdserve_kv_tier_dropped_saves_total`` (write queue full) and
``pdserve_kv_tier_pending_saves`` (queued now).

Every process (router and workers): ``pdserve_process_restarts``, how many times the
supervisor (``pdserve up``) restarted this process, read from ``PDSERVE_RESTARTS`` (0 when
unset: a process started by hand).

Goodput (requests meeting a TTFT and TPOT target) is computed from these histograms by the
query, e.g. ``histogram_quantile`` over ``pdserve_time_to_first_token_seconds_bucket``. The
prefix cache hit rate likewise::

    sum(rate(pdserve_prefix_cache_hit_tokens_total[5m]))
      / sum(rate(pdserve_prefix_cache_query_tokens_total[5m]))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pdserve.protocol import WorkerLoad

if TYPE_CHECKING:
    from pdserve.router.kv_index import KVIndexStats
    from pdserve.workers.kv.connector import KVConnectorStats
    from pdserve.workers.kv.prefix_cache import PrefixCacheStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

RESTARTS_ENV = "PDSERVE_RESTARTS"
"""Set by the supervisor (:data:`pdserve.supervisor.RESTARTS_ENV`) on every child it starts."""


def process_restarts() -> int:
    """This process's restart count from ``PDSERVE_RESTARTS`` (0 when unset or not a
    non-negative integer)."""
    try:
        return max(0, int(os.environ.get(RESTARTS_ENV, "0")))
    except ValueError:
        return 0


def _add_process_restarts(registry: CollectorRegistry) -> None:
    Gauge(
        "pdserve_process_restarts",
        "Times the supervisor restarted this process (PDSERVE_RESTARTS)",
        registry=registry,
    ).set(process_restarts())


_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_OVERLAP_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class RouterMetrics:
    """The router's request metrics (see the module docstring). ``workers`` is called at
    scrape time and returns the usable worker count per role; ``kv_index``, likewise, the KV
    index's :class:`KVIndexStats` (None: not exported)."""

    def __init__(
        self,
        workers: Callable[[], dict[str, int]] | None = None,
        kv_index: Callable[[], KVIndexStats] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = histogram(
            "pdserve_time_to_first_token_seconds",
            "TTFT: request in to first token",
            _LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "pdserve_time_per_output_token_seconds",
            "TPOT per request: (last - first token time) / (tokens - 1)",
            _TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "pdserve_inter_token_latency_seconds",
            "ITL: gap between two relayed chunks",
            _TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "pdserve_e2e_request_latency_seconds", "Request in to last token", _E2E_BUCKETS
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of started requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated", registry=r
        )
        self.running = Gauge("pdserve_requests_running", "Requests in flight", registry=r)
        self.worker_restarts = Counter(
            "pdserve_worker_restarts",
            "Workers that registered again with a higher epoch (restarted), by role",
            ["role"],
            registry=r,
        )
        self.decisions = Counter(
            "pdserve_router_decisions",
            "Routing decisions by path (disaggregated, local_prefill, colocated)",
            ["path"],
            registry=r,
        )
        for outcome in ("finished", "failed", "abandoned"):
            self.requests.labels(outcome)  # export zeros before the first request
        for role in ("prefill", "decode", "colocated"):
            self.worker_restarts.labels(role)
        for path in ("disaggregated", "local_prefill", "colocated"):
            self.decisions.labels(path)
        self.kv_overlap = Histogram(
            "pdserve_router_kv_overlap_tokens",
            "KV-aware routing: prompt tokens the chosen worker was expected to hold cached, "
            "per decision, by path and worker role",
            ["path", "role"],
            buckets=_OVERLAP_BUCKETS,
            registry=r,
        )
        _add_process_restarts(r)
        if workers is not None:
            r.register(_WorkersCollector(workers))
        if kv_index is not None:
            r.register(_KVIndexCollector(kv_index))

    def render(self) -> bytes:
        """The text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class _WorkersCollector(Collector):
    def __init__(self, workers: Callable[[], dict[str, int]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "pdserve_workers", "Usable workers in the router's view", labels=["role"]
        )
        for role, n in sorted(self._workers().items()):
            g.add_metric([role], n)
        yield g


class _KVIndexCollector(Collector):
    def __init__(self, stats: Callable[[], KVIndexStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        events = CounterMetricFamily(
            "pdserve_router_kv_events",
            "Workers' KV cache events by what the router's index did with them",
            labels=["outcome"],
        )
        for outcome, n in stats.outcomes.items():
            events.add_metric([outcome], n)
        yield events
        workers = GaugeMetricFamily(
            "pdserve_router_kv_index_workers",
            "Workers in the router's KV index (synced: usable for KV-aware routing)",
            labels=["state"],
        )
        workers.add_metric(["all"], stats.workers)
        workers.add_metric(["synced"], stats.synced)
        yield workers
        yield GaugeMetricFamily(
            "pdserve_router_kv_index_blocks",
            "Block hashes in the router's KV index, over all workers",
            value=stats.blocks,
        )


class WorkerMetrics:
    """A worker's metrics. ``load`` (the engine's :class:`WorkerLoad`, None before the engine
    exists), ``lease_expired`` (parked leases expired so far), ``prefix_cache`` (the KV
    cache manager's :class:`PrefixCacheStats`; None: not exported) and ``kv_tiers`` (the KV
    cache connector's :class:`KVConnectorStats`; None: not exported, or no tier) are read at
    scrape time."""

    def __init__(
        self,
        role: str,
        load: Callable[[], WorkerLoad | None],
        lease_expired: Callable[[], int],
        prefix_cache: Callable[[], PrefixCacheStats | None] | None = None,
        kv_tiers: Callable[[], KVConnectorStats | None] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "KV cache pull time per request (decode side)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV cache bytes pulled", registry=r
        )
        self.transfer_failures = Counter(
            "pdserve_kv_transfer_failures", "Failed KV pulls by error", ["error"], registry=r
        )
        self.transfer_blocks_skipped = Counter(
            "pdserve_kv_transfer_blocks_skipped",
            "KV blocks of pulled prompts not sent: already in this worker's prefix cache "
            "(delta transfer)",
            registry=r,
        )
        r.register(_LoadCollector(role, load, lease_expired))
        if prefix_cache is not None:
            r.register(_PrefixCacheCollector(prefix_cache))
        if kv_tiers is not None:
            r.register(_KVTiersCollector(kv_tiers))
        _add_process_restarts(r)

    def render(self) -> bytes:
        """The text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def add_kv_events(self, counts: Callable[[], dict[str, int]]) -> None:
        """Export the KV cache event publisher's counters, read at scrape time: ``counts()``
        gives ``sent``, ``failed`` (events) and ``snapshots``."""
        self.registry.register(_KVEventsCollector(counts))


class _KVEventsCollector(Collector):
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        events = CounterMetricFamily(
            "pdserve_kv_events", "KV cache events sent to the router, by result", labels=["result"]
        )
        for result in ("sent", "failed"):
            events.add_metric([result], counts.get(result, 0))
        yield events
        yield CounterMetricFamily(
            "pdserve_kv_events_snapshots",
            "KV cache snapshots (every cached block hash) started",
            value=counts.get("snapshots", 0),
        )


class _LoadCollector(Collector):
    def __init__(
        self,
        role: str,
        load: Callable[[], WorkerLoad | None],
        lease_expired: Callable[[], int],
    ) -> None:
        self._role, self._load, self._expired = role, load, lease_expired

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        load = self._load()
        if load is not None:
            blocks = GaugeMetricFamily(
                "pdserve_kv_blocks", "KV cache blocks by state", labels=["state"]
            )
            used = load.total_blocks - load.free_blocks
            blocks.add_metric(["free"], load.free_blocks)
            blocks.add_metric(["used"], used)
            blocks.add_metric(["parked"], load.parked)
            yield blocks
            yield GaugeMetricFamily(
                "pdserve_kv_cache_usage_ratio", "Used / total KV blocks",
                value=used / load.total_blocks if load.total_blocks else 0.0,
            )  # fmt: skip
            yield GaugeMetricFamily(
                "pdserve_num_requests_running", "Sequences in the running batch", value=load.running
            )
            yield GaugeMetricFamily(
                "pdserve_num_requests_waiting",
                "Sequences waiting for admission",
                value=load.waiting,
            )
            yield CounterMetricFamily(
                "pdserve_num_preemptions",
                "Sequences preempted (blocks freed, recomputed later) because the KV pool ran short",
                value=load.preemptions,
            )
        yield CounterMetricFamily(
            "pdserve_kv_lease_expired",
            "Parked KV leases that expired unclaimed",
            value=self._expired(),
        )


class _PrefixCacheCollector(Collector):
    def __init__(self, stats: Callable[[], PrefixCacheStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        stats = self._stats()
        if stats is None:
            return
        yield CounterMetricFamily(
            "pdserve_prefix_cache_queries",
            "Admitted sequences that looked up their prefix in the prefix cache",
            value=stats.queries,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cache_query_tokens",
            "Tokens of the sequences looked up in the prefix cache",
            value=stats.query_tokens,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cache_hit_tokens",
            "Tokens found in the prefix cache (K/V reused, not computed)",
            value=stats.hit_tokens,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cache_evictions",
            "Cached KV blocks evicted (reallocated) to make room",
            value=stats.evictions,
        )
        blocks = GaugeMetricFamily(
            "pdserve_prefix_cache_blocks",
            "KV blocks in the prefix cache index (cached) and those no request holds (evictable)",
            labels=["state"],
        )
        blocks.add_metric(["cached"], stats.cached_blocks)
        blocks.add_metric(["evictable"], stats.evictable_blocks)
        yield blocks


class _KVTiersCollector(Collector):
    def __init__(self, stats: Callable[[], KVConnectorStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        stats = self._stats()
        if stats is None:
            return
        tiers = [(name, t) for name, t in (("host", stats.host), ("disk", stats.disk)) if t]

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["tier"])

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["tier"])

        hits = counter("pdserve_kv_tier_hit_tokens", "Tokens loaded from a KV tier, not computed")
        loads = counter("pdserve_kv_tier_loaded_blocks", "KV blocks loaded from a tier")
        stored = counter("pdserve_kv_tier_stored_blocks", "KV blocks stored in a tier")
        evicted = counter("pdserve_kv_tier_evicted_blocks", "KV blocks a tier dropped for room")
        size = gauge("pdserve_kv_tier_bytes", "Bytes a KV tier holds")
        blocks = gauge("pdserve_kv_tier_blocks", "KV blocks a tier holds")
        for name, t in tiers:
            hits.add_metric([name], stats.hit_tokens(name))
            loads.add_metric([name], stats.hit_blocks.get(name, 0))
            stored.add_metric([name], t.stored)
            evicted.add_metric([name], t.evicted)
            size.add_metric([name], t.bytes)
            blocks.add_metric([name], t.blocks)
        yield from (hits, loads, stored, evicted, size, blocks)
        if stats.disk is not None:
            yield CounterMetricFamily(
                "pdserve_kv_tier_corrupt_blocks",
                "KV block files that failed their digest or parse (removed, recomputed)",
                value=stats.disk.corrupt,
            )
            yield CounterMetricFamily(
                "pdserve_kv_tier_dropped_saves",
                "KV blocks not written to the disk tier: its write queue was full",
                value=stats.disk.dropped,
            )
            yield GaugeMetricFamily(
                "pdserve_kv_tier_pending_saves",
                "KV blocks queued for the disk tier's writer",
                value=stats.disk.pending,
            )
