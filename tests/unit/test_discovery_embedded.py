"""Embedded registry: records hosted by the router, registered by workers over real HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import fastapi
import httpx
import pytest

from pdserve.discovery import (
    EmbeddedRegistry,
    InvalidDiscoveryURLError,
    RegistrationState,
    open_registration,
    open_watcher,
    parse_discovery_url,
)
from pdserve.discovery.http import HttpRegistration, HttpWatcher
from pdserve.errors import DiscoveryError
from pdserve.protocol import KVLayout, Role, WorkerLoad, WorkerRecord
from tests.fixtures.servers import UvicornHandle, free_port, serve_app, wait_until

Router = tuple[EmbeddedRegistry, UvicornHandle]

TTL_S = 1.0
SLACK_S = 0.6

LAYOUT = KVLayout(
    model="tiny", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32"
)


def make_record(worker_id: str = "prefill-0", epoch: int = 1, running: int = 0) -> WorkerRecord:
    return WorkerRecord(
        role=Role.PREFILL,
        worker_id=worker_id,
        epoch=epoch,
        model="tiny",
        http_url="http://127.0.0.1:9",
        layout=LAYOUT,
        load=WorkerLoad(running=running),
    )


def router_app(registry: EmbeddedRegistry) -> fastapi.FastAPI:
    """A stand-in for the router app: mounts the registry and runs its sweep in the lifespan."""

    @asynccontextmanager
    async def lifespan(app: fastapi.FastAPI) -> AsyncIterator[None]:
        await registry.start()
        yield
        await registry.close()

    app = fastapi.FastAPI(lifespan=lifespan)
    app.include_router(registry.api_router())
    return app


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    registry = EmbeddedRegistry(ttl_s=TTL_S)
    async with serve_app(router_app(registry)) as handle:
        yield registry, handle


async def test_registered_worker_is_visible_to_the_router(router: Router) -> None:
    registry, server = router
    watcher = open_watcher("embedded", registry=registry)
    events: list[tuple[str, WorkerRecord | None]] = []
    watcher.subscribe(lambda wid, rec: events.append((wid, rec)))
    await watcher.start()
    reg = open_registration(server.base_url, ttl_s=TTL_S)
    assert isinstance(reg, HttpRegistration)
    try:
        await reg.start(make_record())
        assert reg.state is RegistrationState.REGISTERED
        assert watcher.workers()["prefill-0"].epoch == 1
        assert [(wid, rec.epoch if rec else None) for wid, rec in events] == [("prefill-0", 1)]
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            listing = (await client.get("/registry/workers")).json()
            assert [w["worker_id"] for w in listing["workers"]] == ["prefill-0"]
            assert (await client.get("/registry/workers/prefill-0")).status_code == 200
            assert (await client.get("/registry/workers/nobody")).status_code == 404
    finally:
        await reg.close()
        await watcher.close()


async def test_update_publishes_new_load(router: Router) -> None:
    registry, server = router
    reg = open_registration(server.base_url, ttl_s=TTL_S)
    await reg.start(make_record(running=0))
    try:
        await reg.update(make_record(running=7))
        await wait_until(lambda: registry.workers()["prefill-0"].load.running == 7, 1.0)
        # Refreshes every ttl/3 keep it alive past several TTLs.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5 * TTL_S:
            assert "prefill-0" in registry.workers()
            await asyncio.sleep(0.1)
    finally:
        await reg.close()


async def test_close_deregisters_at_once_and_is_idempotent(router: Router) -> None:
    registry, server = router
    reg = open_registration(server.base_url, ttl_s=TTL_S)
    await reg.start(make_record())
    await reg.close()
    assert "prefill-0" not in registry.workers()
    assert reg.state is RegistrationState.CLOSED
    await reg.close()


async def test_registration_that_stops_refreshing_lapses_within_ttl(router: Router) -> None:
    registry, server = router
    removed: list[float] = []
    registry.subscribe(lambda wid, rec: removed.append(time.monotonic()) if rec is None else None)
    reg = open_registration(server.base_url, ttl_s=TTL_S)
    await reg.start(make_record())
    stopped = time.monotonic()
    await reg.abandon()  # a crash: no DELETE
    assert "prefill-0" in registry.workers()
    await wait_until(lambda: removed, TTL_S + SLACK_S, what="sweep to expire the record")
    assert removed[0] - stopped <= TTL_S + SLACK_S
    assert registry.workers() == {}


async def test_new_epoch_replaces_record_and_stale_epoch_is_refused(router: Router) -> None:
    registry, server = router
    old = open_registration(server.base_url, ttl_s=TTL_S)
    await old.start(make_record(epoch=1))
    await old.abandon()
    new = open_registration(server.base_url, ttl_s=TTL_S)
    await new.start(make_record(epoch=2))
    try:
        assert registry.workers()["prefill-0"].epoch == 2
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            body = {"record": make_record(epoch=1).model_dump(mode="json"), "ttl_s": TTL_S}
            resp = await client.put("/registry/workers/prefill-0", json=body)
            assert resp.status_code == 409
            resp = await client.put("/registry/workers/other", json=body)
            assert resp.status_code == 400
        assert registry.workers()["prefill-0"].epoch == 2
    finally:
        await new.close()


async def test_registration_retries_until_router_is_reachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    port = free_port()
    reg = open_registration(f"http://127.0.0.1:{port}", ttl_s=TTL_S)
    await reg.start(make_record())  # nobody listens: must not raise
    assert reg.state is RegistrationState.RETRYING
    assert any("failed" in r.message for r in caplog.records if r.levelno == logging.WARNING)
    registry = EmbeddedRegistry(ttl_s=TTL_S)
    handle = UvicornHandle(router_app(registry), port)
    try:
        await handle.start()
        await wait_until(lambda: "prefill-0" in registry.workers(), TTL_S, what="registration")
        await wait_until(lambda: reg.state is RegistrationState.REGISTERED, 0.5)
        # The router restarts with an empty registry: the worker re-registers by itself.
        await handle.stop()
        registry = EmbeddedRegistry(ttl_s=TTL_S)
        await handle.start(router_app(registry))
        await wait_until(lambda: "prefill-0" in registry.workers(), 2 * TTL_S, what="re-reg")
        # The worker logs after it has processed the registry's reply, a moment later.
        await wait_until(
            lambda: any("re-registered" in r.message for r in caplog.records),
            2 * TTL_S,
            what="re-registration logged",
        )
    finally:
        await reg.close()
        await handle.stop()


async def test_http_watcher_follows_a_remote_registry(router: Router) -> None:
    registry, server = router
    watcher = open_watcher(server.base_url)
    assert isinstance(watcher, HttpWatcher)
    watcher.poll_interval_s = 0.1
    await watcher.start()
    try:
        assert watcher.workers() == {}
        registry.put(make_record(), ttl_s=TTL_S)
        await wait_until(lambda: "prefill-0" in watcher.workers(), 1.0)
        registry.remove("prefill-0")
        await wait_until(lambda: watcher.workers() == {}, 1.0)
    finally:
        await watcher.close()


def test_registry_expires_lazily_on_read_without_sweep() -> None:
    registry = EmbeddedRegistry(ttl_s=5.0)
    registry.put(make_record("a"))
    registry.put(make_record("b"), ttl_s=60.0)
    assert registry.expire(now=time.monotonic() + 10.0) == ["a"]
    assert list(registry.workers()) == ["b"]


@pytest.mark.parametrize(
    "url",
    [
        "",
        "localhost:8000",
        "ftp://host:1",
        "etcd://a:1,b:2",
        "http://:80",
        "etcd://h:99999",
        "etcd://h:2379/path",
        "http://user:pw@h:1",
        "embedded",
    ],
)
def test_bad_registration_urls_are_rejected_with_the_accepted_forms(url: str) -> None:
    with pytest.raises(InvalidDiscoveryURLError) as info:
        open_registration(url, ttl_s=1.0)
    assert isinstance(info.value, DiscoveryError) and isinstance(info.value, ValueError)
    assert repr(url) in str(info.value) and "etcd://HOST:PORT" in str(info.value)


def test_url_forms_and_watcher_arguments() -> None:
    assert parse_discovery_url("etcd://h").port == 2379
    assert parse_discovery_url("http://r:8000/").base_url == "http://r:8000"
    with pytest.raises(InvalidDiscoveryURLError, match="registry"):
        open_watcher("embedded")
    with pytest.raises(InvalidDiscoveryURLError, match="registry"):
        open_watcher("etcd://127.0.0.1:2379", registry=EmbeddedRegistry())
    with pytest.raises(ValueError, match="ttl_s"):
        open_registration("http://127.0.0.1:1", ttl_s=0)


async def test_start_rejects_bad_worker_id_and_update_before_start() -> None:
    reg = open_registration("http://127.0.0.1:1", ttl_s=1.0)
    with pytest.raises(RuntimeError, match="before start"):
        await reg.update(make_record())
    with pytest.raises(ValueError, match="worker_id"):
        await reg.start(make_record("bad/id"))
    await reg.close()
