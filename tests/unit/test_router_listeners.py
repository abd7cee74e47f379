"""The router process's two listeners (:mod:`pdserve.server.serve`): the public port serves the
OpenAI API and the probes and never ``/registry/*`` (404 there, with the cluster token too); the
internal listener serves the embedded registry, and only to the cluster token (401 without).
Real uvicorn on loopback, both listeners in one event loop over one registry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import RouterSettings
from tests.support.fakes import INTERNAL_AUTH, MODEL, SECURITY, build_tokenizer_dir, record
from tests.support.servers import free_port


async def _answers(client: httpx.AsyncClient, url: str) -> bool:
    try:
        await client.get(url)
    except httpx.TransportError:
        return False
    return True


async def test_the_registry_is_served_on_its_own_listener_and_not_on_the_public_port(
    tmp_path: Path,
) -> None:
    from pdserve.server.app import create_apps
    from pdserve.server.serve import bind_listener, serve

    port = free_port()
    cfg = RouterConfig(
        model_path=build_tokenizer_dir(tmp_path / "tok"),
        served_model_name=MODEL,
        security=SECURITY,
        router=RouterSettings(port=port, registry_port=0),
    )
    sock = bind_listener("127.0.0.1", 0)  # what run_router binds: router.registry_bind_*
    public, internal = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{sock.getsockname()[1]}"
    task = asyncio.create_task(serve(create_apps(cfg), cfg, "warning", sock))
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            for url in (f"{public}/health", f"{internal}/registry/workers"):
                for _ in range(200):
                    if await _answers(c, url):
                        break
                    assert not task.done(), task
                    await asyncio.sleep(0.05)
            body = {"record": record("prefill-0", "prefill").model_dump(mode="json")}
            # Public port: no registry, whatever the credentials.
            for headers in ({}, INTERNAL_AUTH):
                r = await c.get(f"{public}/registry/workers", headers=headers)
                assert r.status_code == 404, r.text
                r = await c.put(f"{public}/registry/workers/prefill-0", json=body, headers=headers)
                assert r.status_code in (404, 405), r.text
            # Internal listener: 401 without the cluster token, the registry with it.
            assert (await c.get(f"{internal}/registry/workers")).status_code == 401
            r = await c.put(f"{internal}/registry/workers/prefill-0", json=body)
            assert r.status_code == 401
            assert (await c.get(f"{public}/ready")).json()["prefill"] == []
            r = await c.put(
                f"{internal}/registry/workers/prefill-0", json=body, headers=INTERNAL_AUTH
            )
            assert r.status_code == 200, r.text
            # The router's view reads the same registry the internal listener writes.
            assert (await c.get(f"{public}/ready")).json()["prefill"] == ["prefill-0"]
            listing = (await c.get(f"{internal}/registry/workers", headers=INTERNAL_AUTH)).json()
            assert [w["worker_id"] for w in listing["workers"]] == ["prefill-0"]
            # Nothing but the registry on the internal listener.
            for path in ("/health", "/ready", "/v1/models", "/openapi.json", "/docs"):
                r = await c.get(f"{internal}{path}", headers=INTERNAL_AUTH)
                assert r.status_code == 404, path
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    async with httpx.AsyncClient(trust_env=False, timeout=2) as c:  # both listeners closed
        assert not await _answers(c, f"{public}/health")
        assert not await _answers(c, f"{internal}/registry/workers")


def test_run_router_says_when_the_registry_port_is_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from pdserve.server.serve import run_router

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        cfg = RouterConfig(
            model_path=build_tokenizer_dir(tmp_path / "tok"),
            served_model_name=MODEL,
            security=SECURITY,
            router=RouterSettings(port=free_port(), registry_port=taken),
        )
        assert run_router(cfg, "warning") == 1
    err = capsys.readouterr().err
    assert f"embedded registry on 127.0.0.1:{taken}" in err and "--registry-port" in err
