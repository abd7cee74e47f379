"""deploy/k8s/components/autoscaling: with the base it renders, its core objects pass strict
Kubernetes schemas, the planner's command parses and resolves to the bounds the KEDA
ScaledObjects repeat, the ScaledObjects query the metric the planner exports for Deployments
that exist, the planner reaches every router through a headless Service on the router's port, and
its profile is a profile pdserve reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.config.loading import load_config
from pdserve.planner.autoscale import PlannerMetrics
from pdserve.planner.profile import Profile
from tests.support.k8s import K8S, KUBECTL, KUBERNETES_VERSION, Rendered, kustomize

COMPONENT = K8S / "components" / "autoscaling"

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (see test_k8s.py)")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    """The base plus the component, as a user's overlay includes it (docs/deploy.md)."""
    overlay = tmp_path_factory.mktemp("autoscaling") / "overlay"
    return kustomize({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "pdserve",
        "resources": [os.path.relpath(K8S / "base", overlay)],
        "components": [os.path.relpath(COMPONENT, overlay)],
    }, overlay)  # fmt: skip


def test_core_objects_pass_strict_schemas(rendered: Rendered) -> None:
    import kubernetes_validate

    ours = [d for d in rendered.docs if "planner" in d["metadata"]["name"]
            or d["metadata"]["name"] == "pdserve-router-pods"]  # fmt: skip
    assert {d["kind"] for d in ours} >= {"Deployment", "Service", "ConfigMap", "NetworkPolicy"}
    for d in ours:
        if d["apiVersion"].startswith(("keda.sh", "monitoring.coreos.com")):
            continue  # CRDs: checked field by field below
        kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
        assert d["metadata"]["namespace"] == "pdserve"


def _planner_config(rendered: Rendered, tmp_path: Path) -> Any:
    path = tmp_path / "config.yaml"
    path.write_text(rendered.config_text())
    return load_config(path, env=rendered.pod_env("planner"))[0]


def test_the_planner_command_parses_and_its_bounds_match_the_scaled_objects(
    rendered: Rendered, tmp_path: Path
) -> None:
    container = rendered.container("planner")
    args = build_parser().parse_args(container["args"])
    assert args.command == "planner"
    cfg = _planner_config(rendered, tmp_path)
    p = cfg.planner
    bounds = {"prefill": (p.min_prefill, p.max_prefill), "decode": (p.min_decode, p.max_decode)}
    exported = {m.name for m in PlannerMetrics().registry.collect()}
    assert "pdserve_planner_desired_workers" in exported
    for role, (lo, hi) in bounds.items():
        so = rendered.one("ScaledObject", f"pdserve-{role}")
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert set(so["spec"]) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                                   "pollingInterval", "cooldownPeriod", "advanced", "triggers"}  # fmt: skip
        rendered.deployment(role)  # the target exists
        assert so["spec"]["scaleTargetRef"] == {"name": f"pdserve-{role}"}
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (lo, hi)
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["threshold"] == "1"  # replicas = ceil(wanted / 1)
        assert trigger["metadata"]["query"] == (
            f'max(pdserve_planner_desired_workers{{role="{role}"}})'
        )
    port = next(c["containerPort"] for c in container["ports"] if c["name"] == "metrics")
    assert port == p.port
    (pm,) = rendered.all("PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    labels = rendered.deployment("planner")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_planner_reaches_every_router_and_reads_its_profile(
    rendered: Rendered, tmp_path: Path
) -> None:
    args = rendered.container("planner")["args"]
    url = urlsplit(args[args.index("--router-url") + 1])
    service = rendered.one("Service", url.hostname or "")
    assert service["spec"]["clusterIP"] == "None"  # headless: one address per router pod
    router = rendered.deployment("router")["spec"]["template"]
    assert service["spec"]["selector"].items() <= router["metadata"]["labels"].items()
    router_port = next(p["containerPort"] for p in rendered.container("router")["ports"]
                       if p["name"] == "http")  # fmt: skip
    assert url.port == router_port == service["spec"]["ports"][0]["port"]
    policy = rendered.one("NetworkPolicy", "pdserve-planner")
    (egress,) = policy["spec"]["egress"]
    assert [p["port"] for p in egress["ports"]] == [router_port]
    assert (
        egress["to"][0]["podSelector"]["matchLabels"].items()
        <= router["metadata"]["labels"].items()
    )
    profile_path = Path(args[args.index("--planner-profile") + 1])
    volumes = rendered.deployment("planner")["spec"]["template"]["spec"]["volumes"]
    mount = next(m for m in rendered.container("planner")["volumeMounts"]
                 if str(profile_path).startswith(m["mountPath"] + "/"))  # fmt: skip
    volume = next(v for v in volumes if v["name"] == mount["name"])
    data = rendered.config_map(volume["configMap"]["name"])["data"]
    (tmp_path / "profile.json").write_text(data[profile_path.name])
    profile = Profile.load(tmp_path / "profile.json")
    assert profile.engines and profile.handoff
    assert (COMPONENT / "profile.json").read_text() == (
        K8S.parents[1] / "docs" / "bench" / "profile-smollm2-amd-epyc-2c.json"
    ).read_text(), "copy docs/bench/profile-smollm2-amd-epyc-2c.json into the component"


def test_the_documented_overlay_renders(tmp_path: Path) -> None:
    """docs/deploy.md ("Autoscaling"): the overlay written to my-pdserve/ at the repository
    root renders with both components."""
    import re

    root = K8S.parents[1]
    text = (root / "docs" / "deploy.md").read_text()
    m = re.search(r"```yaml\n# my-pdserve/kustomization.yaml\n(.*?)```", text, re.S)
    assert m, "docs/deploy.md: the autoscaling overlay is gone"
    doc = yaml.safe_load(m[1])
    overlay = tmp_path / "my-pdserve"
    for key in ("resources", "components"):  # relative to <root>/my-pdserve
        doc[key] = [os.path.relpath((root / "my-pdserve" / p).resolve(), overlay) for p in doc[key]]
    docs = kustomize(doc, overlay).docs
    assert {"ScaledObject", "PodMonitor", "PrometheusRule", "Deployment"} <= {
        d["kind"] for d in docs
    }
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "pdserve", d["metadata"]
