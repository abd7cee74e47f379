"""Drain migration through the decode role on the tiny model: ``DecodeHandler.migrate_all``
ends a long running stream at once with the ``worker_draining`` error chunk and frees its KV
blocks; the request then resumed (``GenerationRequest.resume``, the tokens and text the client
got) on another handler continues exactly where the stream stopped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.protocol import (
    DRAINING_ERROR,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ResumedChoice,
    SamplingParams,
)
from pdserve.workers.engine.engine import Engine
from pdserve.workers.roles.decode import DecodeHandler
from tests.support.engine import make_engine

pytestmark = pytest.mark.timeout(60)

LONG = SamplingParams(temperature=0.8, seed=99, max_tokens=160, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = make_engine(tiny_model_dir, num_blocks=128)
    yield eng
    eng.shutdown()


def generation(engine: Engine, rid: str, **kw: object) -> GenerationRequest:
    prompt = engine.tokenizer.encode("Drain me, then go on elsewhere.", add_special_tokens=False)
    return GenerationRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=LONG,
        deadline=time.time() + 60,
        **kw,  # type: ignore[arg-type]
    )


async def stream_all(handler: DecodeHandler, req: GenerationRequest) -> list[GenerationChunk]:
    stream = await handler.admit(req)
    return [c async for c in handler.chunks(req, stream)]


async def until_free(engine: Engine, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while engine.kv_cache.holders() or engine.load().running + engine.load().waiting:
        assert time.monotonic() < deadline, "the aborted request kept its blocks"
        await asyncio.sleep(0.01)


async def test_a_draining_worker_ends_the_stream_at_once_and_the_request_goes_on_elsewhere(
    engine: Engine,
) -> None:
    ref = await stream_all(
        DecodeHandler(engine=engine, transceiver=None), generation(engine, "ref")
    )
    assert (
        sum(len(c.token_ids) for c in ref) == 160 and ref[-1].finish_reason is FinishReason.LENGTH
    )

    draining = DecodeHandler(engine=engine, transceiver=None)
    req = generation(engine, "moved")
    stream = await draining.admit(req)
    chunks = draining.chunks(req, stream)
    got = [await anext(chunks) for _ in range(5)]
    assert engine.kv_cache.holders(), "the request runs"
    t0 = time.monotonic()
    draining.migrate_all()
    rest = [c async for c in chunks]
    assert time.monotonic() - t0 < 0.5, "the stream did not end at once"
    last = rest[-1]
    assert last.finish_reason is FinishReason.ERROR and (last.error or "").startswith(
        DRAINING_ERROR
    )
    got += rest[:-1]  # outputs already queued when it was interrupted
    await until_free(engine)

    tokens = tuple(t for c in got for t in c.token_ids)
    text = "".join(c.text for c in got)
    assert 5 <= len(tokens) < 160
    resume = (ResumedChoice(index=0, token_ids=tokens, text_chars=len(text)),)
    after = await stream_all(
        DecodeHandler(engine=engine, transceiver=None), generation(engine, "moved", resume=resume)
    )
    assert tokens + tuple(t for c in after for t in c.token_ids) == tuple(
        t for c in ref for t in c.token_ids
    )
    assert text + "".join(c.text for c in after) == "".join(c.text for c in ref)
    assert after[-1].finish_reason is FinishReason.LENGTH
    await until_free(engine)
