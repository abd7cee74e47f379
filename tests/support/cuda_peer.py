"""A prefill transfer peer in its own process with its KV pool on a chosen device (CPU or CUDA).

:class:`PatternPeer` spawns a process that runs a real transceiver over a pool of ``layout``
filled with :func:`pattern` (every element distinct) on ``device``, with a parked-block table
the test fills through the pipe (``park``). The calling process plays the decode worker. Used by
the GPU tests and the GPU benchmark (``python -m tests.gpu.bench_gpu``).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

import torch

from pdserve.errors import HandleError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.settings import TransferSettings

PREFILL_ID = "gpu-prefill"
EPOCH = 11


def transfer_cfg(backend: str, *, integrity: bool = True, timeout_s: float = 30.0) -> Any:
    """Loopback transfer settings (``ucx_devices="lo"``)."""
    return TransferSettings.model_validate(
        {"backend": backend, "ucx_devices": "lo", "integrity": integrity, "timeout_s": timeout_s}
    )


def empty_pool(layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor:
    """Zeroed pool ``[L, num_blocks, 2, tpb, kvh, hd]`` of ``layout.dtype`` on ``device``."""
    shape = (layout.num_layers, num_blocks, 2, layout.tokens_per_block, layout.num_kv_heads)
    return torch.zeros((*shape, layout.head_dim), dtype=getattr(torch, layout.dtype), device=device)


def pattern(layout: KVLayout, num_blocks: int, device: str = "cpu") -> torch.Tensor:
    """The peer's pool content: element i = (i mod 2**24) + 1 (exact in float32; distinct for
    pools under 2**24 elements, which a misplaced byte then shows)."""
    pool = empty_pool(layout, num_blocks, device)
    values = torch.arange(pool.numel(), dtype=torch.float32, device=device) % (1 << 24) + 1
    pool.view(-1).copy_(values)
    return pool


class _Parked:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def lookup(self, request_id: str, epoch: int, lease_id: str | None = None) -> list[int]:
        if epoch != EPOCH or request_id not in self.blocks:
            raise HandleError(f"no parked request {request_id} at epoch {epoch}")
        return self.blocks[request_id]

    def release(self, request_id: str, lease_id: str | None = None) -> None:
        pass  # blocks stay parked: the same handle can be pulled again (benchmark loops)


def _child(pipe: Pipe, backend: str, layout: KVLayout, num_blocks: int, device: str) -> None:
    asyncio.run(_serve(pipe, backend, layout, num_blocks, device))


async def _serve(pipe: Pipe, backend: str, layout: KVLayout, num_blocks: int, device: str) -> None:
    from pdserve.transfer import create_transceiver
    from tests.support.kv_peer import TEST_KEY

    parked = _Parked()
    pool = pattern(layout, num_blocks, device)
    t = create_transceiver(
        transfer_cfg(backend),
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
    while (msg := await loop.run_in_executor(None, pipe.recv))[0] != "stop":
        if msg[0] == "park":
            parked.blocks[msg[1]] = list(msg[2])
            pipe.send("ok")
        elif msg[0] == "errors":
            pipe.send([f"{type(e).__name__}: {e.message}" for e in t.recent_errors])
    await t.close()


class PatternPeer:
    """Handle on the spawned prefill peer. Raises RuntimeError if it does not start in 120 s
    (CUDA initialisation and a NIXL agent included)."""

    def __init__(self, backend: str, layout: KVLayout, num_blocks: int, device: str):
        self.layout = layout
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child, args=(child, backend, layout, num_blocks, device), daemon=True
        )
        self.proc.start()
        if not self._pipe.poll(120):
            self.stop()
            raise RuntimeError("prefill peer did not start")
        self.endpoint, self.backend = self._pipe.recv()

    def park(self, request_id: str, block_ids: list[int]) -> TransferHandle:
        """Park ``block_ids`` (all full: ``len * tpb`` tokens) under ``request_id``."""
        self._pipe.send(("park", request_id, block_ids))
        assert self._pipe.recv() == "ok"
        return TransferHandle(
            worker_id=PREFILL_ID,
            epoch=EPOCH,
            request_id=request_id,
            lease_id="gpu-lease",
            block_ids=tuple(block_ids),
            num_tokens=len(block_ids) * self.layout.tokens_per_block,
            lease_deadline=time.time() + 3600,
            layout=self.layout,
            backend=self.backend,
            transfer_endpoint=self.endpoint,
        )

    def errors(self) -> list[str]:
        """The transfer errors the peer's serving side recorded."""
        self._pipe.send(("errors",))
        return self._pipe.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self._pipe.send(("stop",))
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
