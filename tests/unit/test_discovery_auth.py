"""The closed internal plane on the discovery side: the embedded registry's routes need the
cluster token (every method, reads included) and stay out of the router's OpenAPI document;
records carry a signature that every watcher checks, so a record written without the cluster
secret never reaches a view. Real uvicorn / in-process ASGI; no sleeps."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from pdserve.config.loading import RouterConfig
from pdserve.discovery import EmbeddedRegistry, open_registration, open_watcher
from pdserve.discovery.records import RecordTable
from pdserve.errors import ConfigError
from pdserve.protocol import Role, WorkerLoad, WorkerRecord
from pdserve.security import ClusterKey
from tests.support.fakes import (
    CLUSTER_KEY,
    INTERNAL_AUTH,
    MODEL,
    SECURITY,
    build_tokenizer_dir,
    record,
    registry_app,
    serve_app,
)
from tests.support.servers import wait_until

OTHER_KEY = ClusterKey(b"another-deployment-secret-0123456789abcdef")
BAD_AUTH: list[dict[str, str]] = [
    {},  # no Authorization header
    OTHER_KEY.http_headers(),  # another deployment's token
    {"Authorization": f"Basic {CLUSTER_KEY.http_token}"},  # the token, but not as a bearer
    {"Authorization": "Bearer"},
    {"Authorization": f"Bearer {CLUSTER_KEY.http_token[:-1]}x"},  # one character off
]


def worker(worker_id: str = "prefill-0", **update: Any) -> WorkerRecord:
    """A record signed with the tests' cluster key; ``update`` changes fields after signing."""
    rec = record(worker_id, Role.PREFILL, f"http://{worker_id}:8100")
    return rec.model_copy(update=update) if update else rec


def unsigned(worker_id: str = "rogue-0") -> WorkerRecord:
    return worker(worker_id, signature="")


def tampered(worker_id: str = "prefill-0") -> WorkerRecord:
    """A genuine record whose endpoint was changed after signing (a hijack attempt)."""
    return worker(worker_id, http_url="http://attacker:8100")


def foreign(worker_id: str = "rogue-1") -> WorkerRecord:
    """Signed, but with another deployment's key."""
    return OTHER_KEY.sign_record(record(worker_id, Role.DECODE, "http://rogue:8100"))


FORGED = [unsigned, tampered, foreign]


@pytest.fixture
async def registry() -> AsyncIterator[tuple[EmbeddedRegistry, httpx.AsyncClient]]:
    """A registry holding prefill-0, served in process; the client sends no credentials."""
    reg = EmbeddedRegistry(ttl_s=30.0, key=CLUSTER_KEY)
    reg.put(worker())
    transport = httpx.ASGITransport(app=registry_app(reg), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        yield reg, client


def assert_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert error["code"] == "unauthorized" and error["type"] == "authentication_error"
    assert error["request_id"] == resp.headers["x-request-id"]
    assert CLUSTER_KEY.http_token not in resp.text


# --- the registry's routes need the token -----------------------------------------------------


@pytest.mark.parametrize("headers", BAD_AUTH)
async def test_registry_routes_refuse_a_missing_or_wrong_token_and_change_nothing(
    registry: tuple[EmbeddedRegistry, httpx.AsyncClient], headers: dict[str, str]
) -> None:
    reg, client = registry
    before = reg.workers()
    rogue = worker("rogue-0")  # even a properly signed record needs the token
    body = {"record": rogue.model_dump(mode="json"), "ttl_s": 30.0}
    assert_401(await client.put("/registry/workers/rogue-0", json=body, headers=headers))
    assert_401(await client.delete("/registry/workers/prefill-0", headers=headers))
    assert_401(await client.get("/registry/workers", headers=headers))
    assert_401(await client.get("/registry/workers/prefill-0", headers=headers))
    # Checked before the body is even parsed: garbage gets the same 401, not a 400.
    garbage = await client.put("/registry/workers/x", content=b"{not json", headers=headers)
    assert_401(garbage)
    assert reg.workers() == before and list(before) == ["prefill-0"]


async def test_registry_routes_answer_the_cluster_token(
    registry: tuple[EmbeddedRegistry, httpx.AsyncClient],
) -> None:
    reg, client = registry
    client.headers.update(INTERNAL_AUTH)
    listing = (await client.get("/registry/workers")).json()["workers"]
    assert [w["worker_id"] for w in listing] == ["prefill-0"]
    assert (await client.get("/registry/workers/prefill-0")).status_code == 200
    body = {"record": worker("decode-0").model_dump(mode="json")}
    assert (await client.put("/registry/workers/decode-0", json=body)).status_code == 200
    assert (await client.delete("/registry/workers/prefill-0")).json() == {"removed": True}
    assert list(reg.workers()) == ["decode-0"]


@pytest.mark.parametrize("forge", FORGED)
async def test_registry_refuses_a_record_not_signed_with_the_cluster_key(
    registry: tuple[EmbeddedRegistry, httpx.AsyncClient], forge: Any
) -> None:
    reg, client = registry
    before = reg.workers()
    bad: WorkerRecord = forge()
    body = {"record": bad.model_dump(mode="json")}
    resp = await client.put(f"/registry/workers/{bad.worker_id}", json=body, headers=INTERNAL_AUTH)
    assert_401(resp)
    assert "not signed" in resp.json()["error"]["message"]
    assert reg.workers() == before  # a hijack of prefill-0 left its genuine record in place


# --- the router app ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def router_app_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")


async def test_router_serves_the_registry_only_to_the_cluster_and_not_on_the_public_port(
    model_dir: Path,
) -> None:
    from pdserve.server.app import create_apps

    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL, security=SECURITY)
    apps = create_apps(cfg)  # discovery "embedded": the router owns a registry
    app, internal = apps.public, apps.registry
    assert internal is not None
    async with (
        app.router.lifespan_context(app),
        router_app_client(app) as client,
        router_app_client(internal) as registry,
    ):
        paths = (await client.get("/openapi.json")).json()["paths"]
        assert paths and not [p for p in paths if p.startswith("/registry")], list(paths)
        body = {"record": worker().model_dump(mode="json")}
        # The public port has no registry at all, with the token or without.
        for headers in ({}, INTERNAL_AUTH):
            assert (await client.get("/registry/workers", headers=headers)).status_code == 404
            r = await client.put("/registry/workers/prefill-0", json=body, headers=headers)
            assert r.status_code in (404, 405), r.text
        # The internal listener's app: the cluster token on every route, nothing else there.
        assert_401(await registry.put("/registry/workers/prefill-0", json=body))
        assert_401(await registry.get("/registry/workers"))
        assert (await registry.get("/openapi.json")).status_code == 404
        assert (await registry.get("/v1/models", headers=INTERNAL_AUTH)).status_code == 404
        assert (await client.get("/ready")).json()["prefill"] == []
        r = await registry.put("/registry/workers/prefill-0", json=body, headers=INTERNAL_AUTH)
        assert r.status_code == 200, r.text
        assert (await client.get("/ready")).json()["prefill"] == ["prefill-0"]  # one registry
        listing = (await registry.get("/registry/workers", headers=INTERNAL_AUTH)).json()
        assert [w["worker_id"] for w in listing["workers"]] == ["prefill-0"]
        for probe in ("/health", "/metrics"):  # open, with no credentials
            assert (await client.get(probe)).status_code == 200, probe


def test_router_needs_a_cluster_secret(model_dir: Path) -> None:
    from pdserve.server.app import create_app

    with pytest.raises(ConfigError, match="cluster_secret"):
        create_app(RouterConfig(model_path=model_dir, served_model_name=MODEL))


# --- signed records: registrations sign, every watcher checks ---------------------------------


def test_a_signature_covers_every_field_and_survives_the_wire() -> None:
    rec = worker()
    assert len(rec.signature) == 64 and CLUSTER_KEY.record_signed(rec)
    assert not OTHER_KEY.record_signed(rec)
    wire = WorkerRecord.model_validate_json(rec.model_dump_json())
    assert CLUSTER_KEY.record_signed(wire)
    for change in (
        {"http_url": "http://x:1"},
        {"epoch": rec.epoch + 1},
        {"communicator": {"endpoint": "evil:1"}},
        {"load": WorkerLoad(running=9)},
        {"signature": "zz" * 32},
        {"signature": ""},
    ):
        assert not CLUSTER_KEY.record_signed(rec.model_copy(update=change)), change


def test_the_record_table_drops_forged_records_with_a_rate_limited_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.discovery")
    table = RecordTable(key=CLUSTER_KEY)
    seen: list[str] = []
    table.subscribe(lambda wid, rec: seen.append(wid))
    genuine = worker()
    assert table.put(genuine)
    for forge in FORGED:
        assert not table.put(forge())
    assert not table.put(unsigned())  # the same rogue id again: counted, not logged again
    assert table.snapshot() == {"prefill-0": genuine} and seen == ["prefill-0"]
    assert table.dropped == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings
    for worker_id, how in (("rogue-0", "missing"), ("prefill-0", "wrong"), ("rogue-1", "wrong")):
        assert any(repr(worker_id) in w and f"signature is {how}" in w for w in warnings)
    # A re-list containing a forged record treats it as absent.
    table.replace_all([worker("decode-0"), tampered("decode-1")], reason="re-listed")
    assert list(table.snapshot()) == ["decode-0"]


async def test_registrations_sign_and_the_http_watcher_drops_what_they_did_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.discovery")
    reg_table = EmbeddedRegistry(ttl_s=30.0, key=CLUSTER_KEY)
    async with serve_app(registry_app(reg_table)) as url:
        registration = open_registration(url, ttl_s=30.0, key=CLUSTER_KEY)
        watcher = open_watcher(url, key=CLUSTER_KEY)
        watcher.poll_interval_s = 0.05  # type: ignore[attr-defined]
        await watcher.start()
        try:
            plain = record("decode-0", Role.DECODE, "http://decode-0:8100")
            await registration.start(plain.model_copy(update={"signature": ""}))
            stored = reg_table.workers()["decode-0"]  # the registration signed it
            assert CLUSTER_KEY.record_signed(stored)
            await wait_until(lambda: "decode-0" in watcher.workers(), 5.0, what="watcher")
            # A record that slipped into the registry's store unsigned (bypassing the route's
            # check) is still dropped by the remote watcher.
            reg_table.view._records["rogue-0"] = unsigned()
            await wait_until(
                lambda: any("'rogue-0'" in r.getMessage() for r in caplog.records),
                5.0,
                what="the watcher's warning about rogue-0",
            )
            assert set(watcher.workers()) == {"decode-0"}
            # A watcher of another deployment sees nothing: its token is refused (401).
            other = open_watcher(url, key=OTHER_KEY)
            await other.start()
            assert other.workers() == {}
            await other.close()
        finally:
            await registration.close()
            await watcher.close()
