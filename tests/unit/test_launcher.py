"""`pdserve up`'s own decisions: the KV memory share split between its workers, a router port
that is already taken, the children's secrets (files, never the config: :mod:`pdserve.launch.stack`,
which every stack uses) and the give-up line; ``bench serve`` stacks get secret files the same
way."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdserve.config.settings import PdserveConfig
from pdserve.launch import launcher, stack

GIB = 2**30


def test_up_splits_the_measured_share_between_its_workers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "available_host_memory", lambda: 16 * GIB)
    cfg = PdserveConfig()
    kv = launcher.split_kv_cache(cfg, n_workers=2)
    assert kv.budget_mb == 16 * 1024 // 4 // 2
    assert "25% of 16.0 GiB available host memory, 2048 MiB for each of 2 workers" in (
        capsys.readouterr().err
    )
    explicit = cfg.model_copy(
        update={"kv_cache": cfg.kv_cache.model_copy(update={"budget_mb": 64})}
    )
    assert launcher.split_kv_cache(explicit, n_workers=2).budget_mb == 64
    cuda = cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": "cuda"})})
    split = launcher.split_kv_cache(cuda, n_workers=2)
    assert split.budget_mb is None and split.gpu_memory_utilization == pytest.approx(0.45)


def test_up_refuses_a_router_port_that_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    """Another stack on the port would answer our /ready: up must not report ready."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = PdserveConfig.model_validate({"router": {"port": port}})
        assert launcher.run_up(cfg, Path("/nonexistent-model")) == 1
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}" in err and "--port" in err


def test_up_refuses_a_registry_port_that_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    """Another router's registry on the internal port would take our workers' records."""
    with socket.socket() as holder, socket.socket() as free:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        free.bind(("127.0.0.1", 0))
        taken, port = holder.getsockname()[1], free.getsockname()[1]
        free.close()
        cfg = PdserveConfig.model_validate({"router": {"port": port, "registry_port": taken}})
        assert launcher.run_up(cfg, Path("/nonexistent-model")) == 1
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{taken}" in err and "--registry-port" in err


def _read_back(config_file: Path) -> PdserveConfig:
    from pdserve.config.loading import load_file

    return load_file(config_file)


def test_up_gives_its_children_a_fresh_cluster_secret_in_a_private_file(tmp_path: Path) -> None:
    from pdserve.security import MIN_SECRET_CHARS, load_cluster_secret

    config_file = stack.write_child_config(PdserveConfig(), tmp_path)
    child = _read_back(config_file)
    secret_file = child.security.cluster_secret_file
    assert secret_file == tmp_path / stack.CLUSTER_SECRET_FILE
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = load_cluster_secret(child.security).decode()
    assert len(secret) >= MIN_SECRET_CHARS
    assert secret not in config_file.read_text()
    # Every stack gets its own.
    (tmp_path / "other").mkdir()
    other = stack.write_child_secrets(PdserveConfig(), tmp_path / "other")
    assert load_cluster_secret(other.security).decode() != secret


def test_client_api_keys_move_to_a_private_file_and_out_of_the_config(tmp_path: Path) -> None:
    from pdserve.security import load_api_keys, load_cluster_secret

    given = {"security": {"api_keys": ["key-one-abc", "key-two-def"], "cluster_secret": "s" * 40}}
    config_file = stack.write_child_config(PdserveConfig.model_validate(given), tmp_path)
    text = config_file.read_text()
    assert "key-one" not in text and "key-two" not in text and "s" * 40 not in text
    assert "**********" not in text  # no masked secret either: the keys are not in the file
    child = _read_back(config_file)
    assert child.security.api_keys == [] and child.security.cluster_secret is None
    assert child.security.api_key_file == tmp_path / stack.API_KEY_FILE
    assert child.security.api_key_file.stat().st_mode & 0o777 == 0o600
    assert load_api_keys(child.security) == ("key-one-abc", "key-two-def")
    assert load_cluster_secret(child.security) == b"s" * 40  # the user's secret, not a new one


def test_a_cluster_secret_file_given_to_up_is_kept_and_no_keys_means_no_key_file(
    tmp_path: Path,
) -> None:
    mine = tmp_path / "mine"
    mine.write_text("m" * 64)
    cfg = PdserveConfig.model_validate({"security": {"cluster_secret_file": str(mine)}})
    child = stack.write_child_secrets(cfg, tmp_path)
    assert child.security.cluster_secret_file == mine
    assert child.security.api_key_file is None
    assert not (tmp_path / stack.API_KEY_FILE).exists()


def test_children_do_not_inherit_setting_variables_or_the_api_key_alias(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "k")
    monkeypatch.setenv("PDSERVE_SECURITY__CLUSTER_SECRET", "x" * 40)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/cache")
    env = stack.child_env()
    assert "PDSERVE_API_KEY" not in env and "PDSERVE_SECURITY__CLUSTER_SECRET" not in env
    assert env["PDSERVE_CACHE_DIR"] == "/cache"


def test_bench_serve_stacks_get_secret_files_too(tmp_path: Path) -> None:
    from pdserve.bench.bench import stack_settings
    from pdserve.security import load_cluster_secret

    model = tmp_path / "model"
    model.mkdir()
    cfg = PdserveConfig.model_validate(
        {"kv_cache": {"budget_mb": 8}, "security": {"api_keys": ["bench-key-123"]}}
    )
    secrets = tmp_path / "secrets"
    settings = stack_settings(cfg, model, {"prefill": 1, "decode": 1})
    bench = stack.Stack(stack.StackSpec(settings, config_dir=secrets))
    file = bench.write_config()
    child = bench.settings
    assert secrets.stat().st_mode & 0o777 == 0o700
    assert bench.api_headers() == {"Authorization": "Bearer bench-key-123"}
    assert "bench-key-123" not in file.read_text()
    back = _read_back(file)
    assert back.security.cluster_secret_file == secrets / stack.CLUSTER_SECRET_FILE
    assert back.security.api_key_file == secrets / stack.API_KEY_FILE
    assert load_cluster_secret(back.security) == load_cluster_secret(child.security)
    assert (secrets / stack.CLUSTER_SECRET_FILE).stat().st_mode & 0o777 == 0o600


def test_give_up_line_names_the_limit() -> None:
    from pdserve.launch.supervisor import RestartPolicy

    line = launcher.gave_up("prefill-0", -9, RestartPolicy(limit=5, window_s=300))
    assert line.startswith("prefill-0 exited with code -9 after 5 restart(s) within 300 s")
    assert "--restart-limit" in line and "stopping" in line
    assert "restarts are off" in launcher.gave_up("router", 1, RestartPolicy(limit=0))
