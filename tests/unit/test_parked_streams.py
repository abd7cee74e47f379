"""Streamed parks on the prefill worker (the streamed hand-off): a lease id issued at admission,
blocks handed to the sender as prefill chunks complete them, fenced like a park."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import HandleError
from pdserve.protocol import KVLayout
from pdserve.workers.kv.manager import KVCacheManager
from pdserve.workers.roles.parking import ParkedBlocks

LAYOUT = KVLayout(
    model="m", num_layers=2, num_kv_heads=1, head_dim=4, tokens_per_block=4, dtype="float32"
)


@pytest.fixture
def kv() -> KVCacheManager:
    return KVCacheManager(LAYOUT, num_blocks=8)


@pytest.fixture
def parked(kv: KVCacheManager) -> ParkedBlocks:
    return ParkedBlocks(epoch=7, lease_s=30.0, free_blocks=kv.free, generations=kv.generations)


def _wait(parked: ParkedBlocks, lease_id: str, have: int, *, whole: bool = False, timeout=1.0):
    return parked.wait_streamed("r", 7, lease_id, have, whole=whole, timeout=timeout)


async def test_chunks_then_the_park_and_the_first_token(
    parked: ParkedBlocks, kv: KVCacheManager
) -> None:
    blocks = kv.allocate("r", 14)  # 4 blocks
    lease = parked.open_stream("r", deadline=10**10)
    assert await _wait(parked, lease.lease_id, 0, timeout=0.01) is None, "nothing computed yet"
    waiter = asyncio.ensure_future(_wait(parked, lease.lease_id, 0))
    await asyncio.sleep(0)
    parked.stream_progress("r", blocks[:2])
    assert await waiter == (blocks[:2], False, None)
    whole = asyncio.ensure_future(_wait(parked, lease.lease_id, 2, whole=True))
    parked.stream_progress("r", blocks[:3])
    await asyncio.sleep(0.01)
    assert not whole.done(), "a re-blocking formatter waits for the end"
    assert parked.park("r", blocks, num_tokens=14).lease_id == lease.lease_id
    parked.finish_stream("r", 42)
    assert await whole == (blocks, True, 42)
    assert parked.release("r", lease.lease_id) is True
    assert kv.get_num_free_blocks() == 8


async def test_a_failed_prefill_ends_the_waiting_sender(parked: ParkedBlocks) -> None:
    lease = parked.open_stream("r", deadline=10**10)
    waiter = asyncio.ensure_future(_wait(parked, lease.lease_id, 0))
    await asyncio.sleep(0)
    parked.fail_stream("r", "the prefill failed")
    with pytest.raises(HandleError, match="the prefill failed"):
        await waiter
    with pytest.raises(HandleError, match="no KV blocks are parked"):
        await _wait(parked, lease.lease_id, 0)


async def test_refusals_are_those_of_a_park(parked: ParkedBlocks) -> None:
    lease = parked.open_stream("r", deadline=10**10)
    with pytest.raises(HandleError, match="already parked"):
        parked.open_stream("r", deadline=10**10)
    with pytest.raises(HandleError, match="no KV blocks are parked"):
        await _wait(parked, "f" * 32, 0)
    with pytest.raises(HandleError, match="another epoch"):
        await parked.wait_streamed("r", 6, lease.lease_id, 0, whole=False, timeout=0.01)


async def test_a_streamed_block_reused_before_the_park_is_refused(
    parked: ParkedBlocks, kv: KVCacheManager
) -> None:
    blocks = kv.allocate("r", 8)
    lease = parked.open_stream("r", deadline=10**10)
    parked.stream_progress("r", blocks[:1])
    assert (await _wait(parked, lease.lease_id, 0))[0] == blocks[:1]
    kv.free("r")  # a preemption: the chunk's block went back and was handed out again
    again = kv.allocate("r", 8)
    parked.park("r", again, num_tokens=8)
    parked.finish_stream("r", 1)
    with pytest.raises(HandleError, match="freed before it finished"):
        await _wait(parked, lease.lease_id, 1)


async def test_the_deadline_bounds_a_stream(kv: KVCacheManager) -> None:
    now = [100.0]
    parked = ParkedBlocks(epoch=7, lease_s=30.0, free_blocks=kv.free, clock=lambda: now[0])
    lease = parked.open_stream("r", deadline=110.0)
    now[0] = 111.0
    with pytest.raises(HandleError, match="deadline passed"):
        await _wait(parked, lease.lease_id, 0)
    parked.reap()
    with pytest.raises(HandleError, match="no KV blocks are parked"):
        await _wait(parked, lease.lease_id, 0)
