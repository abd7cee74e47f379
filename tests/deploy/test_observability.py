"""Dashboards and alerts as deployable files (deploy/observability, the compose `observability`
profile): every PromQL expression of the Grafana dashboard and of the Prometheus rules names
only metrics pdserve exports (the names come from pdserve's own metric registries, as ``GET
/metrics`` would serve them), histogram bucket boundaries they name exist, promtool accepts the
rules and the compose Prometheus config and passes the alerts' unit tests, and the dashboard is
well formed. The Kubernetes component: tests/deploy/test_observability_k8s.py.

promtool comes from the Debian package ``prometheus`` (``sudo tests/deploy/setup_promtool.sh``,
which .ci/run runs): without it these tests skip, except in CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.support.k8s import ROOT
from tests.support.observability import (
    COMPOSE_DIR,
    DASHBOARD,
    PROVISIONING,
    RULE_TESTS,
    RULES,
    load_rules,
)

# Series Prometheus makes itself for every target (not pdserve's); the rules may use them.
PROMETHEUS_SERIES = frozenset({"up"})
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


# --- what pdserve exports --------------------------------------------------------------------


def _registries() -> Iterator[Any]:
    """The router's and a worker's registries with every optional collector on (KV index, KV
    events, copy counter, prefix cache, host and disk KV tiers), as a decode worker and a
    KV-aware router serve them, and the autoscaling planner's."""
    from pdserve.protocol import WorkerLoad
    from pdserve.router.kv_index import KVIndexStats
    from pdserve.router.router_metrics import RouterMetrics
    from pdserve.transfer.formatter.copies import CopyCounter
    from pdserve.workers.kv.prefix_cache import PrefixCacheStats
    from pdserve.workers.roles.worker_metrics import WorkerMetrics

    index = KVIndexStats(outcomes={"applied": 1}, workers=1, synced=1, blocks=1)
    yield RouterMetrics(workers=lambda: {"decode": 1}, kv_index=lambda: index).registry
    tier = SimpleNamespace(
        blocks=0, bytes=0, stored=0, evicted=0, corrupt=0, dropped=0, pending=0, errors=0
    )
    # Stands in for pdserve.workers.kv.offload.KVConnectorStats (whose module imports torch).
    named = [("host", tier), ("disk", tier), ("remote", tier)]
    tiers = SimpleNamespace(hit_blocks={}, hit_tokens=lambda tier: 0, tiers=lambda: named)
    worker = WorkerMetrics(
        "decode",
        load=lambda: WorkerLoad(total_blocks=8, free_blocks=4),
        lease_expired=lambda: 0,
        prefix_cache=lambda: PrefixCacheStats(),
        kv_tiers=lambda: tiers,
    )
    worker.add_kv_events(lambda: {"sent": 0, "failed": 0, "snapshots": 0})
    worker.add_kv_copies(CopyCounter())
    yield worker.registry
    from pdserve.planner.autoscale import PlannerMetrics

    yield PlannerMetrics().registry


_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("", "_count", "_sum"),
    "gauge": ("",),
    "info": ("_info",),
}


@pytest.fixture(scope="module")
def families() -> list[Any]:
    return [f for registry in _registries() for f in registry.collect()]


@pytest.fixture(scope="module")
def exported(families: list[Any]) -> frozenset[str]:
    """Every series name pdserve's /metrics serves: each family's names by its type (a counter
    ``foo`` is ``foo_total``, a histogram ``foo_bucket/_count/_sum``), which covers labelled
    metrics with no sample yet, plus the names of the samples themselves (``_created``)."""
    names: set[str] = set()
    for f in families:
        names.update(f.name + suffix for suffix in _SUFFIXES[f.type])
        names.update(s.name for s in f.samples)
    return frozenset(names)


def _histogram_bounds(families: list[Any]) -> dict[str, set[str]]:
    """``{"pdserve_..._bucket": {"0.005", ..., "+Inf"}}``: the ``le`` values each histogram
    exposes, written as the exporter writes them."""
    bounds: dict[str, set[str]] = {}
    for f in families:
        for s in f.samples:
            if s.name.endswith("_bucket") and "le" in s.labels:
                bounds.setdefault(s.name, set()).add(s.labels["le"])
    return bounds


# --- PromQL: the metric names an expression reads --------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<skip>
        "(?:[^"\\]|\\.)*" | '(?:[^'\\]|\\.)*' | `[^`]*`   # strings
      | \$\{[^}]*\} | \$\w+                               # Grafana variables
      | \[[^\]]*\]                                        # ranges, subqueries
      | \{[^}]*\}                                         # label matchers
      | \d+(?:\.\d*)?(?:[eE][+-]?\d+)?[a-zA-Z]*           # numbers, durations
      | \s+
    )
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<other>.)
    """,
    re.X | re.S,
)
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"})


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: identifiers that are not a function or aggregation
    (followed by ``(`` or by ``by``/``without``), not a keyword, and not a label of a grouping
    clause (``by (le)``, ``on (instance)``, ...); label matchers, ranges and strings are
    skipped whole."""
    tokens = [
        (m.lastgroup, m.group())
        for m in _TOKEN.finditer(expr)
        if m.lastgroup != "skip" and m.group().strip()
    ]
    names: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        i += 1
        if kind != "ident":
            continue
        if text.lower() in _GROUPING:
            if following == "(":  # skip the label list
                i = next(j for j in range(i, len(tokens)) if tokens[j][1] == ")") + 1
            continue
        if following == "(" or following.lower() in ("by", "without"):
            continue  # a function or an aggregation
        if text.lower() not in _KEYWORDS:
            names.add(text)
    return names


def unknown_metrics(expr: str, exported: frozenset[str], recorded: set[str]) -> list[str]:
    """Names ``expr`` reads that neither pdserve exports nor Prometheus makes (``up``) nor a
    recording rule of the rules file defines (``pdserve:...``)."""
    known = exported | PROMETHEUS_SERIES | recorded
    return sorted(n for n in metric_names(expr) if n not in known)


# --- the files -------------------------------------------------------------------------------


def _all_rules() -> list[dict[str, Any]]:
    return [r for g in load_rules()["groups"] for r in g["rules"]]


def _recorded() -> set[str]:
    return {r["record"] for r in _all_rules() if "record" in r}


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _panels() -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included; rows themselves left out."""
    out = []
    for p in _dashboard()["panels"]:
        if p["type"] == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def _expressions() -> list[tuple[str, str]]:
    """``(where, expr)`` for every rule and every dashboard query."""
    exprs = [(r.get("alert") or r["record"], str(r["expr"])) for r in _all_rules()]
    for p in _panels():
        exprs += [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for t in p["targets"]]
    return exprs


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        reason = (
            "promtool not found: sudo tests/deploy/setup_promtool.sh (Debian package prometheus)"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return tool


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


# --- metric names ----------------------------------------------------------------------------


def test_every_metric_the_rules_and_the_dashboard_query_is_one_pdserve_exports(
    exported: frozenset[str],
) -> None:
    recorded = _recorded()
    missing = [
        f"{where}: {name}"
        for where, expr in _expressions()
        for name in unknown_metrics(expr, exported, recorded)
    ]
    assert not missing, "not exported by pdserve:\n" + "\n".join(missing)
    assert len(_expressions()) > 40


def test_the_metric_check_reports_names_pdserve_does_not_export(exported: frozenset[str]) -> None:
    """The check above can fail: a made-up name is reported, functions, aggregations, labels,
    grouping clauses, durations, numbers and Grafana variables are not."""
    expr = (
        "histogram_quantile(0.99, sum by (le, instance) ("
        'rate(pdserve_time_to_first_token_seconds_bucket{le="2.0",job=~"pdserve-.*"}[$__rate_interval])))'
        " / on (instance) group_left (role) pdserve_made_up_total offset 5m > bool 1e9"
        " and pdserve:ttft_slo_miss:ratio_rate5m unless max without (job) (pdserve_workers)"
    )
    assert metric_names(expr) == {
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_made_up_total",
        "pdserve:ttft_slo_miss:ratio_rate5m",
        "pdserve_workers",
    }
    recorded = {"pdserve:ttft_slo_miss:ratio_rate5m"}
    assert unknown_metrics(expr, exported, recorded) == ["pdserve_made_up_total"]
    assert unknown_metrics(expr, exported, set()) == [
        "pdserve:ttft_slo_miss:ratio_rate5m",
        "pdserve_made_up_total",
    ]
    # A counter is served as foo_total, never as foo.
    assert unknown_metrics("rate(pdserve_requests[5m])", exported, set()) == ["pdserve_requests"]


_DEFINED = re.compile(
    r"\b(?:[Cc]ounter|[Gg]auge|[Hh]istogram|Summary|(?:Counter|Gauge|Histogram)MetricFamily)\(\s*"
    r"\"(pdserve_\w+)\""
)


def test_the_exported_names_cover_every_metric_the_source_defines(families: list[Any]) -> None:
    """A metric defined in a registry this test does not build would escape the check above:
    every literal name given to a prometheus_client metric (or to the metric modules' own
    ``histogram(...)``, ``counter(...)`` helpers) in the source is a family here."""
    defined = set()
    for folder in ("pdserve", "router", "server", "workers", "transfer"):
        for path in (ROOT / folder).rglob("*.py"):
            defined |= set(_DEFINED.findall(path.read_text()))
    assert len(defined) > 40, defined
    missing = defined - {f.name for f in families}
    assert not missing, f"defined in the source but not built by _registries(): {missing}"


def test_histogram_bucket_boundaries_in_queries_exist(families: list[Any]) -> None:
    """``foo_bucket{le="2.0"}`` names a bucket foo really has (the TTFT SLO's 2 s boundary is
    one of pdserve.observability.prometheus.LATENCY_BUCKETS), written as the exporter writes it."""
    bounds = _histogram_bounds(families)
    used = []
    for where, expr in _expressions():
        for name, matchers in re.findall(r"(\w+_bucket)\{([^}]*)\}", expr):
            for le in re.findall(r'\ble\s*=\s*"([^"]*)"', matchers):
                used.append(le)
                assert le in bounds.get(name, set()), f"{where}: {name} has no bucket le={le!r}"
    assert "2.0" in used, "the TTFT SLO names its bucket"


# --- promtool --------------------------------------------------------------------------------


def test_promtool_accepts_the_rules() -> None:
    proc = _run(_promtool(), "check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(_all_rules())} rules found" in proc.stdout


def test_the_alerts_fire_in_their_unit_tests() -> None:
    """deploy/observability/prometheus/pdserve-alerts.test.yml: each alert fires on the series
    that should fire it and only there (promtool test rules)."""
    proc = _run(_promtool(), "test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = set(re.findall(r'alertname="(\w+)"', RULE_TESTS.read_text()))
    alerts = {r["alert"] for r in _all_rules() if "alert" in r}
    assert tested == alerts, f"alerts without a unit test: {alerts - tested}"


def _compose_mounts(service: str) -> dict[str, Path]:
    """A compose service's bind mounts: container path -> host path."""
    svc = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())["services"][service]
    mounts = {}
    for volume in svc["volumes"]:
        host, container = volume.split(":")[:2]
        if host.startswith("."):
            mounts[container] = (COMPOSE_DIR / host).resolve()
    return mounts


def test_the_compose_prometheus_config_loads_the_rules(tmp_path: Path) -> None:
    """promtool checks deploy/compose/prometheus.yml with its rule_files resolved through the
    prometheus service's mounts: they must reach the rules file."""
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    mounts = _compose_mounts("prometheus")
    local = []
    for path in config["rule_files"]:
        assert path in mounts, f"rule_files {path} is not mounted into the prometheus service"
        local.append(str(mounts[path]))
    assert local == [str(RULES)]
    config["rule_files"] = local
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config))
    proc = _run(_promtool(), "check", "config", str(checked))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(_all_rules())} rules found" in proc.stdout


def test_every_alert_has_a_severity_and_says_what_to_do() -> None:
    names = []
    for rule in _all_rules():
        assert ("alert" in rule) != ("record" in rule), rule
        if "record" in rule:
            assert rule["record"].startswith("pdserve:"), rule["record"]
            continue
        names.append(rule["alert"])
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        for key in ("summary", "description", "runbook"):
            assert rule["annotations"].get(key, "").strip(), f"{rule['alert']}: no {key}"
    assert len(names) == len(set(names)), "alert names repeat"


# --- the dashboard ---------------------------------------------------------------------------


def test_the_dashboard_queries_the_templated_prometheus_in_every_panel() -> None:
    dash = _dashboard()
    assert dash["schemaVersion"] == 39 and dash["uid"] == "pdserve"
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
    assert (var["type"], var["query"]) == ("datasource", "prometheus")
    panels = _panels()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        what = f"panel {p.get('title')!r}"
        assert p.get("title") and p["datasource"] == DATASOURCE, what
        assert p["targets"], f"{what}: no queries"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{what}: refIds repeat"
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip(), what
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, f"{what}: wider than the grid"
        mine = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cells & mine, f"{what} overlaps another panel"
        cells |= mine


# The panels, each by a metric it must read.
DASHBOARD_METRICS = (
    "pdserve_time_to_first_token_seconds_bucket",
    "pdserve_time_per_output_token_seconds_bucket",
    "pdserve_inter_token_latency_seconds_bucket",
    "pdserve_e2e_request_latency_seconds_bucket",
    "pdserve_requests_total",
    "pdserve_generation_tokens_total",
    "pdserve_num_requests_waiting",
    "pdserve_num_requests_running",
    "pdserve_kv_blocks",
    "pdserve_prefix_cache_hit_tokens_total",
    "pdserve_kv_transfer_bytes_total",
    "pdserve_kv_transfer_failures_total",
    "pdserve_num_preemptions_total",
    "pdserve_process_restarts",
    "pdserve_router_migrations_total",
    "pdserve_router_migration_seconds_bucket",
    "pdserve_router_waiting_for_worker",
)


_QUANTILE = re.compile(
    r"histogram_quantile\((0\.\d+), sum by \(le(?:, \w+)*\) "
    r"\(rate\((\w+)_bucket\[\$__rate_interval\]\)\)\)"
)


def test_the_dashboard_shows_latency_throughput_queues_kv_transfers_and_faults() -> None:
    read = {n for p in _panels() for t in p["targets"] for n in metric_names(t["expr"])}
    assert not set(DASHBOARD_METRICS) - read
    quantiles: dict[str, set[str]] = {}
    for t in (t for p in _panels() for t in p["targets"] if "histogram_quantile" in t["expr"]):
        m = _QUANTILE.fullmatch(t["expr"])  # percentiles from the buckets' rate, summed per le
        assert m, t["expr"]
        quantiles.setdefault(m[2], set()).add(m[1])
    for latency in ("time_to_first_token", "time_per_output_token", "inter_token_latency"):
        assert quantiles[f"pdserve_{latency}_seconds"] == {"0.5", "0.9", "0.99"}, latency
    assert quantiles["pdserve_e2e_request_latency_seconds"] == {"0.5", "0.9", "0.99"}


def test_grafana_is_provisioned_with_the_prometheus_service_and_the_dashboard() -> None:
    compose = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())["services"]
    mounts = _compose_mounts("grafana")
    assert mounts["/etc/grafana/provisioning"] == PROVISIONING
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    m = re.fullmatch(r"http://(\w+):(\d+)", source["url"])
    assert m and m[1] in compose, source["url"]
    assert any(p.endswith(f":{m[2]}") for p in compose[m[1]]["ports"]), source["url"]
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "pdserve.yml").read_text())[
        "providers"
    ]
    folder = provider["options"]["path"]
    served = [host for container, host in mounts.items() if container.startswith(folder + "/")]
    assert served == [DASHBOARD]
