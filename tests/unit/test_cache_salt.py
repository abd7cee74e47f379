"""Per-tenant isolation of the KV cache (vLLM's ``cache_salt``): the router salts every
request's block hashes with its tenant (when API keys name tenants) and the client's
``cache_salt``, each in its own namespace, and hands the salt to the workers in the request's
sampling settings; the hashing itself is checked in tests/unit/test_prefix_cache.py and
tests/unit/test_kv_index.py."""

from __future__ import annotations

import pytest

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import SecuritySettings
from pdserve.protocol import Role
from pdserve.router.router import cache_salt
from pdserve.security import DEFAULT_TENANT, Tenant
from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness


def test_salts_are_namespaced_so_no_client_salt_equals_a_tenant_s() -> None:
    assert cache_salt(None, None) is None
    assert cache_salt(Tenant(DEFAULT_TENANT), None) is None  # keys that name no tenant
    a, b = cache_salt(Tenant("a"), None), cache_salt(Tenant("b"), None)
    assert a != b and a is not None and b is not None
    assert cache_salt(Tenant("a"), "x") not in (a, cache_salt(Tenant("b"), "x"))
    # a client (no tenant) that sends tenant a's salt as its own does not get a's hashes
    assert cache_salt(None, a) != a and cache_salt(Tenant(DEFAULT_TENANT), a) != a


@pytest.mark.parametrize("with_salt", [False, True])
async def test_the_workers_get_the_tenant_s_salt(tmp_path, with_salt: bool) -> None:  # type: ignore[no-untyped-def]
    keys = ["sk-a tenant=a", "sk-b tenant=b"]
    cfg = RouterConfig(
        model_path=build_tokenizer_dir(tmp_path / "tok", max_position_embeddings=128),
        served_model_name=MODEL,
        security=SecuritySettings(api_keys=keys),
    )
    worker = FakeWorker("d0", Role.DECODE, [(100, "t0")])
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    if with_salt:
        body["cache_salt"] = "conversation-7"
    async with router_harness(cfg, [worker]) as h:
        for key in ("sk-a", "sk-b"):
            r = await h.client.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200, r.text
    client = body.get("cache_salt")
    salts = [g.sampling.cache_salt for g in worker.generations]
    assert salts == [cache_salt(Tenant("a"), client), cache_salt(Tenant("b"), client)]


async def test_a_too_long_salt_is_refused_with_400(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = RouterConfig(
        model_path=build_tokenizer_dir(tmp_path / "tok", max_position_embeddings=128),
        served_model_name=MODEL,
    )
    async with router_harness(cfg, [FakeWorker("d0", Role.DECODE, [(100, "t0")])]) as h:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": "s" * 257}
        r = await h.client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
