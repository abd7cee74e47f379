"""KV transfer between two real processes, over each backend (tcp, nixl, ucx).

The prefill worker is a spawned process running a real transceiver over a pool filled with a
known pattern; a tiny ParkedLookup there plays the engine's parked-block table. This test
process is the decode worker. Real bytes cross a real process boundary; nothing is faked on the
transfer path.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing as mp
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest
import torch

from pdserve.errors import HandleError, LayoutMismatchError, TransferError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.settings import TransferSettings
from pdserve.transfer import Transceiver, create_transceiver
from tests.fixtures.servers import wait_until, wait_until_sync
from tests.integration.kv_peer import TEST_KEY

pytestmark = pytest.mark.timeout(60)

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
HAVE_UCXX = importlib.util.find_spec("ucxx") is not None
BACKENDS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="no nixl")),
    pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCXX, reason="no ucxx")),
]

LAYOUT = KVLayout(
    model="tiny-test", num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="float32"
)
NUM_BLOCKS = 16
PREFILL_ID = "prefill-0"
EPOCH = 7


def _cfg(backend: str, timeout_s: float = 10.0) -> TransferSettings:
    return TransferSettings.model_validate(
        {"backend": backend, "ucx_devices": "lo", "timeout_s": timeout_s}
    )


def _pool(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    shape = (layout.num_layers, num_blocks, 2, layout.tokens_per_block, layout.num_kv_heads)
    return torch.zeros((*shape, layout.head_dim), dtype=getattr(torch, layout.dtype))


def _pattern(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Every element distinct (exact in float32 below 2**24), so a misplaced byte shows."""
    pool = _pool(layout, num_blocks)
    pool.view(-1).copy_(torch.arange(pool.numel(), dtype=torch.float32) % (1 << 24) + 1)
    return pool


class _Parked:
    """The prefill side's parked-block table (logic around the real path)."""

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.blocks: dict[str, list[int]] = {}
        self.released: list[str] = []
        # request id -> exit delay (None: right now; "mid": after half of the KV bytes, tcp)
        self.die: dict[str, float | str | None] = {}
        self.slow: dict[str, float] = {}  # request id -> seconds lookup blocks the prefill

    def lookup(self, request_id: str, epoch: int, lease_id: str) -> list[int]:
        if epoch != self.epoch or request_id not in self.blocks:
            raise HandleError(f"no parked request {request_id} at epoch {epoch}")
        time.sleep(self.slow.get(request_id, 0.0))  # a slow peer: blocks its loop on purpose
        if request_id in self.die:
            delay = self.die[request_id]
            if delay is None:
                os._exit(3)
            if delay == "mid":
                _die_after_half_of_the_bytes()
            else:
                asyncio.get_running_loop().call_later(delay, os._exit, 3)
        return self.blocks[request_id]

    def release(self, request_id: str, lease_id: str | None = None) -> None:
        self.released.append(request_id)
        self.blocks.pop(request_id, None)


def _die_after_half_of_the_bytes() -> None:
    """Make this (prefill) process exit once the first half of a TCP KV stream is out: a
    death mid-stream, whatever the speed of the machine."""
    from pdserve.transfer import tcp

    original = tcp.Connection.send_segments

    async def half_then_exit(self, pool, offsets, lengths, header=None):  # type: ignore[no-untyped-def]
        k = max(1, len(offsets) // 2)
        await original(self, pool, offsets[:k], lengths[:k], header)
        os._exit(3)

    tcp.Connection.send_segments = half_then_exit  # type: ignore[method-assign]


def _prefill_process(pipe: Pipe, backend: str, layout: KVLayout, num_blocks: int) -> None:
    asyncio.run(_prefill_main(pipe, backend, layout, num_blocks))


async def _prefill_main(pipe: Pipe, backend: str, layout: KVLayout, num_blocks: int) -> None:
    parked = _Parked(EPOCH)
    pool = _pattern(layout, num_blocks)
    t = create_transceiver(
        _cfg(backend),
        pool=pool,
        layout=layout,
        worker_id=PREFILL_ID,
        epoch=EPOCH,
        parked=parked,
        key=TEST_KEY,
    )
    await t.start()
    pipe.send((t.endpoint, t.backend))
    loop = asyncio.get_running_loop()
    while True:
        cmd, *args = await loop.run_in_executor(None, pipe.recv)
        if cmd == "park":
            parked.blocks[args[0]] = args[1]
            pipe.send("ok")
        elif cmd == "die":
            parked.die[args[0]] = args[1]
            pipe.send("ok")
        elif cmd == "slow":
            parked.slow[args[0]] = args[1]
            pipe.send("ok")
        elif cmd == "state":
            errors = [(type(e).__name__, e.message) for e in t.recent_errors]
            pipe.send((list(parked.released), errors))
        elif cmd == "stop":
            break
    await t.close()


class PrefillPeer:
    """Handle on a spawned prefill process."""

    def __init__(self, backend: str, layout: KVLayout = LAYOUT, num_blocks: int = NUM_BLOCKS):
        self.layout = layout
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_prefill_process, args=(child, backend, layout, num_blocks), daemon=True
        )
        self.proc.start()
        if not self._pipe.poll(60):
            raise RuntimeError("prefill process did not start")
        self.endpoint, self.backend = self._pipe.recv()

    def park(self, request_id: str, block_ids: list[int], epoch: int = EPOCH) -> TransferHandle:
        self.call("park", request_id, block_ids)
        return TransferHandle(
            worker_id=PREFILL_ID,
            epoch=epoch,
            request_id=request_id,
            lease_id=f"lease-{request_id}",
            block_ids=tuple(block_ids),
            num_tokens=len(block_ids) * self.layout.tokens_per_block,
            lease_deadline=time.time() + 60,
            layout=self.layout,
            backend=self.backend,
            transfer_endpoint=self.endpoint,
        )

    def call(self, *cmd: Any) -> Any:
        self._pipe.send(cmd)
        return self._pipe.recv()

    def state(self) -> tuple[list[str], list[tuple[str, str]]]:
        return self.call("state")

    def wait_released(self, request_id: str, timeout: float = 5.0) -> list[str]:
        """The released request ids once ``request_id`` is among them (AssertionError after
        ``timeout`` seconds)."""
        released: list[str] = []

        def arrived() -> bool:
            released[:] = self.state()[0]
            return request_id in released

        wait_until_sync(arrived, timeout, interval_s=0.02, what=f"the Release of {request_id}")
        return released

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # it may have just died on purpose
            self._pipe.send(("stop",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@pytest.fixture(scope="module", params=BACKENDS)
def prefill(request: pytest.FixtureRequest) -> Iterator[PrefillPeer]:
    peer = PrefillPeer(request.param)
    yield peer
    peer.stop()


async def _decode(
    backend: str, layout: KVLayout = LAYOUT, timeout_s: float = 10.0
) -> tuple[Transceiver, torch.Tensor]:
    pool = _pool(layout, NUM_BLOCKS)
    t = create_transceiver(
        _cfg(backend, timeout_s),
        pool=pool,
        layout=layout,
        worker_id="decode-0",
        epoch=1,
        parked=None,
        key=TEST_KEY,
    )
    await t.start()
    return t, pool


@pytest.fixture
async def decode(prefill: PrefillPeer) -> AsyncIterator[tuple[Transceiver, torch.Tensor]]:
    t, pool = await _decode(prefill.backend)
    yield t, pool
    await t.close()


def _assert_landed(pool: torch.Tensor, src: list[int], dst: list[int], layout: KVLayout) -> None:
    expected = _pattern(layout, NUM_BLOCKS)
    assert torch.equal(pool[:, dst], expected[:, src])
    untouched = [b for b in range(pool.shape[1]) if b not in dst]
    assert not pool[:, untouched].any()


async def test_pull_copies_every_layer_into_other_block_ids_and_releases(prefill, decode):
    t, pool = decode
    src, dst = [3, 4, 5, 9, 12], [10, 11, 0, 2, 7]
    await t.pull(prefill.park("r1", src), dst)
    _assert_landed(pool, src, dst, LAYOUT)
    assert "r1" in prefill.wait_released("r1")
    assert t.communicator() == {"backend": prefill.backend, "endpoint": t.endpoint}


async def test_concurrent_pulls_reuse_connections_and_land_in_their_blocks(prefill, decode):
    t, pool = decode
    pairs = {"c1": ([0, 1], [4, 5]), "c2": ([8], [9]), "c3": ([13, 14, 15], [1, 2, 3])}
    handles = {rid: prefill.park(rid, src) for rid, (src, _) in pairs.items()}
    await asyncio.gather(*(t.pull(handles[rid], dst) for rid, (_, dst) in pairs.items()))
    await t.pull(prefill.park("c4", [6]), [12])  # an idle, already handshaken connection
    srcs = [b for src, _ in pairs.values() for b in src] + [6]
    dsts = [b for _, dst in pairs.values() for b in dst] + [12]
    _assert_landed(pool, srcs, dsts, LAYOUT)


async def test_unknown_request_raises_handle_error_and_connection_stays_usable(prefill, decode):
    t, pool = decode
    good = prefill.park("u1", [2])
    with pytest.raises(HandleError, match="no parked request nope"):
        await t.pull(good.model_copy(update={"request_id": "nope"}), [3])
    await t.pull(good, [3])
    _assert_landed(pool, [2], [3], LAYOUT)


async def test_handle_of_another_epoch_raises_handle_error(prefill, decode):
    t, pool = decode
    stale = prefill.park("e1", [1], epoch=EPOCH - 1)
    with pytest.raises(HandleError, match="epoch"):
        await t.pull(stale, [1])
    assert not pool.any()


async def test_wrong_destination_count_raises_transfer_error(prefill, decode):
    t, _ = decode
    with pytest.raises(TransferError, match="destination blocks"):
        await t.pull(prefill.park("w1", [1, 2]), [5])


async def test_layout_mismatch_is_refused_on_both_sides_naming_the_field(prefill):
    other = LAYOUT.model_copy(update={"num_kv_heads": 4})  # tokens/block, dtype: converted
    t, pool = await _decode(prefill.backend, layout=other)
    try:
        with pytest.raises(LayoutMismatchError, match="num_kv_heads: 2 != 4"):
            await t.pull(prefill.park("m1", [1]), [1])
    finally:
        await t.close()
    _, errors = prefill.state()
    assert any(name == "LayoutMismatchError" and "num_kv_heads" in msg for name, msg in errors)
    assert not pool.any()


@pytest.mark.skipif(not HAVE_NIXL, reason="no nixl")
async def test_backend_mismatch_is_refused_clearly(prefill):
    other = "tcp" if prefill.backend == "nixl" else "nixl"
    t, _ = await _decode(other)
    try:
        with pytest.raises(TransferError, match="same transfer backend"):
            await t.pull(prefill.park("b1", [1]), [1])
    finally:
        await t.close()


async def test_unresponsive_peer_times_out_with_transfer_error(prefill):
    t, _ = await _decode(prefill.backend, timeout_s=1.0)
    handle = prefill.park("s1", [1])
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TransferError, match="timed out"):
            await t.pull(handle, [1])
        assert time.monotonic() - started < 5
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
        await t.close()


def _gave_up_count(prefill: PrefillPeer) -> int:
    """How many sends the prefill side dropped because the decode side had given up."""
    return sum("gave up on" in message for _, message in prefill.state()[1])


async def test_pull_that_gives_up_gets_nothing_written_into_its_blocks(prefill):
    t, pool = await _decode(prefill.backend, timeout_s=0.5)
    try:
        handle = prefill.park("g1", [1, 2])
        prefill.call("slow", "g1", 1.0)  # the answer comes after the decode gave up
        gave_up = _gave_up_count(prefill)
        with pytest.raises(TransferError, match="timed out"):
            await t.pull(handle, [3, 4])
        # The prefill side is awake again once it answers g2 (its loop slept through g1's
        # lookup); a WRITE backend then also reports g1 as given up, its chance to write gone.
        await t.pull(prefill.park("g2", [5]), [6])  # the transceiver still works
        if prefill.backend != "tcp":  # TCP bytes land only while a pull reads them
            await wait_until(
                lambda: _gave_up_count(prefill) > gave_up,
                5.0,
                what="the prefill side to see that the decode side gave up on g1",
            )
        assert not pool[:, [3, 4]].any()
        _assert_landed(pool, [5], [6], LAYOUT)
    finally:
        await t.close()


async def test_unreachable_peer_raises_transfer_error(prefill):
    t, _ = await _decode(prefill.backend)
    handle = prefill.park("x1", [1]).model_copy(update={"transfer_endpoint": "127.0.0.1:9"})
    try:
        with pytest.raises(TransferError, match="unreachable"):
            await t.pull(handle, [1])
    finally:
        await t.close()


BIG = LAYOUT.model_copy(update={"num_kv_heads": 4, "head_dim": 64, "tokens_per_block": 16})
BIG_BLOCKS = 512  # 3 layers * 512 blocks * 32 KiB = 48 MiB


@pytest.mark.parametrize(
    ("backend", "delay"),
    [
        ("tcp", None),
        ("tcp", "mid"),  # mid-stream: exits after half of the 48 MiB went out
        pytest.param("nixl", None, marks=pytest.mark.skipif(not HAVE_NIXL, reason="no nixl")),
        # No mid-flight ucx case: over shared memory the 48 MiB land in about 10 ms, too close
        # to a 5 ms kill to fail reliably (the pull sometimes completes first).
        pytest.param("ucx", None, marks=pytest.mark.skipif(not HAVE_UCXX, reason="no ucxx")),
    ],
)
async def test_peer_dying_mid_transfer_raises_transfer_error(backend, delay):
    peer = PrefillPeer(backend, layout=BIG, num_blocks=BIG_BLOCKS)
    pool = _pool(BIG, BIG_BLOCKS)
    t = create_transceiver(
        _cfg(backend),
        pool=pool,
        layout=BIG,
        worker_id="decode-1",
        epoch=1,
        parked=None,
        key=TEST_KEY,
    )
    try:
        await t.start()
        handle = peer.park("d1", list(range(BIG_BLOCKS)))
        peer.call("die", "d1", delay)
        started = time.monotonic()
        with pytest.raises(TransferError, match="closed the connection|lost"):
            await t.pull(handle, list(range(BIG_BLOCKS)))
        assert time.monotonic() - started < 5
    finally:
        await t.close()
        peer.stop()
