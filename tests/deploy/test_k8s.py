"""Kubernetes manifests (deploy/k8s): every kustomize target renders, passes strict schema
validation for a pinned Kubernetes version, embeds a pdserve config that pdserve's own schema
accepts, and holds the properties the deployment relies on (grace period > KV lease, probes on
the configured ports, PDBs that select their Deployment, GPUs on the GPU workers, ...).

Offline: ``kubectl kustomize`` renders (kubectl ships in the project's machine image; the tests
skip with the reason when it is missing) and ``kubernetes-validate`` (the ``test`` extra) holds
the Kubernetes JSON schemas. The effective config of a pod is what pdserve itself resolves from
the mounted file plus the pod's ``PDSERVE_*`` environment (:func:`pdserve.config.loading.load_config`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.k8s import (
    CONFIG_PATH,
    DISCOVERY,
    GPU_TARGETS,
    K8S,
    KUBECTL,
    KUBERNETES_VERSION,
    POD_IP,
    ROLES,
    ROOT,
    TARGETS,
    WORKERS,
    effective_config,
    render,
)

TP_TARGET = "overlays/tensor-parallel"

pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl not found: `kubectl kustomize` renders deploy/k8s (Debian/Ubuntu package "
    "kubectl; the project's machine image has it)",
)


@pytest.fixture(scope="module")
def cfg_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("k8s-config")


def named_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} has no port named {port!r}")


_CPU = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")
_MEM = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_MEM_UNITS = {None: 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_MEM_UNITS |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(resource: str, value: str | int) -> float:
    """A Kubernetes quantity in cores (cpu) or bytes (memory); anything else as a number."""
    text = str(value)
    if resource == "cpu":
        m = _CPU.match(text)
        assert m, f"bad cpu quantity {text!r}"
        return float(m[1]) / (1000 if m[2] else 1)
    if resource == "memory":
        m = _MEM.match(text)
        assert m, f"bad memory quantity {text!r}"
        return float(m[1]) * _MEM_UNITS[m[2]]
    return float(text)


# --- the set of targets ----------------------------------------------------------------------


def test_every_overlay_is_tested() -> None:
    overlays = {f"overlays/{p.name}" for p in (K8S / "overlays").iterdir() if p.is_dir()}
    assert overlays == set(TARGETS) - {"base"}, "add new overlays to TARGETS (and DISCOVERY)"


# --- rendering and Kubernetes schemas --------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_renders_the_whole_topology_in_one_namespace(target: str) -> None:
    r = render(target)
    assert [d["metadata"]["name"] for d in r.all("Namespace")] == ["pdserve"]
    for role in ROLES:
        r.deployment(role)
        r.one("PodDisruptionBudget", f"pdserve-{role}")
    r.one("Service", "pdserve-router")
    for d in r.docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "pdserve", f"{d['kind']} {d['metadata']}"
    scheme, statefulset = DISCOVERY[target]
    backends = {s["metadata"]["name"] for s in r.all("StatefulSet")}
    assert backends == ({statefulset} if statefulset else set()), backends


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: pip install -e '.[test]'")
    return kubernetes_validate


@pytest.mark.parametrize("target", TARGETS)
def test_manifests_pass_strict_kubernetes_schemas(target: str, kubernetes_validate: Any) -> None:
    failures = []
    for d in render(target).docs:
        what = f"{d['kind']}/{d['metadata']['name']}"
        try:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            failures.append(f"{what}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{what}: no schema: {exc.message}")
    assert not failures, "\n".join(failures)


def test_strict_validation_rejects_a_misspelled_field(kubernetes_validate: Any) -> None:
    """Without strict mode a misspelled field passes; the test above must not be that weak."""
    deployment = yaml.safe_load(yaml.safe_dump(render("base").deployment("prefill")))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# --- the embedded pdserve config -------------------------------------------------------------


def pdserve_config_validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "config", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("target", TARGETS)
def test_embedded_config_passes_pdserve_config_validate(target: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(render(target).config_text())
    proc = pdserve_config_validate(path)
    assert proc.returncode == 0, f"pdserve config validate:\n{proc.stdout}{proc.stderr}"


def test_config_validate_names_the_bad_field_of_the_embedded_config(tmp_path: Path) -> None:
    """The validation above can fail: a broken lease in the same file is refused by path."""
    data = yaml.safe_load(render("base").config_text())
    data["kv_cache"]["lease_s"] = -1
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = pdserve_config_validate(path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "kv_cache.lease_s" in proc.stdout + proc.stderr


@pytest.mark.parametrize("target", TARGETS)
def test_every_role_mounts_the_config_and_resolves_it(target: str, cfg_root: Path) -> None:
    r = render(target)
    for role in ROLES:
        c = r.container(role)
        assert c["args"] == [role, "--config", CONFIG_PATH]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
        assert f"{mount['mountPath']}/config.yaml" == CONFIG_PATH
        effective_config(target, role, cfg_root)  # raises ConfigError naming what is wrong


# --- semantic checks -------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_workers_outlive_their_kv_lease_when_stopped(target: str, cfg_root: Path) -> None:
    r = render(target)
    for role in WORKERS:
        lease_s = effective_config(target, role, cfg_root).kv_cache.lease_s
        spec = r.deployment(role)["spec"]["template"]["spec"]
        grace = spec["terminationGracePeriodSeconds"]
        # SIGTERM's drain takes at most lease + 5 s, then uvicorn closes connections (5 s); a
        # preStop would run inside the same grace period.
        pre_stop = r.container(role).get("lifecycle", {}).get("preStop", {})
        pre_s = float(pre_stop["exec"]["command"][1]) if pre_stop else 0.0
        needed = lease_s + 10 + pre_s
        assert grace > needed, f"{role}: grace {grace} s <= lease {lease_s} s + 10 s + preStop"


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_has_requests_within_limits(target: str) -> None:
    for w in render(target).workloads():
        spec = w["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            what = f"{w['kind']}/{w['metadata']['name']}/{c['name']}"
            res = c.get("resources", {})
            for resource in ("cpu", "memory"):
                assert resource in res.get("requests", {}), f"{what}: no {resource} request"
                assert resource in res.get("limits", {}), f"{what}: no {resource} limit"
            for resource, req in res["requests"].items():
                limit = res["limits"].get(resource)
                if limit is not None:
                    assert quantity(resource, req) <= quantity(resource, limit), what


# SmolLM2-135M-Instruct, the model every target serves (model.path null): 9 attention heads,
# 3 KV heads, MLP width 1536.
SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}


@pytest.mark.parametrize("target", TARGETS)
def test_tensor_parallel_workers_divide_the_model_and_get_cpus_and_shared_memory(
    target: str, cfg_root: Path
) -> None:
    """A worker of N ranks: N divides SmolLM2's heads (else it refuses to start), it runs on
    CPU, asks for N x scheduler.threads CPUs, and mounts a memory-backed /dev/shm (the ranks
    share the KV pool there; a container's default is 64 MiB) that holds the KV budget (the
    whole pool, every rank's shard), within the memory limit."""
    from types import SimpleNamespace

    from pdserve.workers.engine.model.parallel import check_shardable

    r = render(target)
    for role in WORKERS:
        cfg = effective_config(target, role, cfg_root)
        tp = cfg.model.tensor_parallel_size
        assert cfg.model.path is None, "SMOLLM2 describes the default model only"
        check_shardable(SimpleNamespace(**SMOLLM2), tp, f"{target} {role}")
        res = r.container(role)["resources"]
        threads = cfg.scheduler.threads
        assert threads, f"{role}: set scheduler.threads to size the CPU request"
        assert quantity("cpu", res["requests"]["cpu"]) >= tp * threads, f"{role}: {res}"
        if tp == 1:
            continue
        assert cfg.model.device == "cpu", f"{role}: tensor parallel runs on CPU only"
        pod = r.deployment(role)["spec"]["template"]["spec"]
        mount = next(m for m in r.container(role)["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["emptyDir"]["medium"] == "Memory"
        shm = quantity("memory", volume["emptyDir"]["sizeLimit"])
        assert cfg.kv_cache.budget_mb is not None
        assert shm >= cfg.kv_cache.budget_mb * 2**20, f"{role}: /dev/shm {shm:.0f} bytes"
        assert quantity("memory", res["limits"]["memory"]) > shm


def test_the_tensor_parallel_overlay_splits_prefill_only(cfg_root: Path) -> None:
    sizes = {
        role: effective_config(TP_TARGET, role, cfg_root).model.tensor_parallel_size
        for role in WORKERS
    }
    assert sizes == {"prefill": 3, "decode": 1}


@pytest.mark.parametrize("target", TARGETS)
def test_probes_and_ports_match_the_config(target: str, cfg_root: Path) -> None:
    r = render(target)
    for role in ROLES:
        cfg = effective_config(target, role, cfg_root)
        c = r.container(role)
        port = cfg.router.port if role == "router" else cfg.worker(role).port
        assert port > 0, f"{role}: a probe needs a fixed port, config has {port}"
        assert named_port(c, "http") == port
        for probe, path in (
            ("startupProbe", "/health"),
            ("livenessProbe", "/health"),
            ("readinessProbe", "/ready"),
        ):
            get = c[probe]["httpGet"]
            assert (get["path"], named_port(c, get["port"])) == (path, port), f"{role} {probe}"
        if role in WORKERS:
            assert named_port(c, "kv") == cfg.transfer.port > 0
        scrape = r.deployment(role)["spec"]["template"]["metadata"]["annotations"]
        assert (scrape["prometheus.io/port"], scrape["prometheus.io/path"]) == (
            str(port),
            "/metrics",
        )
    service = r.one("Service", "pdserve-router")["spec"]["ports"]
    router = r.container("router")
    router_port = effective_config(target, "router", cfg_root).router.port
    assert [named_port(router, p["targetPort"]) for p in service] == [router_port]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, f"only matchLabels is checked here: {selector}"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


@pytest.mark.parametrize("target", TARGETS)
def test_each_role_has_one_pdb_that_allows_a_drain(target: str) -> None:
    r = render(target)
    pdbs = r.all("PodDisruptionBudget")
    for role in ROLES:
        d = r.deployment(role)
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert _selects(d["spec"]["selector"], labels), f"{role}: selector misses its own pods"
        mine = [p for p in pdbs if _selects(p["spec"]["selector"], labels)]
        assert [p["metadata"]["name"] for p in mine] == [f"pdserve-{role}"]
        spec = mine[0]["spec"]
        replicas = d["spec"]["replicas"]
        if "minAvailable" in spec:  # an integer minAvailable >= replicas blocks every drain
            assert int(spec["minAvailable"]) < replicas, f"{role}: PDB blocks node drains"
        else:
            assert int(spec["maxUnavailable"]) >= 1
    for w in r.workloads():
        if w["metadata"]["name"] not in {f"pdserve-{x}" for x in ROLES}:
            labels = w["spec"]["template"]["metadata"]["labels"]
            assert not any(_selects(p["spec"]["selector"], labels) for p in pdbs), w["metadata"]


@pytest.mark.parametrize("target", TARGETS)
def test_workers_advertise_their_pod_ip(target: str, cfg_root: Path) -> None:
    r = render(target)
    for role in WORKERS:
        env = {v["name"]: v for v in r.container(role).get("env", [])}
        var = env[f"PDSERVE_{role.upper()}__ADVERTISE_HOST"]
        assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        cfg = effective_config(target, role, cfg_root)
        assert cfg.worker(role).advertise_host == POD_IP
        assert cfg.worker(role).host == "0.0.0.0"


@pytest.mark.parametrize("target", TARGETS)
def test_command_variables_are_defined(target: str) -> None:
    """Kubernetes leaves an undefined ``$(VAR)`` in command/args as literal text."""
    for w in render(target).workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            defined = {v["name"] for v in c.get("env", [])}
            for arg in c.get("command", []) + c.get("args", []):
                for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert name in defined, f"{w['metadata']['name']}: $({name}) in {arg!r}"


@pytest.mark.parametrize("target", TARGETS)
def test_pods_run_as_non_root(target: str) -> None:
    for w in render(target).workloads():
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec.get("automountServiceAccountToken") is False
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for role in ROLES:  # the image's user
        pod = render(target).deployment(role)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001


@pytest.mark.parametrize("target", TARGETS)
def test_discovery_points_at_the_rendered_backend(target: str, cfg_root: Path) -> None:
    r = render(target)
    urls = {effective_config(target, role, cfg_root).discovery.url for role in ROLES}
    assert len(urls) == 1, f"roles disagree on discovery: {urls}"
    scheme, statefulset = DISCOVERY[target]
    m = re.fullmatch(r"(\w+)://([^:]+):(\d+)", urls.pop())
    assert m and m[1] == scheme, m
    host, port = m[2], int(m[3])
    if statefulset is None:
        assert "." in host, f"external discovery should name a host outside this namespace: {host}"
        return
    assert host == statefulset
    service_ports = [p["port"] for p in r.one("Service", host)["spec"]["ports"]]
    assert port in service_ports
    container = r.one("StatefulSet", statefulset)["spec"]["template"]["spec"]["containers"][0]
    assert port in [p["containerPort"] for p in container["ports"]]


@pytest.mark.parametrize("target", TARGETS)
def test_gpus_only_in_gpu_overlays_on_the_workers(target: str, cfg_root: Path) -> None:
    r = render(target)
    gpu = target in GPU_TARGETS
    for role in ROLES:
        c = r.container(role)
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        cfg = effective_config(target, role, cfg_root)
        if gpu and role in WORKERS:
            assert int(gpus) == 1, f"{role}: nvidia.com/gpu limit {gpus}"
            assert cfg.model.device == "cuda" and cfg.transfer.backend == "nixl"
            env = r.pod_env(role)
            assert "rc" in env["UCX_TLS"].split(",") and env["UCX_NET_DEVICES"]
        else:
            assert gpus is None, f"{role} asks for a GPU in {target}"
            assert cfg.model.device == "cpu"
    images = {r.container(role)["image"] for role in ROLES}
    assert images == {"pdserve:cuda" if gpu else "pdserve:latest"}


def test_every_port_is_commented() -> None:
    """Each numeric port in deploy/k8s (manifests, config.yaml, nats.conf) says what it is."""
    bare = []
    for path in sorted(K8S.rglob("*")):
        if path.suffix not in (".yaml", ".conf"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*-?\s*(containerPort|port|http_port):\s*\d+", line) and "#" not in line:
                bare.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bare, "ports without a comment:\n" + "\n".join(bare)


CLUSTER_SECRET = "pdserve-cluster-secret"  # created by the user (docs/deploy.md, trust model)


@pytest.mark.parametrize("target", TARGETS)
def test_every_role_reads_the_cluster_secret_from_the_mounted_secret(
    target: str, cfg_root: Path
) -> None:
    r = render(target)
    assert not r.all("Secret"), "secrets are created by the user, never shipped in manifests"
    for role in ROLES:
        pod = r.deployment(role)["spec"]["template"]["spec"]
        c = r.container(role)
        volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName"))
        assert volume["secret"]["secretName"] == CLUSTER_SECRET
        assert volume["secret"].get("optional") is not True, "no secret, no start"
        mode = volume["secret"]["defaultMode"]
        assert mode & 0o007 == 0 and mode & 0o040, f"{role}: mode {mode:o}"
        (item,) = volume["secret"]["items"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] is True
        path = effective_config(target, role, cfg_root).security.cluster_secret_file
        assert str(path) == f"{mount['mountPath']}/{item['path']}", role
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
        api = [v for v in c.get("env", []) if v["name"] == "PDSERVE_API_KEY"]
        if role == "router":  # optional client API keys from their own Secret
            ref = api[0]["valueFrom"]["secretKeyRef"]
            assert ref["optional"] is True and ref["name"] == "pdserve-api-keys"
        else:
            assert not api, f"{role} has no public routes"
