"""The official ``openai`` client against a real uvicorn router with real fake-worker servers;
a client that disconnects mid-stream makes the router abort the decode leg and free P's blocks."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import RouterSettings
from pdserve.protocol import Role
from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness
from tests.support.servers import wait_until

REPLY_TEXT = "Hello from pdserve"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=256)


@pytest.fixture(scope="module")
def reply(model_dir):
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return [(i, tok.decode([i])) for i in tok.encode(REPLY_TEXT, add_special_tokens=False)]


@pytest.fixture
def cfg(model_dir):
    return RouterConfig(
        model_path=model_dir,
        served_model_name=MODEL,
        router=RouterSettings(request_timeout_s=30),
    )


def openai_client(url: str, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http
    )


async def test_openai_client_chat_and_completions_streamed_and_not(cfg, reply):
    workers = [FakeWorker("p0", Role.PREFILL, reply), FakeWorker("d0", Role.DECODE, reply)]
    async with (
        router_harness(cfg, workers, real_sockets=True) as h,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        client = openai_client(h.url, http)
        messages = [{"role": "user", "content": "hi"}]

        chat = await client.chat.completions.create(model=MODEL, messages=messages, seed=1)
        assert chat.choices[0].message.content == REPLY_TEXT
        assert chat.choices[0].finish_reason == "stop"
        assert chat.usage.completion_tokens == len(reply)

        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == REPLY_TEXT
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + len(reply)

        comp = await client.completions.create(model=MODEL, prompt="say", max_tokens=5, logprobs=2)
        assert comp.choices[0].text == REPLY_TEXT[:5]
        assert comp.choices[0].finish_reason == "length"
        assert comp.choices[0].logprobs.tokens == list(REPLY_TEXT[:5])

        stream = await client.completions.create(
            model=MODEL, prompt="say", stream=True, max_tokens=50
        )
        assert "".join([c.choices[0].text async for c in stream]) == REPLY_TEXT

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="other", messages=messages)
        with pytest.raises(openai.BadRequestError, match="n must lie in"):
            await client.chat.completions.create(model=MODEL, messages=messages, n=17)


async def test_client_disconnect_mid_stream_aborts_decode_and_releases_prefill(cfg, reply):
    long_reply = reply * 20
    workers = [
        FakeWorker("p0", Role.PREFILL, long_reply),
        FakeWorker("d0", Role.DECODE, long_reply, token_delay_s=0.05),
    ]
    async with router_harness(cfg, workers, real_sockets=True) as h:
        p, d = h.workers["p0"], h.workers["d0"]
        body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "stream": True}
        async with h.client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break  # leaving the block closes the connection mid-stream
        await wait_until(lambda: d.aborted and p.releases, 5.0, what="the abort and the release")
        request_id = p.contexts[0].request_id
        assert d.aborted == [request_id]
        assert [r.request_id for r in p.releases] == [request_id]

        # The router still serves.
        ok = await h.client.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert ok.status_code == 200


async def test_client_giving_up_on_a_non_streamed_request_aborts_decode(cfg, reply):
    long_reply = reply * 20
    workers = [
        FakeWorker("p0", Role.PREFILL, long_reply),
        FakeWorker("d0", Role.DECODE, long_reply, token_delay_s=0.05),
    ]
    async with router_harness(cfg, workers, real_sockets=True) as h:
        p, d = h.workers["p0"], h.workers["d0"]
        body = {"model": MODEL, "prompt": "go", "max_tokens": 200}
        with pytest.raises(httpx.ReadTimeout):
            await h.client.post("/v1/completions", json=body, timeout=0.5)
        await wait_until(lambda: d.aborted and p.releases, 5.0, what="the abort and the release")
        assert d.aborted == [p.contexts[0].request_id]
        assert [r.request_id for r in p.releases] == [p.contexts[0].request_id]
