"""Rendering the Kubernetes manifests (deploy/k8s) for the deploy tests: ``kubectl kustomize``
per target (:func:`render`, :class:`Rendered`) or of an overlay written on the spot
(:func:`kustomize`), the effective pdserve config of a pod (:func:`effective_config`), and the
targets and discovery backends under test."""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # the schemas kubernetes-validate checks against (strict)
KUBECTL = shutil.which("kubectl")
CONFIG_PATH = "/etc/pdserve/config.yaml"
POD_IP = "10.244.1.7"  # what status.podIP stands for when the pod env is resolved here
ROLES = ("router", "prefill", "decode")
WORKERS = ("prefill", "decode")

TARGETS = ["base", "overlays/nats", "overlays/gpu", "overlays/gpu-nats"]
TARGETS += ["overlays/external-etcd", "overlays/external-nats", "overlays/tensor-parallel"]
GPU_TARGETS = {"overlays/gpu", "overlays/gpu-nats"}
DISCOVERY = {  # target -> (scheme, in-cluster StatefulSet serving it or None for external)
    "base": ("etcd", "etcd"),
    "overlays/nats": ("nats", "nats"),
    "overlays/gpu": ("etcd", "etcd"),
    "overlays/gpu-nats": ("nats", "nats"),
    "overlays/external-etcd": ("etcd", None),
    "overlays/external-nats": ("nats", None),
    "overlays/tensor-parallel": ("etcd", "etcd"),
}


# --- rendering and lookups -------------------------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    """One kustomize target's output: ``docs`` are the rendered objects, in kustomize's order."""

    target: str
    docs: tuple[dict[str, Any], ...]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.all(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.target}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def config_map(self, name: str) -> dict[str, Any]:
        """A ConfigMap by its name as rendered (with kustomize's hash suffix)."""
        return self.one("ConfigMap", name)

    def deployment(self, role: str) -> dict[str, Any]:
        return self.one("Deployment", f"pdserve-{role}")

    def container(self, role: str) -> dict[str, Any]:
        containers = self.deployment(role)["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1, f"{self.target}: pdserve-{role} has {len(containers)}"
        return containers[0]

    def workloads(self) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def config_text(self) -> str:
        """The pdserve config file the pods mount (the config volume's ConfigMap)."""
        spec = self.deployment("router")["spec"]["template"]["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "config")
        return self.config_map(volume["configMap"]["name"])["data"]["config.yaml"]

    def pod_env(self, role: str) -> dict[str, str]:
        """The container's environment as the pod sees it: envFrom ConfigMaps, then env
        (later wins, as in Kubernetes); ``status.podIP`` becomes :data:`POD_IP`; an optional
        Secret key is left out (the Secret does not exist until the user creates it)."""
        c = self.container(role)
        env: dict[str, str] = {}
        for src in c.get("envFrom", []):
            env.update(self.config_map(src["configMapRef"]["name"]).get("data", {}))
        for var in c.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[var["name"]] = POD_IP
            elif var.get("valueFrom", {}).get("secretKeyRef", {}).get("optional") is True:
                continue
            else:
                raise AssertionError(f"{self.target}: unexpected env source {var}")
        return env


@functools.cache
def render(target: str) -> Rendered:
    """``kubectl kustomize deploy/k8s/<target>``; fails the test with kustomize's message."""
    assert KUBECTL is not None
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {target} failed:\n{proc.stderr}")
    docs = tuple(d for d in yaml.safe_load_all(proc.stdout) if d)
    return Rendered(target, docs)


def kustomize(kustomization: dict[str, Any], folder: Path) -> Rendered:
    """Write ``kustomization`` to ``folder/kustomization.yaml`` (its paths relative to
    ``folder``) and render it; fails the test with kustomize's message."""
    assert KUBECTL is not None
    folder.mkdir(parents=True, exist_ok=True)
    folder.joinpath("kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return Rendered(folder.name, tuple(d for d in yaml.safe_load_all(proc.stdout) if d))


@functools.cache
def effective_config(target: str, role: str, tmp_root: Path) -> Any:
    """The pdserve config ``role``'s pod resolves: the mounted file + its PDSERVE_* env."""
    try:
        from pdserve.config.loading import load_config
    except ImportError as exc:
        pytest.fail(
            f"pdserve.config.loading.load_config is missing (the issue-4 config contract): {exc}"
        )
    r = render(target)
    path = tmp_root / target.replace("/", "_") / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(r.config_text())
    cfg, _ = load_config(path, env=r.pod_env(role))
    return cfg
