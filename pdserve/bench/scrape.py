"""The benchmarks' one reading of Prometheus metrics: ``GET {url}/metrics`` (the router and every
worker serve it, :mod:`pdserve.observability.prometheus`) parsed into ``{sample: value}``.

A sample is keyed ``name`` or ``name{k="v",...}`` with its labels sorted, e.g.
``pdserve_kv_tier_hit_tokens_total{tier="disk"}``; a histogram gives its ``_bucket``, ``_count``
and ``_sum`` samples. Values are floats (counters, gauges, sums in seconds or bytes as the metric
says). Benchmark code only: the serving stack never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{sample: value}``, a sample named ``name`` or ``name{k="v",...}``.
    Raises ValueError on text that is not the Prometheus format."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """``GET {url}/metrics``, parsed (:func:`parse_metrics`). Raises httpx.HTTPError when the
    request fails or does not answer 200."""
    r = await client.get(f"{url}/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Every sample of ``after`` minus its value in ``before`` (0 when it was not there): what
    a workload added to counters between two scrapes."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
