"""Embedded-registry-only behaviour: the registry's HTTP API, epoch checks, a worker that starts
before its router, the HTTP watcher, lazy expiry, URL forms. In process (uvicorn in the test's
event loop). The behaviour every backend shares is in
``tests/integration/test_discovery_contract.py``."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

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
from pdserve.protocol import Role, WorkerRecord
from tests.support.fakes import CLUSTER_KEY, INTERNAL_AUTH, record, registry_app
from tests.support.servers import UvicornHandle, free_port, serve_app, wait_until

Router = tuple[EmbeddedRegistry, UvicornHandle]

TTL_S = 1.0


def make_record(worker_id: str = "prefill-0", epoch: int = 1) -> WorkerRecord:
    return record(worker_id, Role.PREFILL, "http://127.0.0.1:9", epoch=epoch)


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    registry = EmbeddedRegistry(ttl_s=TTL_S, key=CLUSTER_KEY)
    async with serve_app(registry_app(registry)) as handle:
        yield registry, handle


async def test_registered_worker_is_visible_at_once_and_over_http(router: Router) -> None:
    registry, server = router
    watcher = open_watcher("embedded", registry=registry, key=CLUSTER_KEY)
    events: list[tuple[str, WorkerRecord | None]] = []
    watcher.subscribe(lambda wid, rec: events.append((wid, rec)))
    await watcher.start()
    reg = open_registration(server.base_url, ttl_s=TTL_S, key=CLUSTER_KEY)
    assert isinstance(reg, HttpRegistration)
    try:
        await reg.start(make_record())
        assert reg.state is RegistrationState.REGISTERED
        assert watcher.workers()["prefill-0"].epoch == 1
        assert [(wid, rec.epoch if rec else None) for wid, rec in events] == [("prefill-0", 1)]
        async with httpx.AsyncClient(base_url=server.base_url, headers=INTERNAL_AUTH) as client:
            listing = (await client.get("/registry/workers")).json()
            assert [w["worker_id"] for w in listing["workers"]] == ["prefill-0"]
            assert (await client.get("/registry/workers/prefill-0")).status_code == 200
            assert (await client.get("/registry/workers/nobody")).status_code == 404
    finally:
        await reg.close()
        await watcher.close()


async def test_stale_epoch_and_mismatched_path_are_refused_over_http(router: Router) -> None:
    registry, server = router
    old = open_registration(server.base_url, ttl_s=TTL_S, key=CLUSTER_KEY)
    await old.start(make_record(epoch=1))
    await old.abandon()
    new = open_registration(server.base_url, ttl_s=TTL_S, key=CLUSTER_KEY)
    await new.start(make_record(epoch=2))
    try:
        assert registry.workers()["prefill-0"].epoch == 2
        async with httpx.AsyncClient(base_url=server.base_url, headers=INTERNAL_AUTH) as client:
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
    reg = open_registration(f"http://127.0.0.1:{port}", ttl_s=TTL_S, key=CLUSTER_KEY)
    await reg.start(make_record())  # nobody listens: must not raise
    assert reg.state is RegistrationState.RETRYING
    assert any("failed" in r.message for r in caplog.records if r.levelno == logging.WARNING)
    registry = EmbeddedRegistry(ttl_s=TTL_S, key=CLUSTER_KEY)
    handle = UvicornHandle(registry_app(registry), port)
    try:
        await handle.start()
        await wait_until(lambda: "prefill-0" in registry.workers(), TTL_S, what="registration")
        await wait_until(lambda: reg.state is RegistrationState.REGISTERED, 0.5)
        # The router restarts with an empty registry: the worker re-registers by itself.
        await handle.stop()
        registry = EmbeddedRegistry(ttl_s=TTL_S, key=CLUSTER_KEY)
        await handle.start(registry_app(registry))
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
    watcher = open_watcher(server.base_url, key=CLUSTER_KEY)
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
    registry = EmbeddedRegistry(ttl_s=5.0, key=CLUSTER_KEY)
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
        open_registration(url, ttl_s=1.0, key=CLUSTER_KEY)
    assert isinstance(info.value, DiscoveryError) and isinstance(info.value, ValueError)
    assert repr(url) in str(info.value) and "etcd://HOST:PORT" in str(info.value)


def test_url_forms_and_watcher_arguments() -> None:
    assert parse_discovery_url("etcd://h").port == 2379
    assert parse_discovery_url("http://r:8000/").base_url == "http://r:8000"
    with pytest.raises(InvalidDiscoveryURLError, match="registry"):
        open_watcher("embedded", key=CLUSTER_KEY)
    with pytest.raises(InvalidDiscoveryURLError, match="registry"):
        open_watcher(
            "etcd://127.0.0.1:2379",
            registry=EmbeddedRegistry(ttl_s=TTL_S, key=CLUSTER_KEY),
            key=CLUSTER_KEY,
        )
    with pytest.raises(ValueError, match="ttl_s"):
        open_registration("http://127.0.0.1:1", ttl_s=0, key=CLUSTER_KEY)


async def test_start_rejects_bad_worker_id_and_update_before_start() -> None:
    reg = open_registration("http://127.0.0.1:1", ttl_s=1.0, key=CLUSTER_KEY)
    with pytest.raises(RuntimeError, match="before start"):
        await reg.update(make_record())
    with pytest.raises(ValueError, match="worker_id"):
        await reg.start(make_record("bad/id"))
    await reg.close()
