"""KV transfer throughput between two processes, per backend, beside a raw-socket reference.

``run_transfer_benchmark`` spawns a prefill process per backend (a real transceiver serving a
pool whose every block counts as parked) and pulls into this process's transceiver, exactly as a
decode worker does: connect + handshake once, then per request SendBlocks -> bytes -> Release.
The reference is plain blocking Python sockets between two processes moving the same sizes into
a preallocated buffer (``recv_into``), measured in the same run, since figures on a shared
machine only compare within one run.

Sizes are rounded up to whole KV blocks (one block of all layers = ``layout.bytes_per_token *
tokens_per_block`` bytes); the blocks are contiguous on both sides, so a request is one segment
per layer. GB/s = bytes / median wall time of one ``pull`` (1 GB = 1e9 bytes).

For NIXL, UCX picks its transports from its environment (same host: shared memory / CMA unless
``UCX_TLS`` says otherwise); ``cfg.ucx_devices`` restricts network devices (``lo`` here).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import socket
import statistics
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection as Pipe

import numpy as np
import torch

from pdserve.config import TransferConfig
from pdserve.errors import HandleError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.transfer.transceiver import create_transceiver

SMOLLM2_LAYOUT = KVLayout(
    model="SmolLM2-135M-Instruct",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    tokens_per_block=16,
    dtype="float32",
)
DEFAULT_SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
_EPOCH = 1
_MIN_REPS, _MAX_REPS, _MIN_SECONDS = 5, 50, 0.5


def block_bytes(layout: KVLayout) -> int:
    """Bytes of one KV block across all layers."""
    return layout.block_bytes_per_layer * layout.num_layers


def _blocks_for(layout: KVLayout, size: int) -> int:
    return max(1, math.ceil(size / block_bytes(layout)))


def _pool(layout: KVLayout, num_blocks: int, fill: float) -> torch.Tensor:
    shape = (layout.num_layers, num_blocks, 2, layout.tokens_per_block, layout.num_kv_heads)
    return torch.full((*shape, layout.head_dim), fill, dtype=getattr(torch, layout.dtype))


class _AllParked:
    """Every request ``bench-<n>-<uuid>`` has blocks 0..n-1 parked."""

    def lookup(self, request_id: str, epoch: int) -> list[int]:
        if epoch != _EPOCH or not request_id.startswith("bench-"):
            raise HandleError(f"unknown request {request_id}")
        return list(range(int(request_id.split("-")[1])))

    def release(self, request_id: str) -> None:
        pass


def _prefill_peer(pipe: Pipe, backend: str, layout: KVLayout, num_blocks: int) -> None:
    async def serve() -> None:
        cfg = TransferConfig.model_validate({"backend": backend, "ucx_devices": "lo"})
        pool = _pool(layout, num_blocks, 1.0)
        t = create_transceiver(
            cfg,
            pool=pool,
            layout=layout,
            worker_id="bench-prefill",
            epoch=_EPOCH,
            parked=_AllParked(),
        )
        await t.start()
        pipe.send((t.endpoint, t.backend))
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)  # until told to stop
        await t.close()

    asyncio.run(serve())


def _raw_peer(pipe: Pipe, max_size: int) -> None:
    buf = np.ones(max_size, dtype=np.uint8).data
    with socket.create_server(("127.0.0.1", 0)) as server:
        pipe.send(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            while request := conn.recv(8):
                size = int.from_bytes(request, "big")
                conn.sendall(buf[:size])


def _reps(run: Callable[[], None]) -> list[float]:
    run()  # warm-up: first-touch page faults, connection set-up
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < _MIN_REPS or (
        len(times) < _MAX_REPS and time.perf_counter() - started < _MIN_SECONDS
    ):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def _row(backend: str, nbytes: int, blocks: int, segments: int, times: list[float]) -> dict:
    p50 = statistics.median(times)
    return {
        "backend": backend,
        "bytes": nbytes,
        "blocks": blocks,
        "segments": segments,
        "reps": len(times),
        "p50_ms": p50 * 1e3,
        "gbps_p50": nbytes / p50 / 1e9,
        "gbps_best": nbytes / min(times) / 1e9,
    }


def _bench_raw(sizes: list[int]) -> list[dict]:
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_peer, args=(child, max(sizes)), daemon=True)
    proc.start()
    try:
        port = pipe.recv()
        buf = np.zeros(max(sizes), dtype=np.uint8).data
        rows = []
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for size in sizes:

                def once(size: int = size) -> None:
                    sock.sendall(size.to_bytes(8, "big"))
                    pos = 0
                    while pos < size:
                        pos += sock.recv_into(buf[pos:size])

                rows.append(_row("raw-socket", size, 0, 1, _reps(once)))
        return rows
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _bench_backend(layout: KVLayout, blocks: list[int], backend: str) -> list[dict]:
    num_blocks = max(blocks)
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_peer, args=(child, backend, layout, num_blocks), daemon=True)
    proc.start()
    try:
        endpoint, served = pipe.recv()
        return asyncio.run(_pull_all(layout, blocks, backend, endpoint, served))
    finally:
        pipe.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


async def _pull_all(
    layout: KVLayout, blocks: list[int], backend: str, endpoint: str, served: str
) -> list[dict]:
    cfg = TransferConfig.model_validate({"backend": backend, "ucx_devices": "lo"})
    pool = _pool(layout, max(blocks), 0.0)
    t = create_transceiver(
        cfg, pool=pool, layout=layout, worker_id="bench-decode", epoch=_EPOCH, parked=None
    )
    await t.start()
    rows = []
    try:
        for n in blocks:
            ids = list(range(n))
            times: list[float] = []
            for rep in range(_MAX_REPS + 1):
                handle = TransferHandle(
                    worker_id="bench-prefill",
                    epoch=_EPOCH,
                    request_id=f"bench-{n}-{uuid.uuid4().hex[:8]}",
                    block_ids=tuple(ids),
                    num_tokens=n * layout.tokens_per_block,
                    lease_deadline=time.time() + 60,
                    layout=layout,
                    backend=served,
                    transfer_endpoint=endpoint,
                )
                t0 = time.perf_counter()
                await t.pull(handle, ids)
                if rep:  # rep 0 warms up
                    times.append(time.perf_counter() - t0)
                if len(times) >= _MIN_REPS and sum(times) > _MIN_SECONDS:
                    break
            assert bool(pool[-1, n - 1].eq(1.0).all()), "transferred bytes do not match"
            rows.append(_row(t.backend, n * block_bytes(layout), n, layout.num_layers, times))
    finally:
        await t.close()
    return rows


def run_transfer_benchmark(
    layout: KVLayout, sizes_bytes: list[int], backends: list[str]
) -> list[dict]:
    """Measure KV pull throughput per backend and a raw-socket reference, two processes each.

    Returns one dict per (backend, size): ``backend`` ("tcp", "nixl", "raw-socket"), ``bytes``
    moved per request, ``blocks``, ``segments`` per request, ``reps``, ``p50_ms``,
    ``gbps_p50``, ``gbps_best``. Call it outside a running event loop.
    """
    blocks = [_blocks_for(layout, size) for size in sizes_bytes]
    rows = _bench_raw([n * block_bytes(layout) for n in blocks])
    for backend in backends:
        rows += _bench_backend(layout, blocks, backend)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table, with each row's ratio to raw sockets at its size."""
    raw = {r["bytes"]: r["gbps_p50"] for r in rows if r["backend"] == "raw-socket"}
    lines = [
        f"{'backend':<11}{'MiB':>9}{'blocks':>8}{'segs':>6}{'reps':>6}"
        f"{'p50 ms':>10}{'GB/s p50':>10}{'GB/s best':>11}{'vs raw':>8}"
    ]
    for r in rows:
        ratio = r["gbps_p50"] / raw[r["bytes"]] if r["bytes"] in raw else float("nan")
        lines.append(
            f"{r['backend']:<11}{r['bytes'] / 2**20:>9.1f}{r['blocks']:>8}{r['segments']:>6}"
            f"{r['reps']:>6}{r['p50_ms']:>10.2f}{r['gbps_p50']:>10.2f}{r['gbps_best']:>11.2f}"
            f"{ratio:>8.2f}"
        )
    return "\n".join(lines)


def print_results(rows: list[dict]) -> None:
    """Print :func:`run_transfer_benchmark`'s rows as :func:`format_table` lays them out."""
    print(format_table(rows))


def main(argv: list[str] | None = None) -> None:
    """``python -m pdserve.transfer.bench [--sizes-mib 1 16 64 256] [--backends tcp nixl]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=None)
    parser.add_argument("--backends", nargs="+", default=["tcp", "nixl"])
    args = parser.parse_args(argv)
    sizes = [int(s * 2**20) for s in args.sizes_mib] if args.sizes_mib else DEFAULT_SIZES
    layout = SMOLLM2_LAYOUT
    print(
        f"KV transfer, 2 processes, {layout.model} layout ({layout.num_layers} layers, "
        f"{layout.num_kv_heads} kv heads, head dim {layout.head_dim}, "
        f"{layout.tokens_per_block} tokens/block, {layout.dtype}: "
        f"{block_bytes(layout)} bytes/block)"
    )
    print_results(run_transfer_benchmark(layout, sizes, args.backends))


if __name__ == "__main__":
    main()
