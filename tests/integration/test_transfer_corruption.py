"""Integrity on every transfer backend: a byte flipped on the way fails the pull, never passes.

Two ways to flip a byte, both outside production code:

- every backend: a fault hook in the prefill process (:mod:`tests.support.kv_peer`) flips
  one byte of the source between the sender's digest and the backend's move (TCP digests
  right before sending, NIXL/UCX right after the WRITE; for NIXL/UCX, memory is written
  directly: there is no wire to tamper with);
- TCP: a proxy between the decode and the prefill transceivers flips one byte of the raw KV
  stream, so the bytes really are corrupted on the wire.

In both cases the pull raises IntegrityError naming the request and the blocks, the prefill side
keeps its parked blocks (no Release: they are freed by the lease or the router's release), and
the decode side gets an error instead of blocks to resume from. With integrity switched off the
decode side does not ask for digests and the prefill side computes none.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pdserve.errors import IntegrityError
from pdserve.transfer import Transceiver, wire
from tests.support.kv_peer import PrefillProcess
from tests.support.transfer import NUM_BLOCKS, assert_landed, backend_cfg
from tests.support.transfer_inproc import DecodeSide, decode_side

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def prefill(prefill_process: PrefillProcess) -> PrefillProcess:
    return prefill_process.reset()  # nothing parked, pattern intact, true clock, no recorded errors


@pytest.fixture
async def decode(prefill: PrefillProcess) -> AsyncIterator[DecodeSide]:
    async with decode_side(prefill.backend, worker_id="decode-i") as side:
        yield side


async def _later_release_arrives(prefill: PrefillProcess, t: Transceiver) -> None:
    """Proof that a Release the decode side sent earlier would have arrived by now: pull one
    more request directly and wait until its own Release reached the prefill side (and freed
    its park), so the earlier one is not merely in flight when the test asserts its absence."""
    before = prefill.state()
    handle = prefill.park(num_tokens=4)
    await t.pull(handle, [NUM_BLOCKS - 1])
    prefill.wait_state(
        lambda s: s.released_total == before.released_total + 1 and s.parked == before.parked
    )


async def test_byte_flipped_after_the_digest_fails_the_pull_naming_the_block(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, _ = decode
    released = prefill.state().released_total
    handle = prefill.park(num_tokens=4)  # one block: 3 layers, the flip hits layer 0
    prefill.call("corrupt_next")
    with pytest.raises(
        IntegrityError,
        match=rf"request {handle.request_id}: layer 0, decode block 5 "
        rf"\(prefill block {handle.block_ids[0]}\) arrived corrupted.*1 of 3 segments differ",
    ) as caught:
        await t.pull(handle, [5])
    assert caught.value.code == "kv_integrity_failed"
    await _later_release_arrives(prefill, t)  # a Release of the failed pull would be ahead of it
    state = prefill.state()
    assert state.parked == 1, "no Release after a failed check"
    assert state.released_total == released + 1, "only the later pull's Release arrived"
    prefill.call("skew", 61.0)
    assert prefill.call("reap") == 1, "the lease still frees the blocks"


async def test_intact_pull_after_a_corrupted_one_succeeds_on_the_same_transceiver(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    t, pool = decode
    prefill.call("corrupt_next")
    with pytest.raises(IntegrityError):
        await t.pull(prefill.park(num_tokens=8), [5, 6])
    prefill.reset()  # heal the corrupted source
    handle = prefill.park(num_tokens=8)
    await t.pull(handle, [5, 6])
    assert_landed(pool, handle.block_ids, [5, 6])


async def test_with_integrity_off_no_digest_is_asked_for_or_computed(
    prefill: PrefillProcess,
) -> None:
    unchecked = backend_cfg(prefill.backend, integrity=False)
    async with decode_side(unchecked, worker_id="decode-i") as (t, pool):
        handle = prefill.park(num_tokens=4)
        before = prefill.state().digests_computed
        prefill.call("corrupt_next")  # armed, but it only fires when a digest is computed
        await t.pull(handle, [7])
        assert prefill.state().digests_computed == before
        assert_landed(pool, handle.block_ids, [7])


class FlippingProxy:
    """TCP proxy between a decode and a prefill transceiver that flips one byte in the middle
    of the next raw KV byte stream (after a BlockData header); control frames pass intact."""

    def __init__(self, target: str):
        self._target = target.rsplit(":", 1)
        self.armed = False
        self.flipped = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self._target[0], int(self._target[1]))
        pumps = [self._copy(down_r, up_w), self._frames(up_r, down_w)]
        for pump in pumps:
            task = asyncio.ensure_future(pump)
            self._tasks.add(task)

    @staticmethod
    async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                header = await reader.readexactly(wire.HEADER.size)
                payload = await reader.readexactly(wire.frame_length(header))
                writer.write(header + payload)
                msg = wire.decode(payload)
                if isinstance(msg, wire.BlockData):
                    data = bytearray(await reader.readexactly(msg.nbytes))
                    if self.armed:
                        self.armed = False
                        self.flipped += 1
                        data[len(data) // 2] ^= 0x01
                    writer.write(data)
                await writer.drain()
        writer.close()


async def test_byte_flipped_on_the_tcp_wire_fails_the_pull_naming_the_block() -> None:
    prefill = PrefillProcess("tcp")
    proxy = FlippingProxy(prefill.endpoint)
    try:
        async with decode_side("tcp", worker_id="decode-i") as (t, pool):
            via_proxy = await proxy.start()
            good = prefill.park(num_tokens=4)
            await t.pull(good.model_copy(update={"transfer_endpoint": via_proxy}), [1])
            assert_landed(pool, good.block_ids, [1])  # the proxy is faithful
            bad = prefill.park(num_tokens=4)
            proxy.armed = True  # the stream is 3 layers of one block: its middle is in layer 1
            with pytest.raises(
                IntegrityError,
                match=rf"request {bad.request_id}: layer 1, decode block 2 "
                rf"\(prefill block {bad.block_ids[0]}\) arrived corrupted",
            ):
                await t.pull(bad.model_copy(update={"transfer_endpoint": via_proxy}), [2])
            assert proxy.flipped == 1
            await _later_release_arrives(prefill, t)
            assert prefill.state().parked == 1, "the corrupted request stays parked (no Release)"
    finally:
        await proxy.close()
        prefill.stop()
