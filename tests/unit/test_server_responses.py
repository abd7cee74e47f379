"""``POST /v1/responses`` through the router (in-process, fake workers): the request mapped onto
the chat machinery (the prompt the prefill worker receives), the response object and its output
items, the refusals naming the field, the stream's events; then the official ``openai`` client
against a real uvicorn router."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import RouterSettings
from pdserve.errors import WorkerError
from pdserve.protocol import Role
from tests.support.fakes import FakeWorker, build_tokenizer_dir, router_harness, short_worker_wait
from tests.support.servers import wait_until

MODEL = "tiny-test"
CALL_TEXT = (
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
HELLO = "Hello from the Responses API."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=4096)


def _replies(text: str) -> list[tuple[int, str]]:
    """The fake workers' reply: ``text`` in pieces of 5 characters (token ids are arbitrary)."""
    return [(65 + i % 20, text[i : i + 5]) for i in range(0, len(text), 5)]


def _workers(reply: str, **decode: Any) -> list[FakeWorker]:
    return [
        FakeWorker("p0", Role.PREFILL, _replies(reply)),
        FakeWorker("d0", Role.DECODE, _replies(reply), **decode),
    ]


async def _post(
    model_dir: Any, body: dict[str, Any], reply: str = HELLO, **decode: Any
) -> tuple[httpx.Response, FakeWorker]:
    """POST ``body`` (with the model) to /v1/responses; the answer and the prefill worker. A
    failing decode worker (``decode``) has no other to migrate to: the router waits for one a
    fraction of a second, not 30 s."""
    cfg = short_worker_wait(RouterConfig(model_path=model_dir, served_model_name=MODEL))
    workers = _workers(reply, **decode)
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/responses", json={"model": MODEL, **body})
    return r, workers[0]


def _prompt(model_dir: Any, worker: FakeWorker) -> str:
    """The prompt text the prefill worker was sent."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return str(tok.decode(worker.contexts[0].prompt_token_ids))


def _output_text(resp: dict[str, Any]) -> str:
    """What the openai client's ``output_text`` computes: every message's output_text."""
    return "".join(
        part["text"]
        for item in resp["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    """The SSE events of a stream, each checked to be ``event: <type>`` + its data."""
    assert r.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in r.text.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        out.append(event)
    assert "[DONE]" not in r.text, "the Responses API sends no [DONE]"
    return out


def _shape(resp: dict[str, Any]) -> dict[str, Any]:
    """A response without what differs between two runs (ids, times)."""
    out = {k: v for k, v in resp.items() if k not in ("id", "created_at")}
    out["output"] = [{k: v for k, v in it.items() if k not in ("id", "call_id")}
                     for it in resp["output"]]  # fmt: skip
    return out


# --- whole responses ----------------------------------------------------------------------------


async def test_a_string_input_is_one_user_message_and_the_reply_one_message(model_dir: Any) -> None:
    r, prefill = await _post(model_dir, {"input": "What is new?", "store": False})
    assert r.status_code == 200, r.text
    resp = r.json()
    assert resp["object"] == "response" and resp["id"].startswith("resp_")
    assert r.headers["x-request-id"] == resp["id"] == prefill.contexts[0].request_id
    assert (resp["status"], resp["incomplete_details"], resp["error"]) == ("completed", None, None)
    (item,) = resp["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert (item["role"], item["status"]) == ("assistant", "completed")
    assert item["content"] == [{"type": "output_text", "text": HELLO, "annotations": []}]
    assert _prompt(model_dir, prefill).endswith(
        "<|im_start|>user\nWhat is new?<|im_end|>\n<|im_start|>assistant\n"
    )
    usage = resp["usage"]
    assert usage["input_tokens"] == len(prefill.contexts[0].prompt_token_ids)
    assert usage["output_tokens"] == len(_replies(HELLO))
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    # The echo of the request's (effective) settings.
    assert resp["store"] is False and resp["metadata"] == {} and resp["tools"] == []
    assert (resp["temperature"], resp["top_p"], resp["tool_choice"]) == (1.0, 1.0, "auto")
    assert resp["text"] == {"format": {"type": "text"}} and resp["parallel_tool_calls"] is True


async def test_instructions_and_a_message_list_reach_the_prompt_in_order(model_dir: Any) -> None:
    body = {
        "instructions": "Answer in French.",
        "input": [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": "Hi!"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Salut."}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather?"},
                    {"type": "input_text", "text": "In Lyon."},
                ],
            },
        ],  # fmt: skip
        "max_output_tokens": 100,
        "temperature": 0.5,
        "metadata": {"trace": "t-1"},
        "user": "u-7",
    }
    r, prefill = await _post(model_dir, body)
    assert r.status_code == 200, r.text
    assert _prompt(model_dir, prefill) == (
        "<|im_start|>system\nAnswer in French.<|im_end|>\n"
        "<|im_start|>developer\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nSalut.<|im_end|>\n"
        "<|im_start|>user\nWeather?\nIn Lyon.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    sampling = prefill.contexts[0].sampling
    assert (sampling.max_tokens, sampling.temperature) == (100, 0.5)
    resp = r.json()
    assert (resp["instructions"], resp["max_output_tokens"], resp["temperature"]) == (
        "Answer in French.",
        100,
        0.5,
    )
    assert (resp["metadata"], resp["user"]) == ({"trace": "t-1"}, "u-7")


async def test_max_output_tokens_cuts_the_reply_and_the_response_is_incomplete(
    model_dir: Any,
) -> None:
    r, prefill = await _post(model_dir, {"input": "Talk.", "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    resp = r.json()
    assert prefill.contexts[0].sampling.max_tokens == 3
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = resp["output"]
    assert item["status"] == "incomplete" and _output_text(resp) == HELLO[:15]
    assert resp["usage"]["output_tokens"] == 3


async def test_an_auto_tool_call_is_a_function_call_item(model_dir: Any) -> None:
    r, prefill = await _post(
        model_dir, {"input": "Weather in Paris?", "tools": [WEATHER]}, CALL_TEXT
    )
    assert r.status_code == 200, r.text
    resp = r.json()
    message, call = resp["output"]
    assert message["type"] == "message" and _output_text(resp) == "Checking."
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert resp["status"] == "completed" and resp["tools"][0]["name"] == "get_weather"
    prompt = _prompt(model_dir, prefill)
    assert '"name": "get_weather"' in prompt and "The weather in a city." in prompt
    assert "<tool_call>" in prompt, "pdserve's default tool prompt (the template has no tools)"


async def test_a_named_tool_choice_constrains_to_that_function(model_dir: Any) -> None:
    args = '{"city": "Oslo"}'
    body = {"input": "Oslo?", "tools": [WEATHER], "tool_choice": {"type": "function",
            "name": "get_weather"}, "parallel_tool_calls": False}  # fmt: skip
    r, prefill = await _post(model_dir, body, args)
    assert r.status_code == 200, r.text
    resp = r.json()
    (call,) = resp["output"]
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "get_weather", args)
    structured = prefill.contexts[0].sampling.structured
    assert structured is not None and json.loads(structured.spec) == WEATHER["parameters"]
    assert resp["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert resp["parallel_tool_calls"] is False


async def test_function_call_and_its_output_reach_the_prompt(model_dir: Any) -> None:
    body = {
        "tools": [WEATHER],
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "18C, sunny"},
        ],  # fmt: skip
    }
    r, prefill = await _post(model_dir, body)
    assert r.status_code == 200, r.text
    prompt = _prompt(model_dir, prefill)
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert call in prompt, prompt
    assert "<|im_start|>tool\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in prompt
    assert prompt.index("Weather in Paris?") < prompt.index(call) < prompt.index("18C, sunny")
    assert _output_text(r.json()) == HELLO


async def test_a_previous_responses_output_items_can_be_sent_back_as_input(model_dir: Any) -> None:
    first, _ = await _post(model_dir, {"input": "Weather in Paris?", "tools": [WEATHER]}, CALL_TEXT)
    output = first.json()["output"]  # message "Checking." + function_call, ids and statuses
    assert [it["type"] for it in output] == ["message", "function_call"]
    result = {"type": "function_call_output", "call_id": output[1]["call_id"], "output": "18C"}
    body = {"tools": [WEATHER], "input": [{"role": "user", "content": "Weather in Paris?"},
                                          *output, result]}  # fmt: skip
    r, prefill = await _post(model_dir, body)
    assert r.status_code == 200, r.text
    prompt = _prompt(model_dir, prefill)
    turn = (
        "<|im_start|>assistant\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
    )
    assert turn in prompt, "the message and its call are one assistant turn, then the result"


async def test_a_json_schema_text_format_constrains_the_output(model_dir: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    r, prefill = await _post(model_dir, {"input": "JSON!", "text": {"format": fmt}}, '{"a":1}')
    assert r.status_code == 200, r.text
    structured = prefill.contexts[0].sampling.structured
    assert structured is not None and json.loads(structured.spec) == schema
    assert json.loads(_output_text(r.json())) == {"a": 1}
    assert r.json()["text"] == {"format": fmt}


IMAGE = {"type": "input_image", "image_url": "https://example.com/cat.png"}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"store": True}, "store", "unsupported"),
        ({"previous_response_id": "resp_123"}, "previous_response_id", "unsupported"),
        ({"conversation": "conv_1"}, "conversation", "unsupported"),
        ({"background": True}, "background", "unsupported"),
        ({"include": ["message.output_text.logprobs"]}, "include", "unsupported"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported"),
        ({"input": [{"role": "user", "content": "Hi"}, {"role": "user", "content": [IMAGE]}]},
         "input[1].content[0].type", "unsupported"),
        ({"input": [{"role": "user", "content": "Hi"}, IMAGE]}, "input[1].type", "unsupported"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
         "text.format.schema", "invalid_request"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
         "invalid_request"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "invalid_request"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "context_length_exceeded"),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_request"),
        ({"input": [{"role": "user"}]}, "input[0].content", "invalid_request"),
        ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c",
          "name": "get_weather", "arguments": "{oops"}]}, "input[1].arguments", "invalid_request"),
        ({"input": [{"type": "function_call_output", "output": "18C"}]}, "input[0].call_id",
         "invalid_request"),
        ({"tools": [{**WEATHER, "name": "bad name!"}]}, "tools[0].name", "invalid_request"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_request"),
        ({"input": []}, "input", "invalid_request"),
        ({"temperature": 3}, "temperature", "invalid_request"),
        ({"model": "other"}, "model", "model_not_found"),
    ],
)  # fmt: skip
async def test_a_refused_or_invalid_request_is_an_error_naming_the_field(
    model_dir: Any, body: dict[str, Any], param: str, code: str
) -> None:
    r, prefill = await _post(model_dir, {"input": "Hi", **body})
    assert r.status_code == (404 if code == "model_not_found" else 400), r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert prefill.contexts == [], "nothing reached a worker"
    if code == "unsupported" and param in ("store", "previous_response_id"):
        assert "storing responses is not supported yet" in error["message"]
    if code == "context_length_exceeded":
        assert "max_output_tokens" in error["message"] and "max_tokens" not in error["message"]


# --- streams -----------------------------------------------------------------------------------

TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * len(_replies(HELLO)),
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


async def test_a_stream_sends_the_events_of_a_message_and_ends_with_the_response(
    model_dir: Any,
) -> None:
    r, _ = await _post(model_dir, {"input": "Hi", "stream": True})
    assert r.status_code == 200, r.text
    events = _events(r)
    assert [e["type"] for e in events] == TEXT_EVENTS
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None
    added = events[2]["item"]
    assert (added["type"], added["status"], added["content"]) == ("message", "in_progress", [])
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(e["item_id"] == added["id"] and e["output_index"] == 0 for e in deltas)
    assert "".join(e["delta"] for e in deltas) == HELLO
    assert events[-4]["text"] == HELLO and events[-3]["part"]["text"] == HELLO
    assert events[-2]["item"]["status"] == "completed"
    final = events[-1]["response"]
    assert final["id"] == created["id"] and final["output"] == [events[-2]["item"]]
    whole, _ = await _post(model_dir, {"input": "Hi"})
    assert _shape(final) == _shape(whole.json()), "the same response streamed or not"


async def test_a_streamed_tool_call_is_a_function_call_item_with_argument_deltas(
    model_dir: Any,
) -> None:
    body = {"input": "Weather in Paris?", "tools": [WEATHER], "stream": True}
    r, _ = await _post(model_dir, body, CALL_TEXT)
    events = _events(r)
    types = [e["type"] for e in events]
    assert types[:4] == TEXT_EVENTS[:4] and types[-1] == "response.completed"
    call_added = [e for e in events if e["type"] == "response.output_item.added"][1]
    assert call_added["output_index"] == 1
    assert call_added["item"]["type"] == "function_call" and call_added["item"]["arguments"] == ""
    i = types.index("response.output_item.added", 3)
    assert types[i - 3 : i] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ], "the message is done before the call starts"
    arguments = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert json.loads(arguments) == {"city": "Paris"}
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == arguments and done["item_id"] == call_added["item"]["id"]
    assert types[-2] == "response.output_item.done"
    assert events[-2]["item"] == {**call_added["item"], "arguments": arguments,
                                  "status": "completed"}  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    whole, _ = await _post(model_dir, {**body, "stream": False}, CALL_TEXT)
    assert _shape(events[-1]["response"]) == _shape(whole.json())


async def test_a_stream_cut_by_max_output_tokens_ends_incomplete(model_dir: Any) -> None:
    r, _ = await _post(model_dir, {"input": "Hi", "stream": True, "max_output_tokens": 2})
    events = _events(r)
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete" and _output_text(final) == HELLO[:10]


async def test_a_failure_mid_stream_ends_with_an_error_and_response_failed(model_dir: Any) -> None:
    r, _ = await _post(model_dir, {"input": "Hi", "stream": True}, fail_after=1)
    assert r.status_code == 200, "the status was sent before the failure"
    events = _events(r)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    error = events[-2]
    assert error["code"] == "worker_error"
    assert error["message"] == WorkerError.public_text, "the public message names nothing inside"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["error"]["message"] == error["message"]
    (item,) = failed["output"]
    assert item["status"] == "incomplete" and _output_text(failed) == HELLO[:10]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_the_route_is_in_the_openapi_document_with_its_statuses(model_dir: Any) -> None:
    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL)
    async with router_harness(cfg, _workers(HELLO)) as h:
        doc = (await h.client.get("/openapi.json")).json()
    op = doc["paths"]["/v1/responses"]["post"]
    assert set(op["responses"]) == {"200", "400", "404", "413", "429", "500", "502", "503", "504"}
    assert "text/event-stream" in op["responses"]["200"]["content"]
    body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    assert {"model", "input", "store"} <= set(doc["components"]["schemas"][body]["properties"])


# --- the official client ------------------------------------------------------------------------


async def test_the_openai_client_creates_streams_and_disconnects(model_dir: Any) -> None:
    cfg = RouterConfig(
        model_path=model_dir, served_model_name=MODEL, router=RouterSettings(request_timeout_s=30)
    )
    async with (
        router_harness(cfg, _workers(HELLO), real_sockets=True) as h,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        client = openai.AsyncOpenAI(
            base_url=f"{h.url}/v1", api_key="unused", max_retries=0, http_client=http
        )
        resp = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=50)
        assert resp.output_text == HELLO and resp.status == "completed"
        assert resp.usage is not None and resp.usage.output_tokens == len(_replies(HELLO))

        stream = await client.responses.create(model=MODEL, input="Hi", stream=True)
        events = [e async for e in stream]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].type == "response.completed" and deltas == HELLO
        assert events[-1].response.output_text == HELLO

        async with client.responses.stream(model=MODEL, input="Hi") as helper:
            final = await helper.get_final_response()
        assert final.output_text == HELLO and final.id.startswith("resp_")

        with pytest.raises(openai.BadRequestError, match="storing responses is not supported"):
            await client.responses.create(model=MODEL, input="Hi", store=True)

    # A client that leaves mid-stream: the decode leg is aborted and P's blocks released.
    long = HELLO * 40
    workers = _workers(long, token_delay_s=0.05)
    async with router_harness(cfg, workers, real_sockets=True) as h:
        p, d = h.workers["p0"], h.workers["d0"]
        body = {"model": MODEL, "input": "go", "stream": True}
        async with h.client.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            deltas = 0
            async for line in r.aiter_lines():
                deltas += line == "event: response.output_text.delta"
                if deltas == 3:  # the decode worker is streaming
                    break  # leaving the block closes the connection mid-stream
        await wait_until(lambda: d.aborted and p.releases, 5.0, what="the abort and the release")
        assert d.aborted == [p.contexts[0].request_id]
        assert [x.request_id for x in p.releases] == [p.contexts[0].request_id]
