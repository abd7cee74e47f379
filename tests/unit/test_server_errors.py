"""Bad input and failing workers: a JSON error body with the right status, and the server keeps
serving afterwards."""

from __future__ import annotations

import json

import pytest

from pdserve.config.loading import RouterConfig
from pdserve.errors import CapacityError, WorkerError
from pdserve.protocol import Role
from pdserve.server.chat.json_values import MAX_JSON_DEPTH
from tests.support.fakes import (
    MODEL,
    FakeWorker,
    build_tokenizer_dir,
    router_harness,
    short_worker_wait,
)

REPLY = [(72, "H"), (105, "i"), (33, "!")]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=64)


@pytest.fixture
def cfg(model_dir):
    return RouterConfig(model_path=model_dir, served_model_name=MODEL)


def workers(**decode_kw):
    return [
        FakeWorker("p0", Role.PREFILL, REPLY),
        FakeWorker("d0", Role.DECODE, REPLY, **decode_kw),
    ]


LONE = "@lone@"
"""In a body built by :func:`_raw`: a lone surrogate, JSON-escaped (``\\ud800``)."""
LONE_IN_TEXT = "@lone-in-text@"
"""In a JSON text inside a string of such a body (``arguments``): the same escape, escaped once
more, so the string is Unicode text and its decoded JSON is not."""

ARGUMENTS_LONE = '{"a": "' + LONE_IN_TEXT + '"}'


def _raw(body: dict[str, object]) -> bytes:
    """``body`` as JSON, with :data:`LONE` and :data:`LONE_IN_TEXT` written as their escapes
    (``json.dumps`` cannot write a lone surrogate's escape)."""
    text = json.dumps(body).replace(LONE_IN_TEXT, "\\\\ud800")
    return text.replace(LONE, "\\ud800").encode()


def _chat(**fields: object) -> bytes:
    return _raw({**CHAT, **fields})


def _responses(**fields: object) -> bytes:
    return _raw({"model": MODEL, "input": "hi", **fields})


def _tokenize(**fields: object) -> bytes:
    return _raw({"model": MODEL, "messages": CHAT["messages"], **fields})


def _tool(parameters: dict[str, object]) -> dict[str, object]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _called(arguments: str) -> list[dict[str, object]]:
    """A history whose assistant message called ``f`` with ``arguments`` (JSON text)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [CHAT["messages"][0], {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"}]  # fmt: skip


def _deep(levels: int) -> dict[str, object]:
    """A JSON Schema ``levels`` deep (each property's schema one object in another)."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range((levels - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema if levels % 2 else {"type": "array", "items": schema}


BAD_REQUESTS = [
    # (path, body (dict or raw bytes), status, code, param, message fragment)
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model_not_found", "model", "nope"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "invalid_request", "messages", "empty"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 60}, 400, "context_length_exceeded",
     "max_tokens", "maximum context length is 64"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 70}, 400, "context_length_exceeded",
     "max_tokens", "(70 in the prompt, 16 in the completion)"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "many"}, 400, "invalid_request",
     "max_tokens", "integer"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "invalid_request", "temperature",
     "less than or equal to 2"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400,
     "invalid_request", "messages[0].content", ""),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "invalid_request", "messages[0].role", ""),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "invalid_request", "model",
     "required"),
    ("/v1/chat/completions", b'{"model": "tiny-test", "messages": [', 400, "invalid_request",
     None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_request", None, ""),
    ("/v1/chat/completions", {**CHAT, "n": 17}, 400, "invalid_request", "n", "n must lie in"),
    ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy"}}, 400,
     "unsupported", "audio", "not supported"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema":
     {"name": "x", "schema": {"type": "nope"}}}}, 400, "invalid_request",
     "response_format.json_schema.schema", "does not compile"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, 400, "invalid_request",
     "presence_penalty", "less than or equal to 2"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "invalid_request",
     "top_logprobs", "requires logprobs"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "unsupported", "messages[0].content", "only text"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "invalid_request",
     "prompt[1]", "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 65}, 400, "invalid_request",
     "prompt", ""),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "invalid_request",
     "prompt", "token ids must be in"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "invalid_request", "prompt",
     "empty"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 1}, 400, "unsupported",
     "prompt_logprobs", "not supported"),
    # A lone surrogate (valid JSON, no Unicode text): refused by the schema, not a 500.
    ("/v1/chat/completions",
     b'{"model": "tiny-test", "messages": [{"role": "user", "content": "hi \\ud800"}]}', 400,
     "invalid_request", "messages[0].content", "lone surrogate"),
    ("/v1/chat/completions",
     b'{"model": "tiny-test", "messages": [{"role": "user", "content": [{"type": "text", '
     b'"text": "\\udfff"}]}]}', 400, "invalid_request", "messages[0].content[0].text",
     "lone surrogate"),
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "\\ud83d x"}', 400,
     "invalid_request", "prompt", "lone surrogate"),
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "x", "stop": ["\\udc00"]}', 400,
     "invalid_request", "stop[0]", "valid string"),
    # ... anywhere else too: free-form JSON, JSON text (escaped once more), echoed fields; and
    # free-form JSON nested past MAX_JSON_DEPTH (was: 500 "Maximum serialization depth").
    ("/v1/chat/completions", _chat(tools=[_tool({"type": "object", "description": LONE})]),
     400, "invalid_request", "tools[0].function.parameters", "at description: not valid Unicode"),
    ("/v1/chat/completions", _chat(tools=[_tool({"properties": {LONE: {}}})]), 400,
     "invalid_request", "tools[0].function.parameters", "a key in properties"),
    ("/v1/chat/completions", _chat(tools=[_tool(_deep(MAX_JSON_DEPTH + 1))]), 400,
     "invalid_request", "tools[0].function.parameters", f"more than {MAX_JSON_DEPTH} levels"),
    ("/v1/chat/completions", _chat(messages=_called(ARGUMENTS_LONE)), 400,
     "invalid_request", "messages[1].tool_calls[0].function.arguments", "lone surrogate"),
    ("/v1/chat/completions", _chat(messages=_called("[" * 100_000 + "]" * 100_000)), 400,
     "invalid_request", "messages[1].tool_calls[0].function.arguments", "levels deep"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
     "name": "x", "schema": _deep(MAX_JSON_DEPTH + 1)}}), 400, "invalid_request",
     "response_format.json_schema.schema", "levels deep"),
    ("/v1/chat/completions", _chat(user=LONE), 400, "invalid_request", "user",
     "lone surrogate"),
    ("/v1/chat/completions", _chat(metadata={"k": [LONE]}), 400, "invalid_request",
     "metadata", "at k[0]: not valid Unicode"),
    ("/v1/chat/completions", _chat(chat_template_kwargs={"x": LONE}), 400,
     "invalid_request", "chat_template_kwargs", "lone surrogate"),
    ("/v1/chat/completions", _chat(guided_json={"description": LONE}), 400,
     "invalid_request", "guided_json", "lone surrogate"),
    ("/v1/responses", _responses(user=LONE), 400, "invalid_request", "user",
     "lone surrogate"),
    ("/v1/responses", _responses(input=[{"role": "user", "content": "hi"}, {
     "type": "function_call", "call_id": "c1", "name": "f", "arguments": ARGUMENTS_LONE}, {
     "type": "function_call_output", "call_id": "c1", "output": "x"}]), 400, "invalid_request",
     "input[1].arguments", "lone surrogate"),
    ("/v1/responses", _responses(tools=[{"type": "function", "name": "f",
     "parameters": {"enum": [LONE]}}]), 400, "invalid_request", "tools[0].parameters",
     "at enum[0]: not valid Unicode"),
    ("/v1/responses", _responses(tools=[{"type": "function", "name": "f",
     "parameters": _deep(MAX_JSON_DEPTH + 1)}]), 400, "invalid_request",
     "tools[0].parameters", "levels deep"),
    ("/v1/responses", _responses(text={"format": {"type": "json_schema", "name": "x",
     "schema": {"title": LONE}}}), 400, "invalid_request", "text.format.schema",
     "lone surrogate"),
    ("/tokenize", _tokenize(tools=[_tool(_deep(MAX_JSON_DEPTH + 1))]), 400, "invalid_request",
     "tools[0].function.parameters", "levels deep"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "code", "param", "fragment"), BAD_REQUESTS)
async def test_bad_input_is_a_4xx_json_error_and_the_server_keeps_serving(
    cfg, path, body, status, code, param, fragment
):
    async with router_harness(cfg, workers()) as h:
        if isinstance(body, bytes):
            r = await h.client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
        else:
            r = await h.client.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert (err["code"], err["param"]) == (code, param)
        assert fragment in err["message"]
        assert h.workers["p0"].contexts == []  # nothing reached a worker

        ok = await h.client.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"] == "Hi!"


async def test_unknown_route_is_a_json_404(cfg):
    async with router_harness(cfg, workers()) as h:
        r = await h.client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


async def test_no_workers_is_a_503(cfg):
    async with router_harness(short_worker_wait(cfg), []) as h:
        r = await h.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_worker"
    message = r.json()["error"]["message"]
    assert "no live decode or colocated worker serves model 'tiny-test'" in message


def logged(caplog: pytest.LogCaptureFixture, rid: str, fragment: str) -> bool:
    """Whether the router logged ``fragment`` on a line naming request ``rid``."""
    return any(rid in r.getMessage() and fragment in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_error_is_an_error_status_with_the_worker_envelope(cfg, stream, caplog):
    ws = workers()
    ws[0].error = CapacityError("prefill worker is draining")
    async with router_harness(cfg, ws) as h:
        r = await h.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == "no_capacity" and err["message"] == CapacityError.public_text
    assert logged(
        caplog, err["request_id"], "prefill worker p0 answered HTTP 503: prefill worker is draining"
    )


async def test_decode_error_mid_stream_is_an_sse_error_event_then_done(cfg, caplog):
    ws = workers(fail_after=1)
    async with router_harness(short_worker_wait(cfg), ws) as h:  # no other worker to migrate to
        r = await h.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    datas = [b[len("data: ") :] for b in r.text.split("\n\n") if b.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    err = json.loads(datas[-2])["error"]
    assert err["code"] == "worker_error" and err["message"] == WorkerError.public_text
    assert err["request_id"] == r.headers["x-request-id"]
    assert logged(caplog, err["request_id"], "KV transfer from the prefill worker failed")
    content = [json.loads(d)["choices"][0]["delta"].get("content") for d in datas[1:-2]]
    assert content == ["H", "i"]
    releases = h.workers["p0"].releases
    assert len(releases) == 1 and releases[0].epoch == 7


async def test_decode_error_without_streaming_is_a_502(cfg, caplog):
    ws = workers(error=WorkerError("decode engine died"))
    async with router_harness(short_worker_wait(cfg), ws) as h:  # no other worker to migrate to
        r = await h.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 502
    assert r.json()["error"]["message"] == WorkerError.public_text
    assert logged(caplog, r.json()["error"]["request_id"], "decode engine died")
    assert len(h.workers["p0"].releases) == 1


def _app_raising(exc: Exception):  # type: ignore[no-untyped-def]
    from fastapi import FastAPI

    from pdserve.http.error_responses import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise exc

    return app


async def _get(app, path: str, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    import httpx

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path, headers=headers)


async def test_an_unexpected_exception_is_a_generic_500_naming_only_the_request_id(caplog):
    app = _app_raising(RuntimeError("secret"))
    with caplog.at_level("ERROR", logger="pdserve.http.error_responses"):
        r = await _get(app, "/boom", {"X-Request-Id": "client-42"})
    assert r.status_code == 500
    assert "secret" not in r.text and "RuntimeError" not in r.text
    err = r.json()["error"]
    assert err["message"] == "internal error (request id client-42)"
    assert err["request_id"] == "client-42" and r.headers["x-request-id"] == "client-42"
    logged = [rec for rec in caplog.records if "client-42" in rec.getMessage()]
    assert logged and logged[0].exc_info is not None, "logged with its traceback and the id"


async def test_without_a_client_request_id_one_is_generated_and_returned():
    r = await _get(_app_raising(RuntimeError("secret")), "/boom")
    rid = r.headers["x-request-id"]
    assert rid.startswith("req-") and r.json()["error"]["request_id"] == rid
    assert rid in r.json()["error"]["message"] and "secret" not in r.text


@pytest.mark.parametrize(
    "given",
    ["a req chatcmpl-victim1", 'x" level="ERROR', "ok\tid", "na\xc3\xafve", "x" * 129, "a=b"],
)
async def test_a_client_request_id_that_could_fake_log_fields_is_replaced(given, caplog):
    header = given.encode("latin-1")  # as sent on the wire (the UTF-8 bytes of "naïve")
    with caplog.at_level("WARNING", logger="pdserve.http.error_responses"):
        r = await _get(_app_raising(CapacityError("busy")), "/boom", {"X-Request-Id": header})
    rid = r.headers["x-request-id"]
    assert rid.startswith("req-") and r.json()["error"]["request_id"] == rid
    (line,) = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert given not in line.getMessage()


@pytest.mark.parametrize(
    "given", ["550e8400-e29b-41d4-a716-446655440000", "req_01HZX.trace:span-2", "a" * 128]
)
async def test_a_client_request_id_of_id_characters_is_kept(given):
    r = await _get(_app_raising(CapacityError("busy")), "/boom", {"X-Request-Id": given})
    assert r.headers["x-request-id"] == given == r.json()["error"]["request_id"]


async def test_typed_errors_and_unknown_routes_carry_the_request_id_too():
    r = await _get(_app_raising(CapacityError("busy")), "/boom", {"X-Request-Id": "abc"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "busy"
    assert r.json()["error"]["request_id"] == "abc" and r.headers["x-request-id"] == "abc"
    missing = await _get(_app_raising(CapacityError("busy")), "/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["request_id"] == missing.headers["x-request-id"]


async def test_router_4xx_errors_carry_the_clients_request_id(cfg):
    async with router_harness(cfg, workers()) as h:
        r = await h.client.post(
            "/v1/chat/completions", json={**CHAT, "model": "nope"}, headers={"X-Request-Id": "r-7"}
        )
    assert r.status_code == 404
    assert r.json()["error"]["request_id"] == "r-7" and r.headers["x-request-id"] == "r-7"
