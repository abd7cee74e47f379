"""The NetworkPolicies of deploy/k8s (issue 13, item 8): in every kustomize target, every pod of
the namespace is isolated both ways, and the rendered policies allow exactly

- clients (from outside the namespace) -> router on its HTTP port (``router.port``);
- router -> prefill and decode workers on their request-plane port (``prefill.port``,
  ``decode.port``);
- worker -> worker on the KV transceiver port (``transfer.port``), and with the GPU overlays
  (NIXL over UCX) on every port, for UCX's own connections;
- router and workers -> the in-cluster etcd / NATS on its client port, or with the external
  overlays to the port of ``discovery.url`` anywhere;
- every pod -> DNS (53).

Everything else is checked to be refused. The policies are evaluated here with Kubernetes'
semantics (a pod selected by a policy of a type is isolated for that direction; a connection
needs the source's egress and the destination's ingress; named ports resolve on the
destination pod), over the pods the target renders and the ports their config resolves
(:func:`tests.deploy.test_k8s.effective_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.k8s import (
    DISCOVERY,
    GPU_TARGETS,
    KUBECTL,
    TARGETS,
    Rendered,
    effective_config,
    render,
)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (see test_k8s.py)")

EPHEMERAL = 41234  # a port UCX might pick for its own TCP connections
DISCOVERY_PORTS = {"etcd": 2379, "nats": 4222}


@dataclass(frozen=True)
class Pod:
    """A pod template of the target (``None`` labels: a peer outside the namespace)."""

    name: str
    labels: dict[str, str] | None
    ports: dict[str, int]  # named container ports

    @property
    def outside(self) -> bool:
        return self.labels is None


OUTSIDE = Pod("outside", None, {})


def pods(r: Rendered) -> dict[str, Pod]:
    """Every workload's pod template by workload name, plus :data:`OUTSIDE`."""
    out = {"outside": OUTSIDE}
    for w in r.workloads():
        template = w["spec"]["template"]
        ports = {
            p["name"]: int(p["containerPort"])
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
            if "name" in p
        }
        out[w["metadata"]["name"]] = Pod(
            w["metadata"]["name"], template["metadata"]["labels"], ports
        )
    return out


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        op, has, value = e["operator"], e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": has and value in e.get("values", []),
            "NotIn": not has or value not in e.get("values", []),
            "Exists": has,
            "DoesNotExist": not has,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peers: list[dict[str, Any]] | None, pod: Pod) -> bool:
    """A rule's ``from``/``to`` against a pod: omitted or empty matches everyone; a bare
    podSelector matches pods of this namespace; ipBlock/namespaceSelector peers stand for
    the outside here (the targets use neither)."""
    if not peers:
        return True
    for peer in peers:
        if "podSelector" in peer and "namespaceSelector" not in peer:
            if pod.labels is not None and selects(peer["podSelector"], pod.labels):
                return True
        elif pod.outside:
            return True
    return False


def _port_matches(ports: list[dict[str, Any]] | None, dest: Pod, port: int, proto: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != proto:
            continue
        want = p.get("port")
        if want is None or (isinstance(want, int) and want == port):
            return True
        if isinstance(want, str) and dest.ports.get(want) == port:
            return True
    return False


def _allowed(
    r: Rendered, pod: Pod, direction: str, peer: Pod, dest: Pod, port: int, proto: str
) -> bool:
    """Whether ``pod``'s policies of ``direction`` (Ingress, Egress) let this connection through."""
    if pod.outside:
        return True  # nothing here polices the outside
    mine = [
        p["spec"]
        for p in r.all("NetworkPolicy")
        if direction in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], pod.labels)
    ]
    if not mine:
        return True  # not isolated in this direction
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any(
        _peer_matches(rule.get(peers_key), peer)
        and _port_matches(rule.get("ports"), dest, port, proto)
        for spec in mine
        for rule in spec.get(key, [])
    )


def can_connect(r: Rendered, src: Pod, dst: Pod, port: int, proto: str = "TCP") -> bool:
    """Source egress and destination ingress both allow ``src -> dst:port/proto``."""
    return _allowed(r, src, "Egress", dst, dst, port, proto) and _allowed(
        r, dst, "Ingress", src, dst, port, proto
    )


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("k8s-network-config")


def expected(
    target: str, src: str, dst: str, port: int, roles: dict[str, str], ports: dict[str, int]
) -> bool:
    """The intended matrix (module docstring). ``roles``: workload -> role (router, worker,
    discovery); ``ports``: the resolved router, worker, kv and discovery ports."""
    s, d = roles.get(src, "outside"), roles.get(dst, "outside")
    pdserve = s in ("router", "worker")
    if d == "router":
        return port == ports["router"] and s == "outside"  # pods inside never call it
    if d == "worker":
        if s == "router":
            return port == ports["http"]
        if s == "worker":
            return port == ports["kv"] or target in GPU_TARGETS
        return False
    if d == "discovery":
        return pdserve and port == ports["discovery"]
    # the outside
    return pdserve and DISCOVERY[target][1] is None and port == ports["discovery"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_is_isolated_both_ways(target: str) -> None:
    r = render(target)
    for pod in pods(r).values():
        if pod.outside:
            continue
        for direction in ("Ingress", "Egress"):
            isolating = [
                p["metadata"]["name"]
                for p in r.all("NetworkPolicy")
                if direction in p["spec"]["policyTypes"]
                and selects(p["spec"]["podSelector"], pod.labels or {})
            ]
            assert isolating, f"{target}: {pod.name} is open for {direction}"


@pytest.mark.parametrize("target", TARGETS)
def test_policies_allow_exactly_the_planes_of_the_deployment(target: str, cfg_dir: Path) -> None:
    r = render(target)
    everyone = pods(r)
    scheme, statefulset = DISCOVERY[target]
    router_cfg = effective_config(target, "router", cfg_dir)
    worker_cfg = effective_config(target, "decode", cfg_dir)
    assert effective_config(target, "prefill", cfg_dir).prefill.port == worker_cfg.decode.port
    ports = {
        "router": router_cfg.router.port,
        "http": worker_cfg.decode.port,
        "kv": worker_cfg.transfer.port,
        "discovery": int(router_cfg.discovery.url.rsplit(":", 1)[1]),
    }
    assert ports["discovery"] == DISCOVERY_PORTS[scheme]
    roles = {"pdserve-router": "router", "pdserve-prefill": "worker", "pdserve-decode": "worker"}
    if statefulset:
        roles[statefulset] = "discovery"
    assert set(everyone) == {"outside", *roles}, "a workload this test does not know"
    probe_ports = sorted({*ports.values(), 2380, 8222, EPHEMERAL})
    wrong = []
    for src in everyone:
        for dst in everyone:
            if src == dst == "outside":
                continue
            for port in probe_ports:
                got = can_connect(r, everyone[src], everyone[dst], port)
                want = expected(target, src, dst, port, roles, ports)
                if got != want:
                    wrong.append(f"{src} -> {dst}:{port}: {'allowed' if got else 'refused'}")
    assert not wrong, f"{target}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_resolves_names(target: str) -> None:
    r = render(target)
    for pod in pods(r).values():
        if not pod.outside:
            for proto in ("UDP", "TCP"):
                assert can_connect(r, pod, OUTSIDE, 53, proto), f"{pod.name}: no DNS over {proto}"
            assert not can_connect(r, pod, OUTSIDE, 443), f"{pod.name} reaches the outside"


def test_without_the_default_deny_the_workers_egress_would_be_open() -> None:
    """The evaluator is not vacuous: drop the policies that isolate the decode pods' egress
    and it reports the connection they now allow."""
    r = render("base")
    decode = pods(r)["pdserve-decode"]
    assert not can_connect(r, decode, OUTSIDE, 443)
    kept = tuple(
        d
        for d in r.docs
        if d["kind"] != "NetworkPolicy"
        or "Egress" not in d["spec"]["policyTypes"]
        or not selects(d["spec"]["podSelector"], decode.labels or {})
    )
    assert can_connect(Rendered("base-without-egress", kept), decode, OUTSIDE, 443)
