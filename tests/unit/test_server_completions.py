"""OpenAI chat and text completions through the router app, streamed and not (in-process)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pdserve.config.loading import RouterConfig
from pdserve.protocol import Role
from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness

REPLY_TEXT = "Hi there!"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=128)


@pytest.fixture(scope="module")
def reply(model_dir):
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return [(i, tok.decode([i])) for i in tok.encode(REPLY_TEXT, add_special_tokens=False)]


@pytest.fixture
def cfg(model_dir):
    return RouterConfig(model_path=model_dir, served_model_name=MODEL)


@pytest.fixture
def workers(reply):
    return [FakeWorker("p0", Role.PREFILL, reply), FakeWorker("d0", Role.DECODE, reply)]


def sse_events(text: str) -> list:
    """Parse an SSE body; asserts it ends with [DONE]."""
    datas = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]", datas[-3:]
    return [json.loads(d) for d in datas[:-1]]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


async def test_chat_completion_returns_the_text_and_usage(cfg, workers):
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY_TEXT}
    assert choice["finish_reason"] == "stop"
    prompt_ids = h.workers["p0"].contexts[0].prompt_token_ids
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(REPLY_TEXT),
        "total_tokens": len(prompt_ids) + len(REPLY_TEXT),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_chat_prompt_goes_through_the_chat_template(cfg, workers, model_dir):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    prompt = tok.decode(list(h.workers["p0"].contexts[0].prompt_token_ids))
    assert prompt == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


async def test_chat_without_max_tokens_may_use_the_rest_of_the_context_window(cfg, workers):
    async with router_harness(cfg, workers) as h:
        await h.client.post("/v1/chat/completions", json=CHAT)
    ctx = h.workers["p0"].contexts[0]
    assert ctx.sampling.max_tokens == 128 - len(ctx.prompt_token_ids)


async def test_sampling_fields_reach_the_workers(cfg, workers):
    body = {
        **CHAT,
        "max_completion_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 11,
        "stop": "\n",
        "user": "ignored",
        "some_future_field": {"x": 1},
    }
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    s = h.workers["p0"].contexts[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (
        5,
        0.5,
        0.9,
        40,
        11,
        ("\n",),
    )
    assert h.workers["d0"].generations[0].sampling == s
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"] == REPLY_TEXT[:5]


async def test_streamed_chat_sends_role_then_deltas_then_done(cfg, workers):
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == REPLY_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in chunks[-1]


async def test_streamed_chat_with_include_usage_ends_with_a_usage_chunk(cfg, workers):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json=body)
    chunks = sse_events(r.text)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(REPLY_TEXT)
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_text_completion_from_a_string_and_from_token_ids(cfg, workers):
    async with router_harness(cfg, workers) as h:
        r1 = await h.client.post("/v1/completions", json={"model": MODEL, "prompt": "abc"})
        r2 = await h.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
        )
    body = r1.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == REPLY_TEXT
    assert body["usage"]["prompt_tokens"] == 3
    assert h.workers["p0"].contexts[0].sampling.max_tokens == 16  # OpenAI's default
    assert h.workers["p0"].contexts[1].prompt_token_ids == (5, 6, 7)
    assert r2.json()["choices"][0] == {
        "index": 0,
        "text": REPLY_TEXT[:3],
        "logprobs": None,
        "finish_reason": "length",
    }


async def test_streamed_text_completion_ends_with_done(cfg, workers):
    body = {"model": MODEL, "prompt": ["abc"], "stream": True}
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/completions", json=body)
    chunks = sse_events(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_first_token_that_finishes_skips_decode(cfg, reply):
    workers = [FakeWorker("p0", Role.PREFILL, reply), FakeWorker("d0", Role.DECODE, reply)]
    async with router_harness(cfg, workers) as h:
        r = await h.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        )
    assert r.json()["choices"][0]["text"] == REPLY_TEXT[0]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 1
    assert h.workers["d0"].generations == []


async def test_chat_logprobs_in_openai_format(cfg, workers):
    body = {**CHAT, "logprobs": True, "top_logprobs": 2, "max_tokens": 2}
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json=body)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "i"]
    first = content[0]
    assert first["logprob"] == -0.25 and first["bytes"] == [ord("H")]
    assert [t["token"] for t in first["top_logprobs"]] == ["H", "!"]
    assert first["top_logprobs"][1] == {"token": "!", "logprob": -2.5, "bytes": [ord("!")]}
    assert h.workers["p0"].contexts[0].sampling.top_logprobs == 2


async def test_streamed_chat_logprobs_ride_along_each_delta(cfg, workers):
    body = {**CHAT, "logprobs": True, "max_tokens": 3, "stream": True}
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json=body)
    chunks = sse_events(r.text)[1:]
    tokens = [lp["token"] for c in chunks for lp in c["choices"][0]["logprobs"]["content"]]
    assert tokens == ["H", "i", " "]


async def test_completion_logprobs_in_openai_format(cfg, workers):
    body = {"model": MODEL, "prompt": "x", "logprobs": 1, "max_tokens": 3}
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/completions", json=body)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {
        "tokens": ["H", "i", " "],
        "token_logprobs": [-0.25, -0.25, -0.25],
        "top_logprobs": [{"H": -0.25}, {"i": -0.25}, {" ": -0.25}],
        "text_offset": [0, 1, 2],
    }


async def test_router_loads_the_shared_tiny_model_folder(tiny_model_dir, reply):
    cfg = RouterConfig(model_path=tiny_model_dir, served_model_name=MODEL)
    workers = [FakeWorker("p0", Role.PREFILL, reply), FakeWorker("d0", Role.DECODE, reply)]
    async with router_harness(cfg, workers) as h:
        r = await h.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        models = (await h.client.get("/v1/models")).json()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == REPLY_TEXT[:3]
    assert models["data"][0]["max_model_len"] > 0


@pytest.mark.parametrize("local_prefill", [False, True])
async def test_cached_tokens_come_from_the_worker_that_prefilled_the_prompt(
    model_dir, reply, local_prefill: bool
) -> None:
    """Handed off, the prefill worker's count is reported; prefilled on the decode worker (a
    short prompt under local prefill), the decode worker's; streamed, in the usage chunk."""
    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL)
    if local_prefill:
        cfg = cfg.model_copy(
            update={"router": cfg.router.model_copy(update={"local_prefill_max_tokens": 10_000})}
        )
    p = FakeWorker("p0", Role.PREFILL, reply, cached_tokens=16)
    d = FakeWorker("d0", Role.DECODE, reply, cached_tokens=8)
    async with router_harness(cfg, [p, d]) as h:
        whole = await h.client.post("/v1/chat/completions", json=CHAT)
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        streamed = sse_events((await h.client.post("/v1/chat/completions", json=body)).text)
    want = 8 if local_prefill else 16
    assert whole.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": want}
    assert streamed[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": want}
    assert (len(p.contexts) == 0) is local_prefill


async def test_a_list_of_prompts_runs_each_with_its_choices_in_order(cfg, workers) -> None:
    """(The fake workers serve one choice; n > 1 per prompt: tests/e2e/test_stack_n_choices.)"""
    prompts = ["alpha", "beta", "gamma"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 16, "echo": True}
    async with router_harness(cfg, workers) as h:
        whole = await h.client.post("/v1/completions", json=body)
        streamed = await h.client.post("/v1/completions", json={**body, "stream": True,
                                       "stream_options": {"include_usage": True}})  # fmt: skip
        sent = [c.prompt_token_ids for c in h.workers["p0"].contexts]
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    assert [c["index"] for c in choices] == list(range(3))
    # choice k belongs to prompt k; echo puts the prompt first
    assert [c["text"] for c in choices] == [p + REPLY_TEXT for p in prompts]
    assert sorted(map(len, sent)) == sorted(len(p) for p in prompts for _ in range(2))
    usage = whole.json()["usage"]
    assert usage["completion_tokens"] == 3 * len(REPLY_TEXT)
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    events = sse_events(streamed.text)
    texts: dict[int, str] = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in choices]
    assert events[-1]["usage"] == usage
