"""A decode worker whose pool is full waits for blocks while the prefill lease lasts, then
answers 429; it refuses at once beyond its queue bound or under guaranteed_no_evict."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from pdserve.config.settings import SchedulerSettings
from pdserve.errors import CapacityError, QueueFullError
from pdserve.protocol import GenerationRequest, KVLayout, SamplingParams, TransferHandle
from pdserve.workers.engine.requests import Reservation
from pdserve.workers.roles.decode import DecodeHandler
from tests.support.fakes import layout


@dataclass
class FullPool:
    """``reserve`` fails ``full_for`` times (the pool is full), then hands out blocks."""

    full_for: int
    calls: int = 0
    layout: KVLayout = field(default_factory=layout)

    def reserve(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, **_: object
    ) -> Reservation:
        self.calls += 1
        if self.calls <= self.full_for:
            raise CapacityError("cannot reserve 1 KV blocks: 0 available")
        return Reservation([3])


def request(lease_s: float) -> tuple[GenerationRequest, TransferHandle]:
    now = time.time()
    handle = TransferHandle(
        worker_id="p0",
        epoch=1,
        request_id="r1",
        lease_id="lease",
        block_ids=(0,),
        num_tokens=4,
        lease_deadline=now + lease_s,
        layout=layout(),
        backend="tcp",
        transfer_endpoint="127.0.0.1:1",
    )
    req = GenerationRequest(
        request_id="r1",
        prompt_token_ids=(1, 2, 3, 4),
        sampling=SamplingParams(max_tokens=8),
        first_token=5,
        handle=handle,
        deadline=now + 60,
    )
    return req, handle


async def test_a_full_pool_is_waited_for_until_blocks_free_up() -> None:
    engine = FullPool(full_for=3)
    role = DecodeHandler(engine=engine, transceiver=None)  # type: ignore[arg-type]
    req, handle = request(lease_s=30)
    assert (await role._reserve(req, handle)).block_ids == [3]
    assert engine.calls == 4 and role.waiting_for_blocks == 0


async def test_a_pool_that_stays_full_answers_429_before_the_lease_ends() -> None:
    role = DecodeHandler(engine=FullPool(full_for=10**9), transceiver=None)  # type: ignore[arg-type]
    req, handle = request(lease_s=1.3)
    t0 = time.monotonic()
    with pytest.raises(QueueFullError, match="before its prefill lease ran out"):
        await role._reserve(req, handle)
    assert time.monotonic() - t0 < 1.3 and role.waiting_for_blocks == 0


async def test_beyond_the_queue_bound_or_under_guaranteed_no_evict_it_refuses_at_once() -> None:
    busy = DecodeHandler(
        engine=FullPool(full_for=10**9),  # type: ignore[arg-type]
        transceiver=None,
        scheduler=SchedulerSettings(max_queued_requests=4),
    )
    busy.waiting_for_blocks = 4
    req, handle = request(lease_s=30)
    with pytest.raises(QueueFullError, match="wait for KV blocks"):
        await busy._reserve(req, handle)
    strict = FullPool(full_for=10**9)
    no_evict = SchedulerSettings(capacity_policy="guaranteed_no_evict")
    role = DecodeHandler(engine=strict, transceiver=None, scheduler=no_evict)  # type: ignore[arg-type]
    with pytest.raises(CapacityError):
        await role._reserve(req, handle)
    assert strict.calls == 1
