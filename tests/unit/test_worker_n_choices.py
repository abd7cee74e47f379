"""``n`` choices on the workers' side: the output stream ends after every choice, the decode
role streams each choice's chunks with its index, and the prefill role hands out a handle
whenever the engine parked the blocks (also when choice 0 already finished)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdserve.protocol import (
    ContextRequest,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
)
from pdserve.workers.roles.bridge import OutputStream
from pdserve.workers.roles.decode import DecodeHandler
from pdserve.workers.roles.parking import ParkedBlocks
from tests.support.fake_engine import FakeEngine, token_at
from tests.support.fakes import layout


@dataclass
class Out:
    """An engine output of choice ``index`` (the fields the roles read)."""

    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None
    request_id: str = "r1"
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    parked_block_ids: list[int] | None = None
    cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def feed(stream: OutputStream, outs: list[Out]) -> None:
    for out in outs:
        stream.sink(out)  # type: ignore[arg-type]


INTERLEAVED = [
    Out(1, [5]),
    Out(0, [7]),
    Out(2, [9], FinishReason.STOP),
    Out(0, [8], FinishReason.LENGTH),
    Out(1, [6], FinishReason.STOP),
]


async def test_output_stream_ends_after_every_choice_finished():
    stream = OutputStream(choices=3)
    feed(stream, INTERLEAVED + [Out(0, [99])])  # the last one is never read
    seen = [(o.index, o.token_ids) async for o in stream]
    assert seen == [(1, [5]), (0, [7]), (2, [9]), (0, [8]), (1, [6])]
    assert stream.done


async def test_output_stream_counts_an_error_output_as_its_choice_final():
    stream = OutputStream(choices=2)
    feed(stream, [Out(0, [], FinishReason.ERROR, "boom"), Out(1, [], FinishReason.ERROR, "boom")])
    assert len([o async for o in stream]) == 2


async def test_single_output_stream_ends_after_one_output_whatever_n():
    stream = OutputStream(single=True)
    feed(stream, [Out(0, [1]), Out(1, [2])])
    assert [o.token_ids async for o in stream] == [[1]]


def generation(n: int) -> GenerationRequest:
    return GenerationRequest(
        request_id="r1",
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(n=n, max_tokens=4),
        deadline=time.time() + 10,
    )


async def test_decode_chunks_carry_the_choice_index_until_every_choice_finished():
    engine = FakeEngine(layout())
    role = DecodeHandler(engine=engine, transceiver=None)  # type: ignore[arg-type]
    stream = OutputStream(choices=3)
    feed(stream, INTERLEAVED)
    chunks = [c async for c in role.chunks(generation(3), stream)]
    assert [(c.index, c.token_ids, c.finish_reason) for c in chunks] == [
        (1, (5,), None),
        (0, (7,), None),
        (2, (9,), FinishReason.STOP),
        (0, (8,), FinishReason.LENGTH),
        (1, (6,), FinishReason.STOP),
    ]
    assert engine.aborted == []


async def test_decode_consumer_leaving_before_every_choice_finished_aborts_the_request():
    engine = FakeEngine(layout())
    role = DecodeHandler(engine=engine, transceiver=None)  # type: ignore[arg-type]
    stream = OutputStream(choices=3)
    feed(stream, INTERLEAVED)
    chunks = role.chunks(generation(3), stream)
    for _ in range(3):  # choice 2 finished, choices 0 and 1 still run
        await anext(chunks)
    await chunks.aclose()
    assert engine.aborted == ["r1"]


async def test_decode_deadline_ends_an_unfinished_stream_with_an_error_chunk():
    engine = FakeEngine(layout())
    role = DecodeHandler(engine=engine, transceiver=None)  # type: ignore[arg-type]
    stream = OutputStream(choices=2)
    feed(stream, [Out(0, [7], FinishReason.STOP)])
    req = generation(2).model_copy(update={"deadline": time.time() + 0.2})
    chunks = [c async for c in role.chunks(req, stream)]
    assert [(c.index, c.finish_reason) for c in chunks] == [
        (0, FinishReason.STOP),
        (0, FinishReason.ERROR),
    ]
    assert engine.aborted == ["r1"]


@dataclass
class FakeTransceiver:
    backend: str = "tcp"
    endpoint: str = "127.0.0.1:1"


def context(n: int) -> ContextRequest:
    return ContextRequest(
        request_id="r1",
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(n=n, max_tokens=1),
        deadline=time.time() + 10,
    )


async def prefill_answer(n: int):  # type: ignore[no-untyped-def]
    """The prefill role's answer to a one-token context of ``n`` choices on the shared fake
    engine (which parks the blocks for ``n > 1`` and finishes choice 0 with LENGTH), with the
    engine and the parked-block table."""
    from pdserve.workers.roles.prefill import PrefillHandler

    engine = FakeEngine(layout())
    parked = ParkedBlocks(epoch=7, lease_s=30.0, free_blocks=engine.free_parked)
    role = PrefillHandler(
        engine=engine,
        transceiver=FakeTransceiver(),  # type: ignore[arg-type]
        parked=parked,
        worker_id="p0",
    )
    return await asyncio.wait_for(role.context(context(n)), 5), engine, parked


async def test_prefill_of_n_choices_hands_out_a_handle_even_when_choice_0_finished():
    resp, engine, parked = await prefill_answer(n=3)
    assert resp.finish_reason is FinishReason.LENGTH
    assert resp.first_token == token_at(context(3).prompt_token_ids, 0)
    assert resp.handle is not None
    assert list(resp.handle.block_ids) == engine.kv_cache.block_table("r1")
    assert len(parked) == 1


async def test_prefill_that_finished_without_parking_answers_no_handle():
    resp, engine, parked = await prefill_answer(n=1)
    assert resp.finish_reason is FinishReason.LENGTH and resp.handle is None
    assert len(parked) == 0 and engine.parked_ids == set()
