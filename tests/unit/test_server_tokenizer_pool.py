"""The router's tokenizer pool (pdserve.server.chat.tokenizer_pool): work runs off the event loop,
the backlog is bounded in bytes and requests (429 ``tokenizer_busy`` beyond it), and a share is
held until the thread is done with it, even when its caller gave up."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdserve.errors import InvalidRequestError, QueueFullError
from pdserve.server import app as server_app
from pdserve.server.chat.tokenizer_pool import TokenizerPool
from tests.support.servers import wait_until


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Work blocks on it until the test sets it (set again on teardown so no thread hangs)."""
    event = threading.Event()
    yield event
    event.set()


def _blocked(gate: threading.Event, value: int) -> int:
    assert gate.wait(10)
    return value


async def _until(predicate: Callable[[], bool]) -> None:
    await wait_until(predicate, 5.0, interval_s=0.01)


async def test_work_runs_on_a_pool_thread_and_returns_its_result() -> None:
    pool = TokenizerPool(1, max_backlog_bytes=100)
    try:
        loop_thread = threading.get_ident()
        assert await pool.run(10, threading.get_ident) != loop_thread
        assert pool.backlog == (0, 0)
    finally:
        pool.close()


async def test_a_typed_error_from_the_work_reaches_the_caller_unchanged() -> None:
    def refuse() -> None:
        raise InvalidRequestError("too long", param="prompt", code="context_length_exceeded")

    pool = TokenizerPool(1, max_backlog_bytes=100)
    try:
        with pytest.raises(InvalidRequestError) as exc:
            await pool.run(10, refuse)
        assert (exc.value.param, exc.value.code) == ("prompt", "context_length_exceeded")
        assert pool.backlog == (0, 0)
    finally:
        pool.close()


async def test_a_request_past_the_byte_backlog_is_refused_with_429(gate: threading.Event) -> None:
    pool = TokenizerPool(1, max_backlog_bytes=100)
    try:
        first = asyncio.create_task(pool.run(60, _blocked, gate, 1))
        await _until(lambda: pool.backlog == (1, 60))
        with pytest.raises(QueueFullError) as exc:
            await pool.run(41, _blocked, gate, 2)
        assert exc.value.status == 429 and exc.value.code == "tokenizer_busy"
        second = asyncio.create_task(pool.run(40, _blocked, gate, 3))  # fits: 100 bytes
        await _until(lambda: pool.backlog == (2, 100))
        gate.set()
        assert (await first, await second) == (1, 3)
        assert pool.backlog == (0, 0)
    finally:
        pool.close()


async def test_an_empty_pool_admits_one_body_larger_than_the_backlog() -> None:
    pool = TokenizerPool(1, max_backlog_bytes=100)
    try:
        assert await pool.run(1000, len, "abc") == 3
    finally:
        pool.close()


async def test_the_request_count_is_bounded_too(gate: threading.Event) -> None:
    pool = TokenizerPool(1, max_backlog_bytes=10**6, max_backlog_requests=2)
    try:
        tasks = [asyncio.create_task(pool.run(1, _blocked, gate, i)) for i in range(2)]
        await _until(lambda: pool.backlog[0] == 2)
        with pytest.raises(QueueFullError):
            await pool.run(1, _blocked, gate, 9)
        gate.set()
        assert await asyncio.gather(*tasks) == [0, 1]
    finally:
        pool.close()


async def test_a_cancelled_caller_keeps_its_share_until_the_thread_is_done(
    gate: threading.Event,
) -> None:
    pool = TokenizerPool(1, max_backlog_bytes=100)
    try:
        running = asyncio.create_task(pool.run(50, _blocked, gate, 1))
        queued = asyncio.create_task(pool.run(50, _blocked, gate, 2))
        await _until(lambda: pool.backlog == (2, 100))
        running.cancel()
        queued.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
        # The queued work never started and is gone; the running one still holds its share.
        await _until(lambda: pool.backlog == (1, 50))
        gate.set()
        await _until(lambda: pool.backlog == (0, 0))
    finally:
        pool.close()


async def test_a_closed_pool_refuses_work() -> None:
    pool = TokenizerPool(1, max_backlog_bytes=100)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await pool.run(1, len, "x")


def test_bounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError):
        TokenizerPool(0, max_backlog_bytes=100)


async def test_the_router_answers_429_tokenizer_busy_when_the_backlog_is_full(
    tmp_path, monkeypatch: pytest.MonkeyPatch, gate: threading.Event
) -> None:
    """Through the router: while 4 maximal bodies are being tokenized (held on ``gate``), one
    more gets an OpenAI error body with 429 ``tokenizer_busy`` and ``Retry-After``, while a
    prompt of token ids, which needs no tokenizer, is served (it skips the pool); once they
    finish, the router serves text again."""
    from pdserve.config.loading import RouterConfig
    from pdserve.config.settings import RouterSettings
    from pdserve.protocol import Role
    from pdserve.server.chat.preprocess import Preprocessor
    from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness

    max_bytes = 2048
    cfg = RouterConfig(
        model_path=build_tokenizer_dir(tmp_path, max_position_embeddings=64),
        served_model_name=MODEL,
        router=RouterSettings(max_request_bytes=max_bytes, tokenizer_threads=1),
    )
    real = Preprocessor.completions

    def held(self: Preprocessor, req: Any) -> object:
        if isinstance(req.prompt, str):  # text waits on the gate (on a pool thread)
            assert gate.wait(10)
        return real(self, req)

    monkeypatch.setattr(Preprocessor, "completions", held)
    pools: list[TokenizerPool] = []

    class Recorded(TokenizerPool):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            pools.append(self)

    monkeypatch.setattr(server_app, "TokenizerPool", Recorded)
    big = {"model": MODEL, "prompt": "x" * (max_bytes - 100), "max_tokens": 1}
    reply = [(72, "H")]
    workers = [FakeWorker("p0", Role.PREFILL, reply), FakeWorker("d0", Role.DECODE, reply)]
    async with router_harness(cfg, workers) as h:
        held_requests = [
            asyncio.create_task(h.client.post("/v1/completions", json=big)) for _ in range(4)
        ]
        await _until(lambda: pools[0].backlog[0] == 4)  # one runs (held), three wait
        busy = await h.client.post("/v1/completions", json=big)
        ids = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}
        token_ids = await h.client.post("/v1/completions", json=ids)
        gate.set()
        served = await asyncio.gather(*held_requests)
        again = await h.client.post("/v1/completions", json={**big, "prompt": "hi"})
    assert busy.status_code == 429, busy.text
    error = busy.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "tokenizer_busy")
    assert busy.headers["retry-after"] == "1"
    assert token_ids.status_code == 200, token_ids.text
    assert [r.status_code for r in served] == [400] * 4  # too long for the 64-token window
    assert again.status_code == 200, again.text


@pytest.mark.parametrize(
    "text", ["hello", " leading space", "héllo wörld 日本語 🙂", "<|bos|>x<|eos|>", "a\tb\n  c"]
)
def test_the_fast_encode_path_gives_the_ids_of_transformers_encode(text: str) -> None:
    """:class:`Preprocessor` calls the backend's ``encode_batch_fast`` (GIL released, no
    offsets): the ids must be those of ``tokenizer.encode``, with and without special tokens."""
    from pdserve.server.chat.preprocess import Preprocessor
    from pdserve.server.chat.schemas import CompletionRequest
    from tests.support.models import tiny_tokenizer

    tok = tiny_tokenizer()
    pre = Preprocessor(tok, served_model_name="m", max_model_len=512)
    assert pre._fast is not None, "the tiny tokenizer is a fast one"
    req = CompletionRequest.model_validate({"model": "m", "prompt": text, "max_tokens": 1})
    assert pre.completion(req).prompt_token_ids == tok.encode(text, add_special_tokens=True)
    assert pre._encode(text, add_special_tokens=False) == (
        len(tok.encode(text, add_special_tokens=False)),
        tok.encode(text, add_special_tokens=False),
    )


def test_a_prompt_past_the_window_is_refused_from_its_count() -> None:
    """Its ids never become a list: the count alone refuses it (400, with the numbers)."""
    from pdserve.server.chat.preprocess import Preprocessor
    from pdserve.server.chat.schemas import CompletionRequest
    from tests.support.models import tiny_tokenizer

    pre = Preprocessor(tiny_tokenizer(), served_model_name="m", max_model_len=8)
    assert pre._encode("x" * 100, add_special_tokens=False) == (100, None)
    with pytest.raises(InvalidRequestError) as exc:
        pre.completion(CompletionRequest.model_validate({"model": "m", "prompt": "x" * 100}))
    assert exc.value.code == "context_length_exceeded"
