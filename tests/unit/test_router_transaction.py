"""The two-leg transaction against scripted workers (in-process ASGI, no sockets)."""

from __future__ import annotations

import pytest

from pdserve.errors import (
    CapacityError,
    DeadlineExceededError,
    HandleError,
    LayoutMismatchError,
    PdserveError,
    QueueFullError,
    TransferError,
    WorkerError,
)
from pdserve.protocol import FinishReason, SamplingParams, WorkerLoad
from pdserve.router.client import WorkerUnreachableError
from pdserve.router.router import Router
from tests.support.fakes import (
    PROMPT,
    REPLY,
    make_router,
    record,
)
from tests.support.fakes import decode_worker as decode
from tests.support.fakes import prefill_worker as prefill


async def run(router: Router, max_tokens: int = 16, request_id: str = "r1"):
    txn = await router.start(request_id, PROMPT, SamplingParams(max_tokens=max_tokens))
    return txn, [e async for e in txn.events()]


async def test_decode_tokens_follow_the_prefill_first_token():
    p, d = prefill(), decode()
    async with make_router(p, d) as router:
        txn, events = await run(router)
        assert "".join(e.text for e in events) == "Hi!\n"
        assert [e.token_ids for e in events] == [(72,), (105,), (33,), (10,)]
        assert events[-1].finish_reason == FinishReason.STOP
        assert all(e.finish_reason is None for e in events[:-1])
        gen = d.generations[0]
        assert gen.first_token == 72 and gen.handle is not None
        assert gen.handle.request_id == "r1" and gen.deadline == p.contexts[0].deadline
        assert p.releases == [] and d.aborted == []  # D released P's blocks itself
        assert router.view.in_flight("p0") == router.view.in_flight("d0") == 0


@pytest.mark.parametrize(
    ("reply", "max_tokens", "finish"),
    [(REPLY[:1], 16, FinishReason.STOP), (REPLY, 1, FinishReason.LENGTH)],
)
async def test_first_token_that_finishes_the_request_skips_the_decode_leg(
    reply, max_tokens, finish
):
    p, d = prefill(reply=reply), decode()
    async with make_router(p, d) as router:
        _, events = await run(router, max_tokens=max_tokens)
    assert [(e.text, e.finish_reason) for e in events] == [("H", finish)]
    assert d.generations == [] and p.releases == []


async def test_max_tokens_truncates_with_finish_reason_length():
    async with make_router(prefill(), decode()) as router:
        _, events = await run(router, max_tokens=2)
    assert "".join(e.text for e in events) == "Hi"
    assert events[-1].finish_reason == FinishReason.LENGTH


async def test_decode_error_chunk_raises_worker_error_and_releases_prefill_blocks():
    p, d = prefill(), decode(fail_after=1)
    async with make_router(p, d) as router:
        txn = await router.start("r1", PROMPT, SamplingParams())
        seen = []
        with pytest.raises(WorkerError, match="KV transfer from the prefill worker failed"):
            async for e in txn.events():
                seen.append(e.text)
        assert seen == ["H", "i"]
        assert [(r.request_id, r.epoch) for r in p.releases] == [("r1", 7)]
        assert router.view.in_flight("d0") == 0


@pytest.mark.parametrize(
    ("error", "expected", "code"),
    [
        (CapacityError("no free KV blocks"), CapacityError, "no_capacity"),
        (LayoutMismatchError("tokens_per_block: 16 != 32"), TransferError, "kv_layout_mismatch"),
    ],
)
async def test_decode_refusal_before_streaming_is_typed_and_releases_prefill_blocks(
    error, expected, code
):
    p, d = prefill(), decode(error=error)
    async with make_router(p, d) as router:
        txn = await router.start("r1", PROMPT, SamplingParams())
        with pytest.raises(expected) as err:
            async for _ in txn.events():
                pass
    assert err.value.status == error.status and err.value.code == code
    assert error.message in err.value.message and "decode worker d0" in err.value.message
    assert [r.request_id for r in p.releases] == ["r1"]


async def test_a_failed_prefill_leg_is_prefilled_locally_by_the_decode_worker():
    """P answered 502 (its engine failed the request): the first leg runs again without P;
    with no other prefill worker the decode worker prefills the prompt itself."""
    p, d = prefill(error=WorkerError("engine crashed")), decode()
    async with make_router(p, d) as router:
        txn, events = await run(router)
        assert "".join(e.text for e in events) == "Hi!\n"
        assert txn.route.path == "local_prefill" and d.generations[0].handle is None
        assert len(p.contexts) == 1 and router.view.in_flight("p0") == 0


async def test_a_failed_prefill_leg_fails_the_request_without_migration():
    """migration_limit 0: only a refused connection is retried (once); P's 502 reaches the
    client."""
    p, d = prefill(error=WorkerError("engine crashed")), decode()
    async with make_router(p, d, migration_limit=0) as router:
        with pytest.raises(WorkerError, match="prefill worker p0 answered HTTP 502"):
            await run(router)
    assert d.generations == []


@pytest.mark.parametrize(
    ("error", "expected", "status"),
    [
        (CapacityError("prefill queue full"), CapacityError, 503),
        (DeadlineExceededError("too late"), DeadlineExceededError, 504),
    ],
)
async def test_prefill_error_envelope_becomes_the_matching_typed_error(error, expected, status):
    p, d = prefill(error=error), decode()
    async with make_router(p, d) as router:
        with pytest.raises(expected) as err:
            await router.start("r1", PROMPT, SamplingParams())
    assert err.value.status == status
    assert "prefill worker p0" in err.value.message and error.message in err.value.message
    assert d.generations == []
    assert router.view.in_flight("p0") == router.view.in_flight("d0") == 0


async def test_a_decode_worker_that_refuses_for_capacity_is_replaced_by_another():
    """D refused before streaming (its queue full, no free KV blocks): P still holds the
    blocks, so the decode leg goes to the next decode worker and the request is served."""
    p = prefill()
    full = decode("d-full", error=QueueFullError("no free KV blocks before the lease ran out"))
    busy = decode("d-busy", load=WorkerLoad(running=5, free_blocks=1))  # tried second
    async with make_router(p, full, busy) as router:
        txn, events = await run(router)
    assert txn.pair.decode.worker_id == "d-busy"
    assert "".join(e.text for e in events) == "Hi!\n"
    assert [len(d.generations) for d in (full, busy)] == [1, 1]
    assert p.releases == [], "the second decode worker pulled (and so released) the blocks"
    assert router.view.in_flight("d-full") == router.view.in_flight("d-busy") == 0


@pytest.mark.parametrize(
    ("error", "attempts"),
    [
        (CapacityError("no free KV blocks"), 3),  # every decode worker full: 3 tried, no more
        # the handle itself is refused: no other pull helps; the request migrates instead
        # (recomputed, no handle), which this fake refuses too
        (HandleError("lease expired"), 2),
    ],
)
async def test_decode_retries_are_bounded_and_skip_what_no_other_decode_worker_fixes(
    error, attempts
):
    p = prefill()
    decodes = [decode(f"d{i}", error=error) for i in range(4)]
    async with make_router(p, *decodes) as router:
        txn = await router.start("r1", PROMPT, SamplingParams())
        with pytest.raises(PdserveError) as err:
            async for _ in txn.events():
                pass
    assert err.value.code == error.code and error.message in err.value.message
    assert sum(len(d.generations) for d in decodes) == attempts
    assert [r.request_id for r in p.releases] == ["r1"]
    if isinstance(error, HandleError):
        resumed = [g for d in decodes for g in d.generations if g.resume is not None]
        assert len(resumed) == 1 and resumed[0].handle is None
        assert resumed[0].resume is not None and resumed[0].resume[0].token_ids == (72,)


async def test_unreachable_prefill_worker_is_retried_once_on_another():
    dead = record("p-dead", "prefill", "http://127.0.0.1:1")  # nothing listens on port 1
    p = prefill("p-ok", load=WorkerLoad(running=5, free_blocks=1))  # more loaded: tried second
    async with make_router(p, decode(), extra_records=[dead]) as router:
        txn, events = await run(router)
    assert txn.pair.prefill.worker_id == "p-ok"
    assert "".join(e.text for e in events) == "Hi!\n"
    # The dead worker is left out for a while instead of costing every request a retry.
    assert [w.worker_id for w in router.view.candidates().prefill] == ["p-ok"]
    assert "p-dead was unreachable" in router.view.candidates().skipped[0]


async def test_unreachable_prefill_worker_without_another_falls_back_to_local_prefill():
    dead = record("p-dead", "prefill", "http://127.0.0.1:1")
    d = decode()
    async with make_router(d, extra_records=[dead]) as router:
        txn, events = await run(router)
    assert txn.route.path == "local_prefill" and txn.pair is None
    assert "".join(e.text for e in events) == "Hi!\n"
    assert [g.handle for g in d.generations] == [None]  # D prefilled the prompt itself


async def test_unreachable_worker_without_another_route_fails_with_502():
    dead = record("d-dead", "decode", "http://127.0.0.1:1")
    async with make_router(extra_records=[dead]) as router:
        with pytest.raises(WorkerUnreachableError, match="no other worker") as err:
            await router.start("r1", PROMPT, SamplingParams())
    assert err.value.status == 502


async def test_slow_prefill_hits_the_deadline_and_no_lease_less_release_is_sent():
    """The router never learned the lease id: it sends no release (one needs the lease); the
    prefill worker frees what it parks after the router left (test_worker_roles.py)."""
    p = prefill(context_delay_s=5.0)
    async with make_router(p, decode(), timeout_s=0.3) as router:
        with pytest.raises(DeadlineExceededError) as err:
            await router.start("r1", PROMPT, SamplingParams())
    assert err.value.status == 504
    assert p.releases == []


async def test_consumer_stopping_after_the_first_token_releases_prefill_blocks():
    p, d = prefill(), decode()
    async with make_router(p, d) as router:
        txn = await router.start("r1", PROMPT, SamplingParams())
        events = txn.events()
        first = await anext(events)
        await events.aclose()
        await txn.aclose()  # idempotent
    assert first.text == "H"
    assert [r.request_id for r in p.releases] == ["r1"]
    assert d.generations == []


async def test_typed_errors_carry_an_openai_envelope():
    p = prefill(error=WorkerError("engine crashed"))
    async with make_router(p, decode(), migration_limit=0) as router:
        with pytest.raises(PdserveError) as err:
            await router.start("r1", PROMPT, SamplingParams())
    body = err.value.to_json()["error"]
    assert body["type"] == "server_error" and body["code"] == "worker_error"
