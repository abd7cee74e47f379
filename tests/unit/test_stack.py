"""The one stack builder (:mod:`pdserve.launch.stack`) behind ``pdserve up``, the benchmarks and the
tests' stack: the config file and secrets, each process's command line (extra flags by role and
by name), and a whole lifecycle with stand-in children (the router a static HTTP server whose
``/ready`` lists the workers, the workers sleepers): start, ready, a worker added and killed,
stop. Also: no module of the tools (or the entry points) imports another module's private
names."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from pdserve.config.loading import load_file
from pdserve.config.settings import PdserveConfig
from pdserve.launch import stack
from pdserve.launch.supervisor import ProcessSpec, ReadyTimeoutError, pdserve_argv
from pdserve.security import load_cluster_secret

ROOT = Path(__file__).resolve().parents[2]


def _settings(prefill: int = 2, decode: int = 1) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}, "router": {"port": 0}}
    )


def test_each_process_reads_the_one_config_file_then_its_extra_flags(tmp_path: Path) -> None:
    spec = stack.StackSpec(
        _settings(),
        config_dir=tmp_path / "cfg",
        log_dir=tmp_path / "logs",
        log_level="debug",
        env={"ONLY": "this"},
        args={"router": ["--a"], "prefill": ["--p"], "prefill-1": ["--p1"]},
    )
    s = stack.Stack(spec)
    port = s.settings.router.port
    assert port != 0 and s.url == f"http://127.0.0.1:{port}"  # port 0: a free one, pinned
    # ... and the registry's internal listener another free one, where the workers register.
    registry_port = s.settings.router.registry_port
    assert registry_port not in (None, 0, port)
    assert s.registry_url == f"http://127.0.0.1:{registry_port}"
    assert s.settings.worker_discovery() == s.registry_url
    file = s.write_config()
    assert s.write_config() == file == tmp_path / "cfg" / stack.CONFIG_FILE  # written once
    assert (tmp_path / "cfg").stat().st_mode & 0o777 == 0o700
    back = load_file(file)
    assert back.router.port == port and back.security.cluster_secret is None
    assert back.router.registry_port == registry_port
    secret = load_cluster_secret(back.security).decode()
    assert secret not in file.read_text() and s.cluster_key.http_headers()

    router = s.process_spec("router", "router")
    assert list(router.argv) == pdserve_argv(
        ["router", "--config", str(file), "--a"], log_level="debug"
    )
    assert router.tier == stack.ROUTER_TIER and router.log_path == tmp_path / "logs/router.log"
    assert router.env == {"ONLY": "this"}
    p1 = s.process_spec("prefill", "prefill-1", ["--own"])
    assert list(p1.argv)[-7:] == [
        "--config", str(file), "--worker-id", "prefill-1", "--p", "--p1", "--own",
    ]  # fmt: skip
    assert p1.tier == stack.WORKER_TIER > stack.ROUTER_TIER  # workers stop first
    assert stack.worker_names(s.settings) == [
        ("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0"),
    ]  # fmt: skip
    s.stop()
    assert file.exists()  # a config_dir the spec names stays


def test_a_stack_without_a_config_dir_keeps_its_secrets_private_and_removes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_ROUTER__PORT", "1")
    s = stack.Stack(stack.StackSpec(_settings()))
    file = s.write_config()
    assert file.parent.stat().st_mode & 0o777 == 0o700
    assert "PDSERVE_ROUTER__PORT" not in (s.process_spec("router", "router").env or {})
    with pytest.raises(ValueError, match="no worker role 'router'"):
        s.start_worker("router")
    s.stop()
    s.stop()  # idempotent
    assert not file.parent.exists()


def _stand_ins(root: Path, get_port: object) -> object:
    """A ``place`` hook: the router becomes a static HTTP server of ``root`` (``/ready`` is the
    file ``root/ready``), each worker a sleeper."""

    def place(role: str, spec: ProcessSpec) -> ProcessSpec:
        if role == "router":
            port = get_port()  # type: ignore[operator]
            argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                    "--directory", str(root)]  # fmt: skip
        else:
            argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        return ProcessSpec(spec.name, argv, spec.env, spec.log_path, spec.new_session, spec.tier)

    return place


def test_start_ready_add_kill_and_stop(tmp_path: Path) -> None:
    (tmp_path / "ready").write_text(json.dumps({"prefill": ["p"], "decode": ["d"]}))
    place = _stand_ins(tmp_path, lambda: s.settings.router.port)
    spec = stack.StackSpec(
        _settings(prefill=1),
        log_dir=tmp_path / "logs",
        poll_s=0.05,
        place=place,  # type: ignore[arg-type]
    )
    with stack.Stack(spec) as s:
        s.start()
        assert list(s.procs) == ["router", "prefill-0", "decode-0"]
        assert s.expected() == {"prefill": 1, "decode": 1, "colocated": 0}
        assert s.wait_ready(30)
        extra = s.start_worker("decode")
        assert extra.name == "decode-1" and s.expected()["decode"] == 2
        with pytest.raises(ReadyTimeoutError, match="the stack was not ready within 0.3 s"):
            s.wait_ready(0.3)  # /ready still lists one decode worker
        assert s.wait_ready(5, accept=lambda body: len(body["decode"]) == 1)
        extra.kill()  # on purpose: not expected back
        assert s.expected()["decode"] == 1 and s.wait_ready(5)
        assert not s.wait_ready(5, stopping=lambda: True)
        procs = list(s.procs.values())
    assert all(not p.running for p in procs)
    assert (tmp_path / "logs" / "decode-1.log").exists()


def _private_imports(file: Path) -> list[str]:
    """``from pdserve.x import _name`` and ``module._name`` uses in ``file``."""
    tree = ast.parse(file.read_text())
    modules = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pdserve")
        for a in n.names
    }
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pdserve"):
            bad += [f"{n.module}.{a.name}" for a in n.names if a.name.startswith("_")]
        elif (
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id in modules
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
        ):
            bad.append(f"{n.value.id}.{n.attr}")
    return bad


def test_tools_and_entry_points_import_no_private_names() -> None:
    files = [*(ROOT / "pdserve" / "bench").rglob("*.py")]
    files += [ROOT / "pdserve" / "launch" / n for n in ("stack.py", "launcher.py")]
    files.append(ROOT / "pdserve" / "cli.py")
    found = {f.name: bad for f in files if (bad := _private_imports(f))}
    assert found == {}
