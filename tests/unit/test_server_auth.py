"""Client API keys on the router's public plane: every ``/v1`` route needs ``Authorization:
Bearer KEY`` when keys are configured (401 with an OpenAI error body otherwise), the probes stay
open, keys never reach the log, and the OpenAPI document declares the bearer scheme."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import RouterSettings, SecuritySettings
from pdserve.protocol import Role
from pdserve.server.guard import TOKENIZER_PATHS
from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness

REPLY = [(72, "H"), (105, "i"), (33, "!")]
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
KEYS = ("sk-first-0123456789", "sk-second-9876543210")
FILE_KEY = "sk-from-file-5555"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=64)


def router_cfg(model_dir: Path, *, keys: tuple[str, ...] = (), **security: Any) -> RouterConfig:
    return RouterConfig(
        model_path=model_dir,
        served_model_name=MODEL,
        router=RouterSettings(max_request_bytes=1024),
        security=SecuritySettings(api_keys=[SecretStr(k) for k in keys], **security),
    )


@pytest.fixture
def cfg(model_dir):
    return router_cfg(model_dir, keys=KEYS)


def workers() -> list[FakeWorker]:
    return [FakeWorker("p0", Role.PREFILL, REPLY), FakeWorker("d0", Role.DECODE, REPLY)]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(r: Any) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "invalid_api_key",
        None,
    )
    assert "Authorization: Bearer" in err["message"]
    assert err["request_id"] == r.headers["x-request-id"]
    assert not any(k in r.text for k in KEYS), "the body names no key"


V1_CALLS = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}),
    ("GET", "/v1/no-such-route", None),  # unknown /v1 routes are not revealed either
]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        auth("sk-wrong"),
        auth(KEYS[0] + "x"),
        auth(KEYS[0][:-1]),
        {"Authorization": KEYS[0]},  # no scheme
        {"Authorization": f"Basic {KEYS[0]}"},
        {"Authorization": "Bearer "},
    ],
    ids=["none", "wrong", "longer", "prefix", "no-scheme", "basic", "empty"],
)
@pytest.mark.parametrize(("method", "path", "body"), V1_CALLS, ids=[c[1] for c in V1_CALLS])
async def test_v1_without_a_valid_key_is_a_401(cfg, method, path, body, headers):
    async with router_harness(cfg, workers()) as h:
        r = await h.client.request(method, path, json=body, headers=headers)
        assert h.workers["p0"].contexts == []
    assert_401(r)


@pytest.mark.parametrize("key", KEYS)
async def test_each_configured_key_is_accepted(cfg, key):
    async with router_harness(cfg, workers()) as h:
        chat = await h.client.post("/v1/chat/completions", json=CHAT, headers=auth(key))
        models = await h.client.get("/v1/models", headers=auth(key))
        lower = await h.client.get("/v1/models", headers={"authorization": f"bearer {key}"})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "Hi!"
    assert models.status_code == lower.status_code == 200


async def test_keys_from_the_key_file_are_added(model_dir, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(f"\n{FILE_KEY}\n  \n")
    cfg = router_cfg(model_dir, keys=KEYS[:1], api_key_file=key_file)
    async with router_harness(cfg, workers()) as h:
        from_file = await h.client.get("/v1/models", headers=auth(FILE_KEY))
        from_flag = await h.client.get("/v1/models", headers=auth(KEYS[0]))
        other = await h.client.get("/v1/models", headers=auth(KEYS[1]))
    assert from_file.status_code == from_flag.status_code == 200
    assert_401(other)


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/openapi.json"])
async def test_probes_and_the_schema_stay_open(cfg, path):
    async with router_harness(cfg, workers()) as h:
        r = await h.client.get(path)
    assert r.status_code == 200, r.text


async def test_the_key_is_checked_before_the_body_is_read(cfg):
    async with router_harness(cfg, workers()) as h:
        bad_json = await h.client.post(
            "/v1/chat/completions", content=b"{not json", headers={"content-type": "json"}
        )
        huge = await h.client.post("/v1/completions", content=b"x" * 4096)
        huge_with_key = await h.client.post(
            "/v1/completions", content=b"x" * 4096, headers=auth(KEYS[0])
        )
    assert_401(bad_json)
    assert_401(huge)
    assert huge_with_key.status_code == 413


async def test_without_keys_v1_is_open(model_dir):
    async with router_harness(router_cfg(model_dir), workers()) as h:
        r = await h.client.post("/v1/chat/completions", json=CHAT)
        schema = (await h.client.get("/openapi.json")).json()
    assert r.status_code == 200
    assert "securitySchemes" not in schema.get("components", {})
    assert "401" not in schema["paths"]["/v1/chat/completions"]["post"]["responses"]


async def test_keys_are_never_logged_and_their_count_is(cfg, caplog):
    caplog.set_level(logging.DEBUG)
    async with router_harness(cfg, workers()) as h:
        await h.client.get("/v1/models", headers=auth("sk-wrong-guess"))
        await h.client.post("/v1/chat/completions", json=CHAT, headers=auth(KEYS[1]))
    text = "\n".join(f"{r.getMessage()} {r.args}" for r in caplog.records)
    assert "API keys: 2 configured" in text
    for secret in (*KEYS, "sk-wrong-guess"):
        assert secret not in text


@pytest.mark.parametrize(
    ("host", "level"),
    [("0.0.0.0", logging.WARNING), ("10.1.2.3", logging.WARNING), ("127.0.0.1", logging.INFO)],
)
async def test_an_open_v1_is_logged_and_warned_about_off_loopback(model_dir, caplog, host, level):
    cfg = router_cfg(model_dir)
    cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={"host": host})})
    caplog.set_level(logging.INFO, logger="pdserve.server.guard")
    async with router_harness(cfg, workers()):
        pass
    [record] = [r for r in caplog.records if "/v1 is open (no API key)" in r.getMessage()]
    assert record.levelno == level


async def test_openapi_declares_the_bearer_scheme_on_the_public_plane_only(cfg):
    async with router_harness(cfg, workers()) as h:
        schema = (await h.client.get("/openapi.json")).json()
    scheme = schema["components"]["securitySchemes"]["bearerAuth"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for path, item in schema["paths"].items():
        for op in item.values():
            secured = op.get("security") == [{"bearerAuth": []}]
            assert secured == (path.startswith("/v1/") or path in TOKENIZER_PATHS), path
            if secured:
                assert "401" in op["responses"], path


async def test_openapi_declares_every_status_a_route_returns(cfg):
    async with router_harness(cfg, workers()) as h:
        schema = (await h.client.get("/openapi.json")).json()
    paths = schema["paths"]
    statuses = {
        (path, method): set(op["responses"]) for path, item in paths.items() for method, op in
        item.items()
    }  # fmt: skip
    completion = {"200", "400", "401", "404", "413", "429", "500", "502", "503", "504"}
    assert statuses[("/v1/chat/completions", "post")] == completion
    assert statuses[("/v1/completions", "post")] == completion
    assert statuses[("/v1/models", "get")] == {"200", "401", "500"}
    assert statuses[("/ready", "get")] == {"200", "503"}
    assert statuses[("/health", "get")] == statuses[("/metrics", "get")] == {"200"}
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert "Retry-After" in chat["429"]["headers"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]
