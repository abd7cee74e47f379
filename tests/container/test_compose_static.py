"""Static checks of the deployment files that need no container engine: the compose file passes
docker-compose's validation and keeps the properties scaling and health checks rely on; the
Dockerfile keeps its build-argument and runtime contract. The `observability` profile (Grafana,
Jaeger: no registry is reachable here to pull them) is checked only statically, here and in
tests/deploy/test_observability.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.support.podman_stack import COMPOSE_FILE, ROOT

PDSERVE_SERVICES = ("router", "prefill", "decode")
# The optional services and the profiles that start them; the others start by default.
PROFILES = {
    "nats": ["nats"],
    "prometheus": ["prometheus", "observability"],
    "grafana": ["observability"],
    "jaeger": ["observability"],
}


def _compose() -> dict:
    """The compose file as YAML (anchors and ``<<`` merges resolved, variables not)."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


SECRET_VAR = (
    "${PDSERVE_CLUSTER_SECRET:?set the cluster secret, see deploy/compose/docker-compose.yml}"
)


def _docker_compose_config(
    profile: str | None, *, quiet: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    """``docker-compose config``: ``-q`` only validates; without it, prints the resolved file."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    cmd = ["docker-compose", "-f", str(COMPOSE_FILE)]
    if profile:
        cmd += ["--profile", profile]
    environ = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_SECRET"} | env
    return subprocess.run(
        [*cmd, "config", *(["-q"] if quiet else [])],
        capture_output=True,
        text=True,
        check=False,
        env=environ,
    )


@pytest.mark.parametrize("profile", [None, "nats", "prometheus", "observability"])
def test_compose_file_passes_docker_compose_validation(profile: str | None) -> None:
    proc = _docker_compose_config(profile, PDSERVE_CLUSTER_SECRET="0" * 64)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_refuses_to_start_without_a_cluster_secret() -> None:
    proc = _docker_compose_config(None)
    assert proc.returncode != 0
    assert "set the cluster secret" in proc.stdout + proc.stderr


def test_every_pdserve_service_gets_the_cluster_secret_and_only_the_router_api_keys() -> None:
    services = _compose()["services"]
    for name in PDSERVE_SERVICES:
        env = services[name]["environment"]
        assert env["PDSERVE_SECURITY__CLUSTER_SECRET"] == SECRET_VAR, name
        assert ("PDSERVE_API_KEY" in env) == (name == "router"), name
    assert services["router"]["environment"]["PDSERVE_API_KEY"] == "${PDSERVE_API_KEY:-}"


def test_compose_topology_scales_and_checks_health() -> None:
    doc = _compose()
    assert "name" not in doc, "docker-compose 1.29 rejects a top-level name: (use -p)"
    services = doc["services"]
    assert set(services) == {"etcd", *PROFILES, *PDSERVE_SERVICES}
    for name, svc in services.items():
        assert "container_name" not in svc, f"{name}: a fixed name breaks --scale"
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no health check"
        assert svc.get("profiles") == PROFILES.get(name), f"{name}: profiles"
    for name in ("etcd", *PROFILES):
        image = services[name]["image"]
        assert re.fullmatch(r"\$\{PDSERVE_\w+_IMAGE:-[\w./-]+:v?\d+\.\d+\.\d+[\w.-]*\}", image), (
            f"{name}: image must be pinned and overridable by env, got {image}"
        )
    for name in PDSERVE_SERVICES:
        svc = services[name]
        assert svc["command"] == [name], svc["command"]
        assert svc["depends_on"]["etcd"]["condition"] == "service_healthy"
        env = svc["environment"]
        assert env["PDSERVE_CONFIG"] == "/etc/pdserve/config.yaml"
        assert env["PDSERVE_DISCOVERY__URL"] == "${PDSERVE_DISCOVERY_URL:-etcd://etcd:2379}"
        # The health check probes PDSERVE_HEALTH_PORT: it must be the port the role serves on.
        assert env[f"PDSERVE_{name.upper()}__PORT"] == env["PDSERVE_HEALTH_PORT"], name
        assert env[f"PDSERVE_{name.upper()}__HOST"] == "0.0.0.0", name
    for name in ("prefill", "decode"):
        assert "ports" not in services[name], f"{name}: host ports break --scale"
    assert services["router"]["ports"] == ["${PDSERVE_ROUTER_PORT:-8000}:8000"]
    mount = services["router"]["volumes"][0]
    default_config = re.fullmatch(
        r"\$\{PDSERVE_CONFIG_FILE:-([^}]+)\}:/etc/pdserve/config.yaml:ro", mount
    )
    assert default_config, mount
    assert (COMPOSE_FILE.parent / default_config.group(1)).resolve().is_file()


TP_VARIABLE = "${{PDSERVE_{role}_TENSOR_PARALLEL_SIZE:-1}}"


def test_workers_take_their_tensor_parallel_size_from_a_variable_and_get_shared_memory() -> None:
    """Each worker's size comes from its own compose variable (default 1: one process), and
    /dev/shm, where a tensor parallel worker's ranks share the KV pool, is larger than Docker's
    64 MiB default and holds the config's KV budget (the whole pool, every rank's shard)."""
    services = _compose()["services"]
    assert "PDSERVE_MODEL__TENSOR_PARALLEL_SIZE" not in services["router"]["environment"]
    budget_mb = yaml.safe_load((ROOT / "configs" / "1p1d-etcd.yaml").read_text())["kv_cache"][
        "budget_mb"
    ]
    for name in ("prefill", "decode"):
        env = services[name]["environment"]
        assert env["PDSERVE_MODEL__TENSOR_PARALLEL_SIZE"] == TP_VARIABLE.format(role=name.upper())
        m = re.fullmatch(r"(\d+)(mb|gb)", str(services[name]["shm_size"]))
        assert m, services[name]["shm_size"]
        shm_mb = int(m[1]) * (1024 if m[2] == "gb" else 1)
        assert shm_mb >= budget_mb, f"{name}: shm_size {shm_mb} MiB"


def test_a_tensor_parallel_prefill_resolves_to_a_valid_config() -> None:
    """PDSERVE_PREFILL_TENSOR_PARALLEL_SIZE=3 reaches the prefill worker only, and the mounted
    config plus the container's environment is one pdserve accepts (SmolLM2: 9 heads, 3 KV
    heads, so 3 divides them)."""
    from pdserve.config.loading import load_config

    proc = _docker_compose_config(
        None, quiet=False, PDSERVE_CLUSTER_SECRET="0" * 64, PDSERVE_PREFILL_TENSOR_PARALLEL_SIZE="3"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    sizes = {}
    for name in ("prefill", "decode"):
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        cfg, _ = load_config(ROOT / "configs" / "1p1d-etcd.yaml", env=env)
        sizes[name] = cfg.model.tensor_parallel_size
    assert sizes == {"prefill": 3, "decode": 1}


OTLP_VAR = "${PDSERVE_OTLP_TRACES_ENDPOINT:-}"
JAEGER_OTLP = "http://jaeger:4318/v1/traces"


def test_every_pdserve_service_takes_the_traces_endpoint_from_one_variable() -> None:
    """Empty (the default): tracing off; the observability profile's Jaeger receives OTLP over
    HTTP on the port the documented endpoint names, inside the compose network."""
    services = _compose()["services"]
    for name in PDSERVE_SERVICES:
        env = services[name]["environment"]
        assert env["PDSERVE_OBSERVABILITY__OTLP_TRACES_ENDPOINT"] == OTLP_VAR, name
        assert "OTEL_SERVICE_NAME" not in env, f"{name}: pdserve names its services itself"
    assert "4318" in services["jaeger"]["expose"]


@pytest.mark.parametrize("endpoint", [None, JAEGER_OTLP])
def test_the_traces_endpoint_resolves_to_the_tracing_setting(endpoint: str | None) -> None:
    from pdserve.config.loading import load_config

    extra = {} if endpoint is None else {"PDSERVE_OTLP_TRACES_ENDPOINT": endpoint}
    proc = _docker_compose_config(
        "observability", quiet=False, PDSERVE_CLUSTER_SECRET="0" * 64, **extra
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    for name in PDSERVE_SERVICES:
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        cfg, _ = load_config(ROOT / "configs" / "1p1d-etcd.yaml", env=env)
        assert cfg.observability.otlp_traces_endpoint == endpoint, name


def test_observability_ports_are_published_from_variables() -> None:
    services = _compose()["services"]
    assert services["grafana"]["ports"] == ["${PDSERVE_GRAFANA_PORT:-3000}:3000"]
    assert services["jaeger"]["ports"] == ["${PDSERVE_JAEGER_UI_PORT:-16686}:16686"]
    assert services["prometheus"]["ports"] == ["${PDSERVE_PROMETHEUS_PORT:-9090}:9090"]


def test_prometheus_scrapes_every_pdserve_role_on_its_port() -> None:
    services = _compose()["services"]
    scrape = yaml.safe_load((COMPOSE_FILE.parent / "prometheus.yml").read_text())
    targets = {
        (sd["names"][0], sd["port"])
        for job in scrape["scrape_configs"]
        for sd in job["dns_sd_configs"]
    }
    expected = {
        (name, int(services[name]["environment"][f"PDSERVE_{name.upper()}__PORT"]))
        for name in PDSERVE_SERVICES
    }
    assert targets == expected


def test_dockerfile_contract() -> None:
    text = (ROOT / "Dockerfile").read_text()
    first_from = text.index("\nFROM ")
    assert "ARG BASE_IMAGE=debian:bookworm-slim" in text[:first_from]
    runtime = text[text.rindex("\nFROM ") :]
    assert runtime.startswith("\nFROM ${BASE_IMAGE} AS runtime")
    user = re.search(r"^USER (\S+)", runtime, re.M)
    assert user and user.group(1) not in ("root", "0"), "the runtime stage must drop root"
    assert re.search(r"^HEALTHCHECK .*\n?.*pdserve-healthcheck /health", runtime, re.M)
    assert 'ENTRYPOINT ["pdserve"]' in runtime
    for arg in ("VARIANT=cpu", "TORCH_INDEX_URL=", "PIP_FIND_LINKS=", "PIP_CERT="):
        assert f"ARG {arg}" in text, arg
    assert "download.pytorch.org/whl/cpu" in text, "CPU torch must come from the CPU index"
