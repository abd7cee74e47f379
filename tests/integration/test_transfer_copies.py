"""How many times the KV bytes are copied between the prefill pool and the decode pool, for each
backend and layout pair, read from both transceivers' copy counters (``Transceiver.copies``,
:mod:`pdserve.transfer.formatter.copies`) after real pulls between two processes.

A spawned prefill process runs one transceiver per prefill layout below (each counts its own
sends; the test reads its counter through the pipe, before and after a pull); this test
process is the decode worker, whose fresh transceiver counts its receives. Expected staging
copies per byte moved: 0 on nixl and ucx with equal layouts, 1 on tcp (the kernel's socket
buffers), and one more on any backend when the layouts differ in dtype, tokens per block or
tensor parallel split (the converting formatter's staging buffer). CPU pools only here (a CUDA
pool on tcp adds a host staging copy per side: tests/gpu).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest

from pdserve.protocol import KVLayout, TransferHandle
from pdserve.transfer import Transceiver, create_transceiver
from pdserve.transfer.formatter.copies import (
    FORMATTER_STAGING,
    HOST_STAGING,
    RECEIVE,
    SEND,
    SIDES,
    SOCKET,
    STAGES,
    CopyCounter,
    path_copies,
)
from pdserve.workers.kv.manager import blocks_for_tokens
from pdserve.workers.roles.parking import ParkedBlocks
from tests.support.transfer import (
    BACKENDS,
    TEST_KEY,
    SpawnedPeer,
    backend_cfg,
    random_pool,
    serve_commands,
)
from tests.support.transfer_inproc import DecodeSide, decode_transceiver

pytestmark = pytest.mark.timeout(60)

DECODE = KVLayout(
    model="tiny-test", num_layers=3, num_kv_heads=2, head_dim=64, tokens_per_block=16,
    dtype="float32",
)  # fmt: skip
PREFILL_LAYOUTS = {
    "same": DECODE,
    "dtype": DECODE.model_copy(update={"dtype": "bfloat16"}),
    "tokens_per_block": DECODE.model_copy(update={"tokens_per_block": 8}),
    "tp_size": KVLayout(**{**DECODE.model_dump(), "tp_size": 2}),
}
"""Prefill layouts against the decode layout :data:`DECODE`: equal, then one difference each."""
NUM_BLOCKS = 16
NUM_TOKENS = 40
EPOCH = 5


def _prefill_process(pipe: Pipe, backend: str) -> None:
    asyncio.run(_prefill_main(pipe, backend))


async def _prefill_main(pipe: Pipe, backend: str) -> None:
    """One transceiver + lease table per prefill layout; serves park / copies / stop."""
    parked: dict[str, ParkedBlocks] = {}
    transceivers: dict[str, Transceiver] = {}
    for seed, (name, layout) in enumerate(PREFILL_LAYOUTS.items()):
        parked[name] = ParkedBlocks(epoch=EPOCH, lease_s=60, free_blocks=lambda rid: None)
        transceivers[name] = t = create_transceiver(
            backend_cfg(backend),
            pool=random_pool(layout, NUM_BLOCKS, seed),
            layout=layout,
            worker_id=f"prefill-{name}",
            epoch=EPOCH,
            parked=parked[name],
            key=TEST_KEY,
        )
        await t.start()

    async def command(cmd: str, args: list[Any]) -> object:
        if cmd == "park":
            name, request_id, block_ids = args
            lease = parked[name].park(request_id, block_ids, NUM_TOKENS)
            return lease.lease_id, lease.deadline
        assert cmd == "copies", cmd
        return transceivers[args[0]].copies  # pickled: a snapshot

    endpoints = {name: (t.endpoint, t.backend) for name, t in transceivers.items()}
    await serve_commands(pipe, endpoints, command)
    for t in transceivers.values():
        await t.close()


class Prefill(SpawnedPeer):
    """Handle on the spawned prefill process (one per backend)."""

    def __init__(self, backend: str):
        super().__init__(_prefill_process, backend)
        self.endpoints: dict[str, tuple[str, str]] = self.greeting
        self.backend = backend

    def park(self, name: str, request_id: str, block_ids: list[int]) -> TransferHandle:
        lease_id, deadline = self.call("park", name, request_id, block_ids)
        return TransferHandle(
            worker_id=f"prefill-{name}",
            epoch=EPOCH,
            request_id=request_id,
            lease_id=lease_id,
            block_ids=tuple(block_ids),
            num_tokens=NUM_TOKENS,
            lease_deadline=deadline,
            layout=PREFILL_LAYOUTS[name],
            backend=self.backend,
            transfer_endpoint=self.endpoints[name][0],
        )

    def copies(self, name: str) -> CopyCounter:
        counter: CopyCounter = self.call("copies", name)
        return counter


@pytest.fixture(scope="module", params=BACKENDS)
def prefill(request: pytest.FixtureRequest) -> Iterator[Prefill]:
    peer = Prefill(request.param)
    yield peer
    peer.stop()


@pytest.fixture
async def decode(prefill: Prefill) -> AsyncIterator[DecodeSide]:
    side = await decode_transceiver(backend_cfg(prefill.backend), DECODE, NUM_BLOCKS)
    yield side
    await side.transceiver.close()


def _since(after: CopyCounter, before: CopyCounter) -> CopyCounter:
    """What ``after`` counted since ``before`` (two snapshots of one counter)."""
    delta = CopyCounter()
    for side in SIDES:
        delta.payload[side] = after.payload[side] - before.payload[side]
        delta.transfers[side] = after.transfers[side] - before.transfers[side]
        for stage in STAGES:
            delta.staged[side, stage] = after.staged[side, stage] - before.staged[side, stage]
    return delta


@pytest.mark.parametrize("difference", list(PREFILL_LAYOUTS))
async def test_staging_copies_per_byte_for_each_backend_and_layout_pair(
    prefill: Prefill, decode: DecodeSide, difference: str
) -> None:
    """Equal layouts: 0 staging copies per byte on nixl and ucx, 1 on tcp (the socket);
    a dtype, tokens-per-block or tensor parallel difference adds 1 (the formatter's staging
    buffer). Each side counts one transfer of the same payload: the decode blocks' bytes."""
    layout = PREFILL_LAYOUTS[difference]
    src_ids = [7, 2, 11, 4, 9][: blocks_for_tokens(NUM_TOKENS, layout.tokens_per_block)]
    dst_ids = [3, 12, 5][: blocks_for_tokens(NUM_TOKENS, DECODE.tokens_per_block)]
    before = prefill.copies(difference)
    handle = prefill.park(difference, f"c-{difference}", src_ids)
    await decode.transceiver.pull(handle, dst_ids)
    sent = _since(prefill.copies(difference), before)
    received = decode.transceiver.copies

    nbytes = len(dst_ids) * DECODE.num_layers * DECODE.block_bytes_per_layer
    assert sent.transfers[SEND] == received.transfers[RECEIVE] == 1
    assert sent.payload[SEND] == received.payload[RECEIVE] == nbytes
    assert sent.transfers[RECEIVE] == received.transfers[SEND] == 0
    converted = difference != "same"
    tcp = prefill.backend == "tcp"
    assert sent.staged[SEND, FORMATTER_STAGING] == (nbytes if converted else 0)
    assert sent.staged[SEND, SOCKET] == (nbytes if tcp else 0)
    assert sent.staged[SEND, HOST_STAGING] == received.staged[RECEIVE, HOST_STAGING] == 0
    assert received.copies_per_byte() == 0.0  # a CPU decode pool: the bytes land in place
    assert path_copies(sent, received) == int(tcp) + int(converted)
