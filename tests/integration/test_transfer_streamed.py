"""The streamed hand-off on every transfer backend, between two processes: a handle published
when the prefill starts, each prefill chunk's blocks pulled as they are computed, the first
token last.

The prefill side (:mod:`tests.support.kv_peer`) plays the prefill with the lease table's
streaming calls (``stream``, ``stream_step``: a chunk completed some blocks, ``stream_finish``:
the park and the first token, ``stream_fail``); the decode side pulls in this process with
``Transceiver.pull_streamed``. Integrity digests are on (checked per chunk).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.errors import HandleError
from tests.support.kv_peer import PrefillProcess
from tests.support.servers import wait_until
from tests.support.transfer import assert_landed
from tests.support.transfer_inproc import DecodeSide, decode_side

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def prefill(prefill_process: PrefillProcess) -> PrefillProcess:
    return prefill_process.reset()


@pytest.fixture
async def decode(prefill: PrefillProcess) -> AsyncIterator[DecodeSide]:
    async with decode_side(prefill.backend, worker_id="decode-s") as side:
        yield side


async def test_chunks_land_as_they_are_computed_and_the_first_token_comes_last(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    handle = prefill.call("stream", 18, None)  # 18 tokens, 4 per block: 5 blocks
    assert handle.streamed and handle.block_ids == ()
    dst = [20, 9, 10, 11, 3]
    pull = asyncio.ensure_future(t.pull_streamed(handle, dst))
    first = prefill.call("stream_step", handle.request_id, 2)  # chunk 1: blocks 0-1
    await wait_until(lambda: bool(pool[:, 9].any()), 10, what="the first chunk's blocks")
    assert not pull.done(), "the pull waits for the rest of the prefill"
    assert_landed(pool, first, [20, 9])  # and nothing else yet
    prefill.call("stream_step", handle.request_id, 4)  # chunk 2: blocks 2-3
    blocks = prefill.call("stream_finish", handle.request_id, 1234, 18)  # the partial last
    assert await asyncio.wait_for(pull, 10) == 1234
    assert_landed(pool, blocks, dst)
    released = prefill.wait_state(lambda s: s.parked == 0)
    assert released.released_total >= 1, "one Release after the last chunk"


async def test_a_prefill_that_fails_midway_ends_the_pull_cleanly(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, _ = decode
    handle = prefill.call("stream", 12, None)
    pull = asyncio.ensure_future(t.pull_streamed(handle, [1, 2, 3]))
    prefill.call("stream_step", handle.request_id, 1)
    await asyncio.sleep(0.2)  # the first chunk moves; the pull waits for the next
    prefill.call("stream_fail", handle.request_id, "prefill failed")
    with pytest.raises(HandleError, match="prefill failed"):
        await asyncio.wait_for(pull, 10)
    # The connection stays usable: a whole hand-off right after it succeeds.
    whole = prefill.park(num_tokens=4)
    await t.pull(whole, [7])
    assert decode.pool[:, 7].any() and not decode.pool[:, 3].any()


async def test_a_streamed_handle_cannot_be_pulled_whole_or_under_another_lease(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, _ = decode
    handle = prefill.call("stream", 8, None)
    with pytest.raises(Exception, match="pull_streamed"):
        await t.pull(handle, [1, 2])
    forged = handle.model_copy(update={"lease_id": "0" * 32})
    pull = t.pull_streamed(forged, [1, 2])
    with pytest.raises(HandleError, match="no KV blocks are parked"):
        await asyncio.wait_for(pull, 10)
