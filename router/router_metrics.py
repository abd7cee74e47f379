"""The router's Prometheus metrics (``GET /metrics`` of the router app); shared parts in
:mod:`pdserve.observability.prometheus`.

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
  (the workers' KV cache events: applied, gap, stale, unsynced, malformed, unsigned);
  ``pdserve_router_kv_index_workers{state=all|synced}`` and ``pdserve_router_kv_index_blocks``
  (block hashes the router's index holds over all workers)
- Fault tolerance (docs/reliability.md): ``pdserve_router_migrations_total{leg,reason}``: a
  leg that failed and was run again elsewhere: ``leg="prefill"`` (the first leg, before
  anything reached the client: another prefill worker or a local prefill), ``leg="decode"``
  (mid-stream migration: another worker continues after the tokens already sent); ``reason``
  is ``worker_error`` (connection broken, in-band error), ``unreachable``, ``lease_lost``
  (the worker's registration expired: stopped or partitioned), ``draining`` (the worker is
  shutting down), ``transfer`` (the KV pull failed); ``pdserve_router_migration_seconds``:
  a migrated decode leg's failure to the new worker's first token;
  ``pdserve_router_waiting_for_worker``: requests held while no worker can serve them
  (``router.worker_wait_s``)
- Tenants (the fair queue, :mod:`pdserve.router.admission`; only while it is on):
  ``pdserve_router_tenant_admitted_total{tenant}``, ``pdserve_router_tenant_rejected_total
  {tenant}`` (429: its cap, or the longest wait), ``pdserve_router_tenant_queued{tenant}``
  (waiting now), ``pdserve_router_tenant_queue_wait_seconds{tenant}`` and
  ``pdserve_router_tenant_time_to_first_token_seconds{tenant}`` (TTFT, the wait included).
  Tenants come from the configured API keys only, so the label's values are bounded.
- Sessions (:mod:`pdserve.router.sessions`): ``pdserve_router_session_routes_total{outcome}``:
  a request with a session id was routed to the worker of the session's last turn (``kept``),
  to another one (``moved``: cheaper by the KV-aware cost, e.g. the session's worker was
  overloaded), or had no usable entry (``new``: first turn, the worker left, the entry lapsed)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pdserve.observability.prometheus import (
    E2E_BUCKETS,
    LATENCY_BUCKETS,
    OVERLAP_BUCKETS,
    TOKEN_BUCKETS,
    add_process_restarts,
)

if TYPE_CHECKING:
    from pdserve.router.kv_index import KVIndexStats


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
            LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "pdserve_time_per_output_token_seconds",
            "TPOT per request: (last - first token time) / (tokens - 1)",
            TOKEN_BUCKETS,
        )
        self.itl = histogram(
            "pdserve_inter_token_latency_seconds",
            "ITL: gap between two relayed chunks",
            TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "pdserve_e2e_request_latency_seconds", "Request in to last token", E2E_BUCKETS
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
        self.peer_lends = Counter(
            "pdserve_router_peer_prefix_lends",
            "Peer prefix pulls asked for (pdserve/router/peer_pull.py), by outcome: lent (a "
            "worker leased the blocks), none (it held none any more, or did not answer in time)",
            ["outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "pdserve_router_decisions",
            "Routing decisions by path (disaggregated, local_prefill, colocated)",
            ["path"],
            registry=r,
        )
        self.tenant_admitted = Counter(
            "pdserve_router_tenant_admitted",
            "Requests let in by the fair queue, by tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_rejected = Counter(
            "pdserve_router_tenant_rejected",
            "Requests refused by the fair queue (429: the tenant's cap, or the longest wait)",
            ["tenant"],
            registry=r,
        )
        self.tenant_queued = Gauge(
            "pdserve_router_tenant_queued",
            "Requests waiting in the fair queue, by tenant",
            ["tenant"],
            registry=r,
        )
        self.tenant_queue_wait = Histogram(
            "pdserve_router_tenant_queue_wait_seconds",
            "Time a request waited in the fair queue, by tenant",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_ttft = Histogram(
            "pdserve_router_tenant_time_to_first_token_seconds",
            "TTFT by tenant (the fair queue's wait included)",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.session_routes = Counter(
            "pdserve_router_session_routes",
            "Requests with a session id: routed to the session's last worker (kept), to "
            "another (moved), or without a usable entry (new)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("kept", "moved", "new"):
            self.session_routes.labels(outcome)
        self.migrations = Counter(
            "pdserve_router_migrations",
            "Legs run again on another worker after a failure, by leg and reason",
            ["leg", "reason"],
            registry=r,
        )
        self.migration_s = histogram(
            "pdserve_router_migration_seconds",
            "A migrated decode leg: its failure to the new worker's first token",
            LATENCY_BUCKETS,
        )
        self.waiting = Gauge(
            "pdserve_router_waiting_for_worker",
            "Requests held while no worker can serve them (router.worker_wait_s)",
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
            buckets=OVERLAP_BUCKETS,
            registry=r,
        )
        add_process_restarts(r)
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
