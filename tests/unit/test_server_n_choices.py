"""``n`` choices per request through the router app and the two-leg transaction, against
scripted workers that answer every choice (in-process ASGI, no sockets)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from transformers import AutoTokenizer

from pdserve.config.loading import RouterConfig
from pdserve.config.settings import RouterSettings
from pdserve.errors import WorkerError
from pdserve.protocol import (
    ContextRequest,
    ContextResponse,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ReleaseRequest,
    Role,
    SamplingParams,
)
from pdserve.router.client import WorkerClient
from pdserve.router.router import Router
from pdserve.router.transaction import TxnState
from pdserve.router.view import WorkerView
from tests.support.fakes import (
    CLUSTER_KEY,
    MODEL,
    FakeWatcher,
    FakeWorker,
    build_tokenizer_dir,
    fake_handle,
    router_harness,
    short_worker_wait,
)

Reply = list[tuple[int, str]]


@dataclass
class ChoicesWorker(FakeWorker):
    """A scripted worker that answers ``n`` choices: choice ``i`` replies ``replies[i]`` (the
    last script for any further choice), truncated to ``max_tokens``.

    Prefill answers choice 0's first token and, with ``n > 1`` (or when choice 0 goes on),
    a handle. Decode streams the rest of choice 0 and all of choices 1..n-1 round-robin; when
    choice 0 ended at prefill it first echoes a finish-only chunk for it (``echo_finished``).
    ``fail_choice``: that choice gets an error chunk instead of its second token.
    ``end_early``: the stream stops before the last choice's final chunk. ``extra``: chunks
    appended after the script.
    """

    replies: list[Reply] = field(default_factory=list)
    echo_finished: bool = True
    fail_choice: int | None = None
    end_early: bool = False
    no_handle: bool = False
    extra: list[GenerationChunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.reply = self.replies[0]

    def script(self, i: int) -> Reply:
        return self.replies[min(i, len(self.replies) - 1)]

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/internal/context")
        async def context(req: ContextRequest) -> ContextResponse:
            self.contexts.append(req)
            token, text = self.replies[0][0]
            finish = _first_finish(self.replies[0], req.sampling)
            handle = None
            if (finish is None or req.sampling.n > 1) and not self.no_handle:
                handle = fake_handle(self.worker_id, req, self.kv_layout)
            return ContextResponse(
                request_id=req.request_id,
                first_token=token,
                text=text,
                logprob=self._logprob(token, req.sampling),
                finish_reason=finish,
                handle=handle,
            )

        @app.post("/internal/release")
        async def release(req: ReleaseRequest) -> dict[str, bool]:
            self.releases.append(req)
            return {"released": True}

        @app.post("/internal/generate")
        async def generate(req: GenerationRequest) -> Any:
            self.generations.append(req)
            lines = [c.model_dump_json().encode() + b"\n" for c in self.chunks(req)]
            return StreamingResponse(iter(lines), media_type="application/x-ndjson")

        return app

    def chunks(self, req: GenerationRequest) -> list[GenerationChunk]:
        s = req.sampling
        per_choice: list[list[GenerationChunk]] = []
        for i in range(s.n):
            script = self.script(i)
            done_at_prefill = i == 0 and _first_finish(script, s) is not None
            rest = [] if done_at_prefill else script[(1 if i == 0 else 0) : s.max_tokens]
            finish = FinishReason.LENGTH if len(script) > s.max_tokens else FinishReason.STOP
            out = []
            for k, (token, text) in enumerate(rest):
                if self.fail_choice == i and k == 1:
                    out.append(self._error(req.request_id, i))
                    break
                last = k == len(rest) - 1
                lp = self._logprob(token, s)
                out.append(
                    GenerationChunk(
                        request_id=req.request_id,
                        index=i,
                        token_ids=(token,),
                        text=text,
                        logprobs=(lp,) if lp else (),
                        finish_reason=finish if last else None,
                    )
                )
            if done_at_prefill and self.echo_finished:
                out.append(
                    GenerationChunk(
                        request_id=req.request_id, index=0, finish_reason=_first_finish(script, s)
                    )
                )
            per_choice.append(out)
        chunks = [c for row in zip_longest(*per_choice) for c in row if c is not None]
        if self.end_early:
            chunks = chunks[:-1]
        return chunks + self.extra

    @staticmethod
    def _error(request_id: str, index: int) -> GenerationChunk:
        return GenerationChunk(
            request_id=request_id,
            index=index,
            finish_reason=FinishReason.ERROR,
            error=f"choice {index} failed",
        )


def _first_finish(script: Reply, sampling: SamplingParams) -> FinishReason | None:
    """Whether choice 0's first token (sampled by prefill) already ended it."""
    if len(script) == 1:
        return FinishReason.STOP
    if sampling.max_tokens == 1:
        return FinishReason.LENGTH
    return None


def sse_events(text: str) -> list[dict[str, Any]]:
    datas = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]", datas[-3:]
    return [json.loads(d) for d in datas[:-1]]


# --- through the router app ------------------------------------------------------------------

TEXTS = ["Hi there!", "Hello, you", "Hey"]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=128)


@pytest.fixture(scope="module")
def replies(model_dir) -> list[Reply]:
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return [
        [(i, tok.decode([i])) for i in tok.encode(text, add_special_tokens=False)] for text in TEXTS
    ]


@pytest.fixture
def cfg(model_dir):
    return RouterConfig(model_path=model_dir, served_model_name=MODEL)


def pair(replies: list[Reply], **kw: Any) -> list[FakeWorker]:
    return [
        ChoicesWorker("p0", Role.PREFILL, [], replies=replies),
        ChoicesWorker("d0", Role.DECODE, [], replies=replies, **kw),
    ]


async def test_chat_with_n_returns_every_choice_with_its_index_and_summed_usage(cfg, replies):
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post("/v1/chat/completions", json={**CHAT, "n": 3, "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == TEXTS
    assert [c["finish_reason"] for c in body["choices"]] == ["stop"] * 3
    prompt = len(h.workers["p0"].contexts[0].prompt_token_ids)
    completion = sum(len(t) for t in TEXTS)  # one byte-level token per character
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_n_and_seed_reach_both_workers_and_the_prompt_is_sent_once(cfg, replies):
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "abc", "n": 3, "seed": 5}
        )
    assert r.status_code == 200, r.text
    (ctx,) = h.workers["p0"].contexts
    (gen,) = h.workers["d0"].generations
    assert (ctx.sampling.n, ctx.sampling.seed) == (3, 5)
    assert gen.sampling == ctx.sampling and gen.handle is not None
    assert h.workers["p0"].releases == []  # D pulled the blocks once and released them


async def test_completions_with_n_have_per_choice_text_and_logprob_offsets(cfg, replies):
    body = {"model": MODEL, "prompt": "abc", "n": 2, "max_tokens": 4, "logprobs": 1}
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, "Hi t", "length"),
        (1, "Hell", "length"),
    ]
    for c in choices:
        assert c["logprobs"]["tokens"] == list(c["text"])
        assert c["logprobs"]["text_offset"] == [0, 1, 2, 3]
    assert r.json()["usage"]["completion_tokens"] == 8


async def test_streamed_chat_with_n_sends_a_role_chunk_per_choice_then_indexed_deltas(cfg, replies):
    body = {**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = sse_events(r.text)
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in chunks[:3])
    deltas = [c["choices"][0] for c in chunks[3:-1]]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    assert all("role" not in d["delta"] for d in deltas)
    for i, text in enumerate(TEXTS):
        mine = [d for d in deltas if d["index"] == i]
        assert "".join(d["delta"]["content"] for d in mine) == text
        assert [d["finish_reason"] for d in mine if d["finish_reason"]] == ["stop"]
        assert mine[-1]["finish_reason"] == "stop"
    indexes = [d["index"] for d in deltas]
    assert indexes != sorted(indexes)  # interleaved, not one choice after another
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == sum(len(t) for t in TEXTS)


async def test_streamed_completions_with_n_index_every_chunk(cfg, replies):
    body = {"model": MODEL, "prompt": "abc", "n": 2, "stream": True}
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post("/v1/completions", json=body)
    chunks = sse_events(r.text)
    assert all(len(c["choices"]) == 1 and "usage" not in c for c in chunks)
    for i, text in enumerate(TEXTS[:2]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == text
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]


async def test_choice_finished_by_the_first_token_still_runs_the_other_choices(cfg, replies):
    one_token = [replies[0][:1], *replies[1:]]
    body = {**CHAT, "n": 3, "stream": True}
    async with router_harness(cfg, pair(one_token)) as h:
        r = await h.client.post("/v1/chat/completions", json=body)
    deltas = [c["choices"][0] for c in sse_events(r.text)[3:]]
    finishes = [(d["index"], d["finish_reason"]) for d in deltas if d["finish_reason"]]
    assert sorted(finishes) == [(0, "stop"), (1, "stop"), (2, "stop")]  # D's echo dropped
    assert "".join(d["delta"]["content"] for d in deltas if d["index"] == 0) == "H"
    assert "".join(d["delta"]["content"] for d in deltas if d["index"] == 2) == "Hey"
    assert len(h.workers["d0"].generations) == 1 and h.workers["p0"].releases == []


async def test_max_tokens_one_with_n_gives_every_choice_one_token(cfg, replies):
    body = {"model": MODEL, "prompt": "abc", "n": 3, "max_tokens": 1}
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [("H", "length")] * 3
    assert r.json()["usage"]["completion_tokens"] == 3
    assert len(h.workers["d0"].generations) == 1


async def test_n_omitted_is_one_choice(cfg, replies):
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post("/v1/chat/completions", json=CHAT)
    assert [c["index"] for c in r.json()["choices"]] == [0]
    assert h.workers["p0"].contexts[0].sampling.n == 1


async def test_error_in_one_choice_fails_the_streamed_request_and_releases_the_blocks(
    cfg, replies, caplog
):
    body = {**CHAT, "n": 2, "stream": True}
    async with router_harness(short_worker_wait(cfg), pair(replies, fail_choice=1)) as h:
        r = await h.client.post("/v1/chat/completions", json=body)
    datas = [ln for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert datas[-1] == "data: [DONE]"
    err = json.loads(datas[-2][len("data: ") :])["error"]
    assert err["code"] == "worker_error", err  # the details go to the router's log, not the client
    assert any(
        err["request_id"] in rec.getMessage() and "choice 1 failed" in rec.getMessage()
        for rec in caplog.records
    )
    assert [x.request_id for x in h.workers["p0"].releases] == [r.headers["x-request-id"]]


@pytest.mark.parametrize(
    ("path", "extra", "param", "message"),
    [
        ("/v1/chat/completions", {"n": 0}, "n", "n must lie in [1, 16], got n=0"),
        ("/v1/chat/completions", {"n": 17}, "n", "n must lie in [1, 16], got n=17"),
        ("/v1/completions", {"n": 3, "best_of": 2}, "best_of", "best_of must equal n"),
        ("/v1/completions", {"best_of": 2}, "best_of", "best_of must equal n"),
    ],
)
async def test_n_out_of_range_or_best_of_other_than_n_is_a_400(
    cfg, replies, path, extra, param, message
):
    body = {**(CHAT if "chat" in path else {"model": MODEL, "prompt": "abc"}), **extra}
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert message in r.json()["error"]["message"]
    assert h.workers["p0"].contexts == []


async def test_best_of_equal_to_n_is_accepted(cfg, replies):
    body = {"model": MODEL, "prompt": "abc", "n": 2, "best_of": 2}
    async with router_harness(cfg, pair(replies)) as h:
        r = await h.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


# --- the transaction -------------------------------------------------------------------------

REPLIES: list[Reply] = [
    [(72, "H"), (105, "i"), (33, "!")],
    [(89, "Y"), (111, "o")],
    [(79, "O"), (107, "k"), (46, "."), (10, "\n")],
]
PROMPT = [1, 2, 3]


@asynccontextmanager
async def make_router(p: ChoicesWorker, d: ChoicesWorker) -> AsyncIterator[Router]:
    mounts = {w.http_url: httpx.ASGITransport(app=w.app()) for w in (p, d)}
    watcher = FakeWatcher([p.record(), d.record()])
    async with httpx.AsyncClient(mounts=mounts, trust_env=False) as http:
        view = WorkerView(watcher, served_model_name=MODEL)
        client = WorkerClient(http, key=CLUSTER_KEY, connect_timeout_s=1.0)
        yield Router(
            view,
            client,
            RouterSettings(  # failures reach the test: no migration, no wait for a worker
                request_timeout_s=10.0,
                local_prefill_max_tokens=0,
                migration_limit=0,
                worker_wait_s=0.0,
            ),
        )


def workers(replies: list[Reply] = REPLIES, **kw: Any) -> tuple[ChoicesWorker, ChoicesWorker]:
    p = ChoicesWorker("p0", Role.PREFILL, [], replies=replies)
    return p, ChoicesWorker("d0", Role.DECODE, [], replies=replies, **kw)


async def test_transaction_yields_each_choice_indexed_and_ends_after_all_finished():
    p, d = workers()
    async with make_router(p, d) as router:
        txn = await router.start("r1", PROMPT, SamplingParams(n=3, seed=1))
        events = [e async for e in txn.events()]
    assert events[0].index == 0 and events[0].token_ids == (72,)  # P's first token
    for i, script in enumerate(REPLIES):
        mine = [e for e in events if e.index == i]
        assert [t for e in mine for t in e.token_ids] == [t for t, _ in script]
        assert [e.finish_reason for e in mine] == [None] * (len(mine) - 1) + [FinishReason.STOP]
    assert events[-1].index == 2  # the longest choice ends the transaction
    assert txn.state is TxnState.FINISHED and txn.num_tokens == 9
    assert txn.choice_tokens == [3, 2, 4]
    assert p.releases == [] and router.view.in_flight("d0") == 0


async def test_finish_only_echo_of_a_choice_finished_on_prefill_is_dropped():
    p, d = workers([REPLIES[0][:1], *REPLIES[1:]])
    async with make_router(p, d) as router:
        txn = await router.start("r1", PROMPT, SamplingParams(n=3))
        assert txn.context.finish_reason is FinishReason.STOP and txn.context.handle is not None
        events = [e async for e in txn.events()]
    finishes = sorted((e.index, e.finish_reason) for e in events if e.finish_reason)
    assert finishes == [(0, FinishReason.STOP), (1, FinishReason.STOP), (2, FinishReason.STOP)]
    assert len(d.generations) == 1 and d.generations[0].first_token == 72
    assert txn.state is TxnState.FINISHED and p.releases == []


async def test_decode_stream_ending_before_every_choice_finished_is_a_worker_error():
    p, d = workers(end_early=True)
    async with make_router(p, d) as router:
        txn = await router.start("r1", PROMPT, SamplingParams(n=3))
        with pytest.raises(WorkerError, match=r"before choice\(s\) \[2\] finished"):
            async for _ in txn.events():
                pass
    assert txn.state is TxnState.FAILED and [r.request_id for r in p.releases] == ["r1"]


@pytest.mark.parametrize(
    ("chunk", "match"),
    [
        (GenerationChunk(request_id="r1", index=1, token_ids=(5,), text="x"), "choice 1 of"),
        (GenerationChunk(request_id="r1", index=3, finish_reason=FinishReason.STOP), "choice 3"),
    ],
)
async def test_tokens_for_a_finished_or_unknown_choice_are_a_worker_error(chunk, match):
    p, d = workers(end_early=True, extra=[chunk])
    async with make_router(p, d) as router:
        txn = await router.start("r1", PROMPT, SamplingParams(n=3))
        with pytest.raises(WorkerError, match=match):
            async for _ in txn.events():
                pass
    assert [r.request_id for r in p.releases] == ["r1"]


async def test_prefill_answer_without_a_handle_for_n_choices_is_a_worker_error():
    p, d = workers([REPLIES[0][:1], *REPLIES[1:]])
    p.no_handle = True
    async with make_router(p, d) as router:
        with pytest.raises(WorkerError, match="no transfer handle for a request of n=2"):
            await router.start("r1", PROMPT, SamplingParams(n=2))
    assert d.generations == []


async def test_consumer_leaving_after_a_finished_first_choice_releases_the_parked_blocks():
    p, d = workers([REPLIES[0][:1], *REPLIES[1:]])
    async with make_router(p, d) as router:
        txn = await router.start("r1", PROMPT, SamplingParams(n=2))
        events = txn.events()
        first = await anext(events)
        await events.aclose()
    assert (first.index, first.finish_reason) == (0, FinishReason.STOP)
    assert txn.state is TxnState.ABANDONED
    assert [(r.request_id, r.lease_id) for r in p.releases] == [("r1", "lease-r1")]
    assert d.generations == []
