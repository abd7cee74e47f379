"""A worker's Prometheus metrics (``GET /metrics`` of every worker); shared parts in
:mod:`pdserve.observability.prometheus`.

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
worker's prefix cache already held them (delta transfer);
``pdserve_kv_transfer_streamed_total``: pulls of streamed handles (the streamed hand-off). On prefill and decode workers, from
the transceiver's copy counter (:mod:`pdserve.transfer.formatter.copies`):
``pdserve_kv_transfer_payload_bytes_total{side=send|receive}`` (the bytes the transfers this
worker started move) and ``pdserve_kv_transfer_staged_bytes_total{side,stage}`` (bytes copied
into an intermediate buffer on the way: ``formatter_staging``, ``socket``, ``host_staging``;
staged over payload bytes = staging copies per byte). With KV cache tiers
(:mod:`pdserve.workers.kv.offload`), per ``tier`` (host, disk, remote):
``pdserve_kv_tier_hit_tokens_total`` / ``pdserve_kv_tier_loaded_blocks_total`` (loaded into
the pool instead of recomputed), ``pdserve_kv_tier_stored_blocks_total`` (host: evicted blocks
kept; disk: files written; remote: blocks this worker wrote),
``pdserve_kv_tier_evicted_blocks_total`` (dropped for room), ``pdserve_kv_tier_bytes`` /
``pdserve_kv_tier_blocks`` (held now; remote: what this worker knows the store holds); disk
and remote only: ``pdserve_kv_tier_corrupt_blocks_total`` (entries that failed their digest
or parse, removed and recomputed), ``pdserve_kv_tier_dropped_saves_total`` (write queue full,
store unreachable), ``pdserve_kv_tier_errors_total`` (failed reads and writes) and
``pdserve_kv_tier_pending_saves`` (queued now).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pdserve.observability.prometheus import (
    LATENCY_BUCKETS,
    add_process_restarts,
)
from pdserve.protocol import WorkerLoad

if TYPE_CHECKING:
    from pdserve.transfer.formatter.copies import CopyCounter
    from pdserve.workers.kv.offload import KVConnectorStats
    from pdserve.workers.kv.prefix_cache import PrefixCacheStats


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
            buckets=LATENCY_BUCKETS,
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
        self.peer_prefix_pulls = Counter(
            "pdserve_kv_peer_prefix_pulls",
            "Lent prefixes taken before a prefill (peer prefix pull) by outcome: pulled, "
            "refused (the handle or this pool could not take it), failed (the pull; recomputed)",
            ["outcome"],
            registry=r,
        )
        self.peer_prefix_blocks = Counter(
            "pdserve_kv_peer_prefix_blocks",
            "KV blocks pulled from peers' prefix caches instead of computed",
            registry=r,
        )
        self.peer_prefix_seconds = Histogram(
            "pdserve_kv_peer_prefix_pull_seconds",
            "Time to pull a lent prefix (reservation, connection, transfer), successful pulls",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_streamed = Counter(
            "pdserve_kv_transfer_streamed",
            "KV pulls of streamed handles (each prefill chunk's blocks pulled as computed)",
            registry=r,
        )
        r.register(_LoadCollector(role, load, lease_expired))
        if prefix_cache is not None:
            r.register(_PrefixCacheCollector(prefix_cache))
        if kv_tiers is not None:
            r.register(_KVTiersCollector(kv_tiers))
        add_process_restarts(r)

    def render(self) -> bytes:
        """The text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)

    def add_kv_events(self, counts: Callable[[], dict[str, int]]) -> None:
        """Export the KV cache event publisher's counters, read at scrape time: ``counts()``
        gives ``sent``, ``failed`` (events) and ``snapshots``."""
        self.registry.register(_KVEventsCollector(counts))

    def add_kv_copies(self, copies: CopyCounter) -> None:
        """Export the transceiver's copy counter (``Transceiver.copies``), read at scrape
        time: payload bytes per side and staged bytes per side and stage."""
        self.registry.register(_KVCopiesCollector(copies))


class _KVCopiesCollector(Collector):
    def __init__(self, copies: CopyCounter) -> None:
        self._copies = copies

    def collect(self) -> Iterator[Metric]:
        copies = self._copies
        payload = CounterMetricFamily(
            "pdserve_kv_transfer_payload_bytes",
            "KV bytes of the transfers this worker started, by side (send: prefill pool, "
            "receive: decode pool)",
            labels=["side"],
        )
        for side, nbytes in list(copies.payload.items()):
            payload.add_metric([side], nbytes)
        yield payload
        staged = CounterMetricFamily(
            "pdserve_kv_transfer_staged_bytes",
            "KV bytes copied into an intermediate buffer between the pools, by side and stage "
            "(staged / payload bytes = staging copies per byte)",
            labels=["side", "stage"],
        )
        for (side, stage), nbytes in list(copies.staged.items()):
            staged.add_metric([side, stage], nbytes)
        yield staged


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
                "pdserve_kv_cache_usage_ratio",
                "Used / total KV blocks",
                value=used / load.total_blocks if load.total_blocks else 0.0,
            )
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
            for name, doc, value in (
                ("num_drafts", "Sequence steps that verified n-gram drafts", load.spec_drafts),
                ("num_draft_tokens", "Draft tokens proposed and verified", load.spec_draft_tokens),
                ("num_accepted_tokens", "Draft tokens accepted", load.spec_accepted_tokens),
            ):
                yield CounterMetricFamily(f"pdserve_spec_decode_{name}", doc, value=value)
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
        tiers = stats.tiers()

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["tier"])

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["tier"])

        hits = counter("pdserve_kv_tier_hit_tokens", "Tokens loaded from a KV tier, not computed")
        loads = counter("pdserve_kv_tier_loaded_blocks", "KV blocks loaded from a tier")
        stored = counter("pdserve_kv_tier_stored_blocks", "KV blocks stored in a tier")
        evicted = counter("pdserve_kv_tier_evicted_blocks", "KV blocks a tier dropped for room")
        size = gauge(
            "pdserve_kv_tier_bytes",
            "Bytes a KV tier holds (remote: the blocks this worker knows the store holds)",
        )
        blocks = gauge("pdserve_kv_tier_blocks", "KV blocks a tier holds (remote: as bytes)")
        for name, t in tiers:
            hits.add_metric([name], stats.hit_tokens(name))
            loads.add_metric([name], stats.hit_blocks.get(name, 0))
            stored.add_metric([name], t.stored)
            evicted.add_metric([name], t.evicted)
            size.add_metric([name], t.bytes)
            blocks.add_metric([name], t.blocks)
        yield from (hits, loads, stored, evicted, size, blocks)
        writers = [(name, t) for name, t in tiers if name != "host"]
        if not writers:
            return
        corrupt = counter(
            "pdserve_kv_tier_corrupt_blocks",
            "KV blocks of the disk or remote tier that failed their digest or parse (removed, "
            "recomputed)",
        )
        dropped = counter(
            "pdserve_kv_tier_dropped_saves",
            "KV blocks not written to a tier: its write queue was full or its store unreachable",
        )
        errors = counter(
            "pdserve_kv_tier_errors", "Failed reads and writes of a tier (I/O, store timeouts)"
        )
        pending = gauge("pdserve_kv_tier_pending_saves", "KV blocks queued for a tier's writer")
        for name, t in writers:
            corrupt.add_metric([name], t.corrupt)
            dropped.add_metric([name], t.dropped)
            errors.add_metric([name], t.errors)
            pending.add_metric([name], t.pending)
        yield from (corrupt, dropped, errors, pending)
