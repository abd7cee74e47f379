"""The transfer rig of the process-level transfer tests: a prefill peer in a spawned process
(a real transceiver over a pool holding a known pattern; a tiny ParkedLookup plays the engine's
parked-block table), the decode side in the test's process, and the checks of what landed.

``BACKENDS`` lists the backends this machine can run (tcp always; nixl and ucx when they
import)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing as mp
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest
import torch

from pdserve.errors import HandleError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.settings import TransferSettings
from pdserve.transfer import Transceiver, create_transceiver
from tests.support.kv_peer import TEST_KEY
from tests.support.servers import wait_until_sync

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


def backend_cfg(backend: str, timeout_s: float = 10.0) -> TransferSettings:
    return TransferSettings.model_validate(
        {"backend": backend, "ucx_devices": "lo", "timeout_s": timeout_s}
    )


def zeros_pool(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    shape = (layout.num_layers, num_blocks, 2, layout.tokens_per_block, layout.num_kv_heads)
    return torch.zeros((*shape, layout.head_dim), dtype=getattr(torch, layout.dtype))


def pattern_pool(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Every element distinct (exact in float32 below 2**24), so a misplaced byte shows."""
    pool = zeros_pool(layout, num_blocks)
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
    pool = pattern_pool(layout, num_blocks)
    t = create_transceiver(
        backend_cfg(backend),
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


async def decode_transceiver(
    backend: str, layout: KVLayout = LAYOUT, timeout_s: float = 10.0
) -> tuple[Transceiver, torch.Tensor]:
    pool = zeros_pool(layout, NUM_BLOCKS)
    t = create_transceiver(
        backend_cfg(backend, timeout_s),
        pool=pool,
        layout=layout,
        worker_id="decode-0",
        epoch=1,
        parked=None,
        key=TEST_KEY,
    )
    await t.start()
    return t, pool


def assert_landed(pool: torch.Tensor, src: list[int], dst: list[int], layout: KVLayout) -> None:
    expected = pattern_pool(layout, NUM_BLOCKS)
    assert torch.equal(pool[:, dst], expected[:, src])
    untouched = [b for b in range(pool.shape[1]) if b not in dst]
    assert not pool[:, untouched].any()


BIG = LAYOUT.model_copy(update={"num_kv_heads": 4, "head_dim": 64, "tokens_per_block": 16})
BIG_BLOCKS = 512  # 3 layers * 512 blocks * 32 KiB = 48 MiB


LAYOUT_SMALL = KVLayout(
    model="tiny", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="float32"
)
"""A small layout for tests of a transceiver's serving side in this process."""


@asynccontextmanager
async def serving_transceiver(fill: float = 1.0) -> AsyncIterator[Transceiver]:
    """A real TCP-backend transceiver over a pool full of ``fill`` (standing for KV data)."""
    shape = (
        LAYOUT_SMALL.num_layers,
        4,
        2,
        LAYOUT_SMALL.tokens_per_block,
        LAYOUT_SMALL.num_kv_heads,
        LAYOUT_SMALL.head_dim,
    )
    t = create_transceiver(
        TransferSettings(backend="tcp"),
        pool=torch.full(shape, fill),
        layout=LAYOUT_SMALL,
        worker_id="prefill-doc",
        epoch=42,
        parked=None,
        key=TEST_KEY,
    )
    await t.start()
    try:
        yield t
    finally:
        await t.close()
