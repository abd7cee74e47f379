"""The router's side of the streamed hand-off against scripted workers (in-process ASGI): the
decode leg opens with the handle published at admission, and falls back to the whole-request
hand-off when that leg is refused."""

from __future__ import annotations

from pdserve.errors import HandleError
from pdserve.protocol import FinishReason, SamplingParams
from tests.support.fakes import PROMPT, REPLY, make_router
from tests.support.fakes import decode_worker as decode
from tests.support.fakes import prefill_worker as prefill


async def _run(router, max_tokens: int = 16):
    txn = await router.start("r1", PROMPT, SamplingParams(max_tokens=max_tokens))
    return [e async for e in txn.events()]


async def test_the_decode_leg_opens_with_the_streamed_handle():
    p, d = prefill(), decode()
    async with make_router(p, d, kv_stream_min_tokens=1) as router:
        events = await _run(router)
    assert "".join(e.text for e in events) == "Hi!\n"
    (gen,) = d.generations
    assert gen.handle is not None and gen.handle.streamed and gen.first_token is None
    assert gen.handle.lease_id == "lease-r1" and p.releases == []


async def test_a_refused_streamed_leg_falls_back_to_the_whole_hand_off():
    p = prefill()
    d = decode(streamed_error=HandleError("the prefill of this request failed"))
    async with make_router(p, d, kv_stream_min_tokens=1) as router:
        events = await _run(router)
    assert "".join(e.text for e in events) == "Hi!\n"
    streamed, whole = d.generations
    assert streamed.handle is not None and streamed.handle.streamed
    assert whole.handle is not None and not whole.handle.streamed and whole.first_token == 72


async def test_a_first_token_that_finishes_the_request_drops_the_streamed_leg():
    p, d = prefill(reply=REPLY[:1]), decode()
    async with make_router(p, d, kv_stream_min_tokens=1) as router:
        events = await _run(router)
    assert [(e.text, e.finish_reason) for e in events] == [("H", FinishReason.STOP)]
    assert len(d.generations) <= 1, "at most the streamed leg, closed unused"


async def test_prompts_below_the_threshold_are_handed_off_whole():
    p, d = prefill(), decode()
    async with make_router(p, d, kv_stream_min_tokens=len(PROMPT) + 1) as router:
        await _run(router)
    assert not d.generations[0].handle.streamed
