"""`pdserve up`'s own decisions: the KV memory share split between its workers, and a router
port that is already taken."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdserve import launcher
from pdserve.settings import PdserveConfig

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
