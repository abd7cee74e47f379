"""/health, /ready, /v1/models, and the app factory's embedded-registry wiring."""

from __future__ import annotations

import httpx
import pytest

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import ModelSettings
from pdserve.protocol import Role
from tests.support.fakes import (
    INTERNAL_AUTH,
    MODEL,
    SECURITY,
    FakeWorker,
    build_tokenizer_dir,
    layout,
    record,
    router_harness,
)

REPLY = [(72, "H"), (105, "i")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=96)


@pytest.fixture
def cfg(model_dir):
    return RouterConfig(model_path=model_dir, served_model_name=MODEL, security=SECURITY)


async def test_ready_with_a_live_decode_or_colocated_worker(cfg):
    async with router_harness(cfg, []) as h:
        assert (await h.client.get("/health")).status_code == 200

        r = await h.client.get("/ready")
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "not_ready"
        assert body["missing"] == [f"decode or colocated worker for model {MODEL!r}"]

        # A prefill worker alone serves nothing; another model's decode worker does not count.
        h.watcher.put(record("p0", "prefill"))
        h.watcher.put(record("d-other", "decode", model="another-model"))
        r = await h.client.get("/ready")
        assert r.status_code == 503
        assert r.json()["missing"] == [f"decode or colocated worker for model {MODEL!r}"]

        # Another head count cannot be mapped by the formatter (block size or dtype could): the
        # decode worker serves by prefilling locally, and /ready says so.
        h.watcher.put(record("d0", "decode", kv_layout=layout(num_kv_heads=4)))
        r = await h.client.get("/ready")
        assert r.status_code == 200
        assert r.json()["paths"] == ["local_prefill"]
        assert "no prefill/decode pair with mappable KV layouts" in r.json()["notes"][0]

        h.watcher.put(record("d1", "decode"))
        r = await h.client.get("/ready")
        assert r.status_code == 200
        assert r.json() == {
            "status": "ready",
            "model": MODEL,
            "prefill": ["p0"],
            "decode": ["d0", "d1"],
            "colocated": [],
            "paths": ["disaggregated", "local_prefill"],
        }

        for worker_id in ("p0", "d0", "d1"):  # workers whose lease lapsed
            h.watcher.remove(worker_id)
        assert (await h.client.get("/ready")).status_code == 503
        h.watcher.put(record("c0", "colocated"))
        r = await h.client.get("/ready")
        assert r.status_code == 200
        assert r.json()["colocated"] == ["c0"] and r.json()["paths"] == ["colocated"]
        assert (await h.client.get("/health")).status_code == 200


async def test_models_lists_the_served_model_and_its_context_window(cfg):
    async with router_harness(cfg, []) as h:
        r = await h.client.get("/v1/models")
    assert r.status_code == 200
    [card] = r.json()["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", 96)


async def test_max_model_len_in_the_config_overrides_the_model_config(model_dir):
    cfg = RouterConfig(
        model_path=model_dir, served_model_name=MODEL, model=ModelSettings(max_model_len=32)
    )
    async with router_harness(cfg, []) as h:
        assert (await h.client.get("/v1/models")).json()["data"][0]["max_model_len"] == 32


async def test_embedded_registry_is_served_and_feeds_the_router(cfg):
    from pdserve.server.app import create_apps

    p, d = FakeWorker("p0", Role.PREFILL, REPLY), FakeWorker("d0", Role.DECODE, REPLY)
    mounts = {w.http_url: httpx.ASGITransport(app=w.app()) for w in (p, d)}
    async with httpx.AsyncClient(mounts=mounts, trust_env=False) as worker_http:
        apps = create_apps(cfg, http_client=worker_http)  # discovery="embedded": own registry
        app, internal = apps.public, apps.registry
        assert internal is not None
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=internal), base_url="http://r:8001"
            ) as reg,
        ):
            assert (await c.get("/ready")).status_code == 503
            for w in (p, d):
                body = {"record": w.record().model_dump(mode="json")}
                r = await reg.put(
                    f"/registry/workers/{w.worker_id}", json=body, headers=INTERNAL_AUTH
                )
                assert r.status_code == 200, r.text
            assert (await c.get("/ready")).status_code == 200
            r = await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            )
            assert r.json()["choices"][0]["message"]["content"] == "Hi"
