"""The Kubernetes monitoring component (deploy/k8s/components/monitoring): it holds the same
rules and dashboard as deploy/observability, renders with the base and the overlays (its
PodMonitor selecting every role's metrics port, its NetworkPolicies admitting the scrape and the
traces), the overlay docs/deploy.md writes renders and turns tracing on, and its core objects
pass strict Kubernetes schemas. Rendering needs ``kubectl`` (as tests/deploy/test_k8s.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support.k8s import K8S, KUBECTL, KUBERNETES_VERSION, ROLES, ROOT, kustomize
from tests.support.observability import COMPOSE_DIR, DASHBOARD, MONITORING, SYNC, load_rules

# --- Kubernetes: deploy/k8s/components/monitoring ---------------------------------------------


def test_the_prometheusrule_holds_the_rules_and_the_configmap_the_dashboard() -> None:
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == load_rules()["groups"], f"run {SYNC}"
    assert (MONITORING / DASHBOARD.name).read_bytes() == DASHBOARD.read_bytes(), f"run {SYNC}"


def render_with_monitoring(target: str, tmp_path: Path) -> list[dict[str, Any]]:
    """``target`` (base or an overlay) plus the monitoring component, as a user's overlay
    includes it (docs/deploy.md, "Observability")."""
    overlay = tmp_path / "overlay"
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "pdserve",
        "resources": [os.path.relpath(K8S / target, overlay)],
        "components": [os.path.relpath(MONITORING, overlay)],
    }
    return list(kustomize(kustomization, overlay).docs)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _check_podmonitor(pm: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """The PodMonitor selects each role's pods (and nothing else), on a named container port
    that exists there, and relabels the job to the compose job names."""
    compose_jobs = {
        job["job_name"]
        for job in yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())["scrape_configs"]
    }
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    (relabel,) = endpoint["relabelings"]
    assert relabel["targetLabel"] == "job"
    (source,) = relabel["sourceLabels"]
    selected = []
    for w in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        template = w["spec"]["template"]
        if not _selects(pm["spec"]["selector"], template["metadata"]["labels"]):
            continue
        selected.append(w["metadata"]["name"])
        label = source.removeprefix("__meta_kubernetes_pod_label_")
        value = next(
            v for k, v in template["metadata"]["labels"].items() if re.sub(r"\W", "_", k) == label
        )
        assert relabel["replacement"].replace("$1", value) in compose_jobs, value
        ports = {p.get("name") for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert endpoint["port"] in ports, f"{w['metadata']['name']}: no port {endpoint['port']}"
    assert sorted(selected) == sorted(f"pdserve-{role}" for role in ROLES)


def _check_prometheusrule(rule: dict[str, Any]) -> None:
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"], group.get("name")
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations"}, r
            assert isinstance(r["expr"], str) and r["expr"].strip()
    assert rule["spec"]["groups"] == load_rules()["groups"]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (see test_k8s.py)")
@pytest.mark.parametrize("target", ["base", "overlays/nats", "overlays/gpu"])
def test_the_monitoring_component_renders_with_the_deployment(target: str, tmp_path: Path) -> None:
    docs = render_with_monitoring(target, tmp_path)
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "pdserve", d["metadata"]
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    _check_podmonitor(pm, docs)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    _check_prometheusrule(rule)
    (dashboard,) = [d for d in docs if d["metadata"]["name"] == "pdserve-grafana-dashboard"]
    assert dashboard["kind"] == "ConfigMap"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"] == {DASHBOARD.name: DASHBOARD.read_text()}
    (policy,) = [d for d in docs if d["metadata"]["name"] == "pdserve-metrics-scrape"]
    workers = [d for d in docs if d["kind"] == "Deployment"]
    admitted = {
        w["metadata"]["name"]
        for w in workers
        if _selects(policy["spec"]["podSelector"], w["spec"]["template"]["metadata"]["labels"])
    }
    assert admitted == {"pdserve-prefill", "pdserve-decode"}
    assert [p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]] == [
        pm["spec"]["podMetricsEndpoints"][0]["port"]
    ]
    (egress,) = [d for d in docs if d["metadata"]["name"] == "pdserve-otlp-traces"]
    senders = {
        w["metadata"]["name"]
        for w in workers
        if _selects(egress["spec"]["podSelector"], w["spec"]["template"]["metadata"]["labels"])
    }
    assert senders == {f"pdserve-{role}" for role in ROLES}
    assert [p["port"] for r in egress["spec"]["egress"] for p in r["ports"]] == [OTLP_HTTP_PORT]


OTLP_HTTP_PORT = 4318


def _documented_overlay() -> dict[str, Any]:
    """The overlay docs/deploy.md ("Observability") writes to my-pdserve/kustomization.yaml."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(r"cat > my-pdserve/kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert m, "docs/deploy.md: the monitoring overlay is gone"
    doc: dict[str, Any] = yaml.safe_load(m[1])
    return doc


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (see test_k8s.py)")
def test_the_documented_overlay_adds_monitoring_and_turns_tracing_on(tmp_path: Path) -> None:
    """The docs' overlay (run from the repository root) renders: the operator's resources carry
    the release label, and every role's effective config exports traces to the collector, on
    the port the egress policy opens."""
    from pdserve.config.loading import load_config

    doc = _documented_overlay()
    overlay = tmp_path / "my-pdserve"
    for key in ("resources", "components"):  # from the repository root to tmp_path
        doc[key] = [os.path.relpath(ROOT / "my-pdserve" / p, overlay) for p in doc[key]]
    r = kustomize(doc, overlay)
    for kind in ("PodMonitor", "PrometheusRule"):
        assert r.one(kind, "pdserve")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoints = set()
    for role in ROLES:
        path = tmp_path / f"{role}.yaml"
        path.write_text(r.config_text())
        cfg, _ = load_config(path, env=r.pod_env(role))
        endpoints.add(cfg.observability.otlp_traces_endpoint)
    (endpoint,) = endpoints
    assert urlsplit(endpoint).port == OTLP_HTTP_PORT, endpoint


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (see test_k8s.py)")
def test_the_monitoring_component_passes_strict_kubernetes_schemas(tmp_path: Path) -> None:
    """Everything but the operator's custom resources (checked above) validates strictly."""
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: pip install -e '.[test]'")
    failures = []
    for d in render_with_monitoring("base", tmp_path):
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{d['kind']}/{d['metadata']['name']}: {exc.message}")
    assert not failures, "\n".join(failures)
