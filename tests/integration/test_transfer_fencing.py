"""Fencing on every transfer backend: stale or foreign handles are refused by both sides.

The prefill side (a real transceiver, KV cache manager and lease table in a spawned process,
:mod:`tests.support.kv_peer`) refuses a SendBlocks naming an old epoch, another lease id, an
expired lease, blocks that are not the parked ones, or a block that changed hands since it was
parked. The decode side (this process's real transceiver) refuses, before asking, a handle
whose lease has run out, whose epoch is not the one the handshake found (also after the prefill
worker restarted), or whose block ids lie outside the prefill pool. Every refusal is a
HandleError with a message that names the reason, and moves no byte.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdserve.errors import HandleError, TransferError
from pdserve.protocol import TransferHandle
from pdserve.transfer import wire
from pdserve.transfer.connection.control import Connection
from tests.support.kv_peer import PrefillProcess
from tests.support.transfer import assert_landed
from tests.support.transfer_inproc import DecodeSide, bare_side, decode_side

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def prefill(prefill_process: PrefillProcess) -> PrefillProcess:
    return prefill_process.reset()  # nothing parked, pattern intact, true clock, no recorded errors


@pytest.fixture
async def decode(prefill: PrefillProcess) -> AsyncIterator[DecodeSide]:
    async with decode_side(prefill.backend, worker_id="decode-f") as side:
        yield side


def _refused_by_prefill(prefill: PrefillProcess, match: str) -> None:
    errors = prefill.state().errors
    assert errors and errors[-1][0] == "HandleError" and match in errors[-1][1], errors


async def test_pull_under_a_valid_lease_copies_the_blocks_and_releases_the_park(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=10)
    free_before = prefill.state().free_blocks
    await t.pull(handle, [20, 21, 22])
    assert_landed(pool, handle.block_ids, [20, 21, 22])
    state = prefill.wait_state(lambda s: s.parked == 0)
    assert state.parked == 0 and state.released_total == 1
    assert state.free_blocks == free_before + 3
    assert state.digests_computed >= 1, "integrity is on by default"


# --- refused by the decode side, before it asks -----------------------------------------------


async def test_handle_of_another_epoch_is_refused_by_the_decode_side_after_the_handshake(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    stale = handle.model_copy(update={"epoch": prefill.epoch - 1})
    with pytest.raises(HandleError, match=f"epoch {prefill.epoch - 1}.*serves .* epoch 7"):
        await t.pull(stale, [3])
    assert prefill.state().errors == [], "the prefill side never saw a SendBlocks"
    assert not pool.any()
    await t.pull(handle, [3])  # the real handle still works: nothing was released or freed


async def test_expired_lease_is_refused_by_the_decode_side_without_asking(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    expired = handle.model_copy(update={"lease_deadline": handle.lease_deadline - 120})
    with pytest.raises(HandleError, match="expired .* ago"):
        await t.pull(expired, [3])
    state = prefill.state()
    assert state.errors == [] and state.parked == 1
    assert not pool.any()


async def test_block_ids_outside_the_prefill_pool_are_refused_by_the_decode_side(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=8)
    foreign = handle.model_copy(update={"block_ids": (handle.block_ids[0], 4096)})
    with pytest.raises(HandleError, match=r"names KV blocks .*4096.* has blocks 0\.\.31"):
        await t.pull(foreign, [3, 4])
    assert prefill.state().errors == []
    assert not pool.any()


# --- refused by the prefill side --------------------------------------------------------------


async def ask_bare(prefill: PrefillProcess, **send_blocks: object) -> wire.Message:
    """A decode side that skips its own checks: a bare connection that authenticates, says
    Hello, sends one SendBlocks with ``send_blocks`` and returns the prefill side's answer
    (its own pool, untouched by a refusal, is checked empty)."""
    with bare_side(prefill.backend, worker_id="decode-raw") as (local, pool):
        conn = await Connection.open(prefill.endpoint, 10.0)
        try:
            await local.connect(conn)  # authenticates both ways, then Hello / HelloAck
            await conn.send(wire.SendBlocks.model_validate({"transfer_id": "t-raw", **send_blocks}))
            answer = await conn.recv()
        finally:
            conn.close()
    assert not pool.any()
    return answer


async def test_send_blocks_naming_an_old_epoch_is_refused_by_the_prefill_side(
    prefill: PrefillProcess,
) -> None:
    """A decode side that skipped its own check is still refused by the prefill worker's
    lease table."""
    handle = prefill.park(num_tokens=4)
    answer = await ask_bare(
        prefill, request_id=handle.request_id, epoch=prefill.epoch - 1, lease_id=handle.lease_id,
        src_block_ids=handle.block_ids, dst_block_ids=(0,),
    )  # fmt: skip
    assert isinstance(answer, wire.TransferFailed)
    assert answer.code == "kv_handle_invalid"
    assert "another epoch" in answer.message and "restarted" in answer.message
    assert str(prefill.epoch) not in answer.message, "the refusal names no epoch"
    assert prefill.state().parked == 1, "a refused handle frees nothing"


async def test_expired_lease_is_refused_by_the_prefill_side_and_its_blocks_freed(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    prefill.call("skew", 61.0)  # the prefill worker's lease ran out; the handle claims otherwise
    before = prefill.state()
    with pytest.raises(HandleError, match="expired before the transfer"):
        await t.pull(handle, [3])
    _refused_by_prefill(prefill, "expired")
    after = prefill.state()
    assert after.parked == 0 and after.free_blocks == before.free_blocks + 1
    assert not pool.any()


async def test_handle_with_another_lease_id_is_refused_by_the_prefill_side(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=4)
    forged = handle.model_copy(update={"lease_id": "0" * 32})
    with pytest.raises(HandleError, match="no KV blocks are parked under this handle") as err:
        await t.pull(forged, [3])
    _refused_by_prefill(prefill, "another park")
    assert handle.lease_id not in str(err.value), "the refusal never tells the real lease id"
    assert str(handle.block_ids[0]) not in str(err.value)
    assert not pool.any()
    await t.pull(handle, [3])  # the genuine handle is unaffected
    assert_landed(pool, handle.block_ids, [3])


async def test_handle_of_a_previous_park_of_the_same_request_is_refused(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    first = prefill.park(num_tokens=4)
    await t.pull(first, [3])  # pulled and released
    prefill.wait_state(lambda s: s.parked == 0)
    second = prefill.park(4, first.request_id)  # same request id parked again (a retry)
    with pytest.raises(HandleError, match="no KV blocks are parked under this handle") as err:
        await t.pull(first, [4])
    assert second.lease_id not in str(err.value)
    assert not pool[:, 4].any()
    await t.pull(second, [4])


async def test_block_ids_that_are_not_the_parked_ones_are_refused_by_the_prefill_side(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=8)
    other = tuple(b for b in range(8) if b not in handle.block_ids)[:2]
    with pytest.raises(HandleError, match="blocks asked for .* are not the handle's") as err:
        await t.pull(handle.model_copy(update={"block_ids": other}), [3, 4])
    _refused_by_prefill(prefill, "are not the handle's")
    assert not any(str(b) in str(err.value) for b in handle.block_ids), "no parked id leaks"
    assert not pool.any()


async def test_block_freed_and_reallocated_after_the_park_is_never_sent(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=8)
    stolen = prefill.call("steal", handle.request_id)  # freed, then given to another request
    assert set(handle.block_ids) <= set(stolen)
    with pytest.raises(HandleError, match="a KV block of the handle .* reallocated"):
        await t.pull(handle, [3, 4])
    _refused_by_prefill(prefill, "refusing to send it")
    assert not pool.any(), "not one byte of the other request's blocks arrived"


async def test_handle_from_before_a_prefill_restart_is_refused_after_re_handshaking(
    prefill: PrefillProcess,
) -> None:
    """The decode side holds a handshaken session with the old incarnation; the prefill worker
    restarts on the same endpoint with a new epoch; the old handle is refused (the new
    incarnation's handles work)."""
    first = PrefillProcess(prefill.backend, epoch=100)
    port = int(first.endpoint.rsplit(":", 1)[1])
    second: PrefillProcess | None = None
    try:
        async with decode_side(prefill.backend, worker_id="decode-r") as (t, pool):
            await t.pull(first.park(num_tokens=4), [0])  # session with epoch 100
            old = first.park(num_tokens=4)
            first.stop()
            second = PrefillProcess(prefill.backend, epoch=200, port=port)
            with pytest.raises(HandleError, match=r"epoch 100, but .* serves .* epoch 200"):
                await t.pull(old, [1])
            assert not pool[:, 1].any()
            await t.pull(second.park(num_tokens=4), [2])
            assert pool[:, 2].any()
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_handles_name_the_lease_they_were_issued_under(prefill: PrefillProcess) -> None:
    a, b = prefill.park(num_tokens=4), prefill.park(num_tokens=4)
    assert isinstance(a, TransferHandle) and a.lease_id != b.lease_id


# --- delta transfer: the decode side already holds the leading blocks ---------------------------


async def test_delta_pull_moves_only_the_blocks_after_the_skipped_ones(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=10)  # 3 blocks at 4 tokens per block
    released = prefill.state().released_total
    await t.pull(handle, [20, 21, 22], skip_blocks=2)
    assert not pool[:, [20, 21]].any(), "the skipped blocks were not sent"
    assert_landed(pool, handle.block_ids[2:], [22])
    state = prefill.wait_state(lambda s: s.parked == 0)
    assert state.released_total == released + 1 and state.errors == []


async def test_delta_pull_that_would_move_nothing_is_refused_before_asking(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.park(num_tokens=8)
    with pytest.raises(TransferError, match="skipping 2 of 2 blocks"):
        await t.pull(handle, [3, 4], skip_blocks=2)
    assert prefill.state().lookups == 0
    assert not pool.any()


async def test_delta_request_naming_blocks_other_than_the_parked_tail_is_refused(
    prefill: PrefillProcess,
) -> None:
    handle = prefill.park(num_tokens=12)
    answer = await ask_bare(
        prefill, request_id=handle.request_id, epoch=handle.epoch, lease_id=handle.lease_id,
        src_block_ids=handle.block_ids[:2],  # the head, not the tail after the skip
        dst_block_ids=(0, 1), skip_blocks=1,
    )  # fmt: skip
    assert isinstance(answer, wire.TransferFailed) and answer.code == "kv_handle_invalid"
    assert "after skipping 1" in answer.message
    assert prefill.state().parked == 1, "a refused request frees nothing"
