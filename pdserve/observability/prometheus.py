"""Prometheus metrics: ``GET /metrics`` on the router and on every worker.

Each app owns one :class:`prometheus_client.CollectorRegistry` (never the global default one),
so several apps in one process (tests) do not collide. Names follow Prometheus conventions:
seconds, ``_total`` counters, a ``pdserve_`` prefix.

The router's metrics are :mod:`pdserve.router.router_metrics`, a worker's
:mod:`pdserve.workers.roles.worker_metrics` (each room owns its collectors); this module holds what
they share: the exposition content type, the latency buckets and the process restart gauge.

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

from prometheus_client import CollectorRegistry, Gauge

from pdserve.launch.supervisor import RESTARTS_ENV  # set by the supervisor on every child

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def process_restarts() -> int:
    """This process's restart count from ``PDSERVE_RESTARTS`` (0 when unset or not a
    non-negative integer)."""
    try:
        return max(0, int(os.environ.get(RESTARTS_ENV, "0")))
    except ValueError:
        return 0


def add_process_restarts(registry: CollectorRegistry) -> None:
    """Register ``pdserve_process_restarts`` (this process's :func:`process_restarts`)."""
    Gauge(
        "pdserve_process_restarts",
        "Times the supervisor restarted this process (PDSERVE_RESTARTS)",
        registry=registry,
    ).set(process_restarts())


LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
OVERLAP_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
