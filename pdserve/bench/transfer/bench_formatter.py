"""What layout conversion costs: the staging kernel alone, and a whole pull between processes.

``pdserve bench formatter [--tokens 512 2048] [--backends tcp nixl] [--threads 1]`` (options:
:mod:`pdserve.bench.bench_commands`)

Two measurements on SmolLM2's KV layout (30 layers, 3 KV heads, head dim 64), one request of
``tokens`` tokens each, medians of repeated runs (1 GB = 1e9 bytes):

1. **stage**: :meth:`ConvertingFormatter.stage` in this process (the gather + convert into the
   staging buffer that the prefill side does before sending), beside a plain ``copy_`` of the
   same output bytes (the memory-bandwidth floor of any staging).
2. **pull**: a decode transceiver here pulls from a prefill transceiver in a spawned process,
   as a decode worker does (handshake once, then SendBlocks -> bytes -> Release per request),
   for matched layouts (the zero-copy path) and each mixed pair, per backend. The difference to
   the matched row of the same prefill dtype is what the formatter adds end to end. Integrity
   digests are off here, so the figures isolate the conversion (``pdserve bench transfer``
   measures the backends themselves). The prefill side serves every request as parked
   (:class:`pdserve.bench.transfer.bench_transfer_peers.AllParked`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection as Pipe
from typing import Any

import torch

from pdserve.bench.transfer.bench_transfer_peers import BENCH_EPOCH, AllParked, transfer_settings
from pdserve.config.settings import TransferSettings
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.security import ClusterKey, generate_secret
from pdserve.transfer.formatter.mapping import Formatter, PoolGeometry
from pdserve.transfer.transceiver import create_transceiver

BASE = KVLayout(
    model="SmolLM2-135M-Instruct",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    tokens_per_block=16,
    dtype="float32",
)
F32_16 = BASE
F32_32 = BASE.model_copy(update={"tokens_per_block": 32})
BF16_16 = BASE.model_copy(update={"dtype": "bfloat16"})
PREFILL = {"f32/16": F32_16, "bf16/16": BF16_16}
DECODE = {"f32/16": F32_16, "f32/32": F32_32, "bf16/16": BF16_16}
PAIRS = [  # (prefill, decode): matched rows first, each the baseline of its prefill dtype
    ("f32/16", "f32/16"),
    ("f32/16", "f32/32"),
    ("f32/16", "bf16/16"),
    ("bf16/16", "bf16/16"),
    ("bf16/16", "f32/16"),
]
_MIN_REPS, _MAX_REPS, _MIN_SECONDS = 5, 50, 0.5


def _pool(layout: KVLayout, tokens: int) -> torch.Tensor:
    blocks = -(-tokens // layout.tokens_per_block)
    shape = (layout.num_layers, blocks, 2, layout.tokens_per_block, layout.num_kv_heads)
    return torch.randn((*shape, layout.head_dim)).to(getattr(torch, layout.dtype))


def _median(run: Callable[[], object]) -> tuple[float, int]:
    """Median seconds of ``run`` (after one warm-up) and the repetitions taken."""
    run()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < _MIN_REPS or (
        len(times) < _MAX_REPS and time.perf_counter() - started < _MIN_SECONDS
    ):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def bench_stage(tokens: int) -> list[dict[str, Any]]:
    """Staging kernel per mixed pair: ms, GB/s of output written, and a ``copy_`` reference."""
    rows = []
    for src_name, dst_name in PAIRS:
        src, dst = PREFILL[src_name], DECODE[dst_name]
        if src == dst:
            continue
        pool = _pool(src, tokens)
        n_src, n_dst = pool.shape[1], -(-tokens // dst.tokens_per_block)
        dst_geometry = PoolGeometry(dst.num_layers, n_dst, dst.block_bytes_per_layer)
        f = Formatter.negotiate(src, dst, PoolGeometry.from_pool(pool, src), dst_geometry)
        buf = torch.empty(f.staging_nbytes(n_dst), dtype=torch.uint8)
        ids = list(range(n_src))
        seconds, reps = _median(functools.partial(f.stage, pool, ids, n_dst, buf))
        out = n_dst * dst.num_layers * dst.block_bytes_per_layer
        a, b = torch.empty(out, dtype=torch.uint8), torch.ones(out, dtype=torch.uint8)
        copy_s, _ = _median(functools.partial(a.copy_, b))
        rows.append(
            {
                "pair": f"{src_name} -> {dst_name}",
                "tokens": tokens,
                "out_mib": out / 2**20,
                "reps": reps,
                "ms": seconds * 1e3,
                "gbps": out / seconds / 1e9,
                "copy_ms": copy_s * 1e3,
            }
        )
    return rows


def _cfg(backend: str) -> TransferSettings:
    return transfer_settings(backend, ucx_devices="lo", integrity=False)


def _prefill_peer(pipe: Pipe, backend: str, tokens: int, threads: int, secret: str) -> None:
    torch.set_num_threads(threads)  # a worker's --threads: the staging kernel runs on them

    async def serve() -> None:
        endpoints = {}
        transceivers = []
        for name, layout in PREFILL.items():
            t = create_transceiver(
                _cfg(backend),
                pool=_pool(layout, tokens),
                layout=layout,
                worker_id=f"fmt-prefill-{name}",
                epoch=BENCH_EPOCH,
                parked=AllParked(),
                key=ClusterKey(secret.encode()),
            )
            await t.start()
            transceivers.append(t)
            endpoints[name] = (t.endpoint, t.backend)
        pipe.send(endpoints)
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)  # until told to stop
        for t in transceivers:
            await t.close()

    asyncio.run(serve())


async def _pull_pairs(
    backend: str, tokens: int, endpoints: dict[str, tuple[str, str]], key: ClusterKey
) -> list[dict[str, Any]]:
    rows = []
    for src_name, dst_name in PAIRS:
        src, dst = PREFILL[src_name], DECODE[dst_name]
        pool = _pool(dst, tokens).zero_()
        t = create_transceiver(
            _cfg(backend),
            pool=pool,
            layout=dst,
            worker_id="fmt-decode",
            epoch=BENCH_EPOCH,
            parked=None,
            key=key,
        )
        await t.start()
        endpoint, served = endpoints[src_name]
        n_src = -(-tokens // src.tokens_per_block)
        dst_ids = list(range(pool.shape[1]))
        times: list[float] = []
        try:
            for rep in range(_MAX_REPS + 1):
                handle = TransferHandle(
                    worker_id=f"fmt-prefill-{src_name}",
                    epoch=BENCH_EPOCH,
                    request_id=f"bench-{n_src}-{rep}",
                    lease_id="bench",
                    block_ids=tuple(range(n_src)),
                    num_tokens=tokens,
                    lease_deadline=time.time() + 60,
                    layout=src,
                    backend=served,
                    transfer_endpoint=endpoint,
                )
                t0 = time.perf_counter()
                await t.pull(handle, dst_ids)
                if rep:  # rep 0 warms up (handshake, staging buffer, first touch)
                    times.append(time.perf_counter() - t0)
                if len(times) >= _MIN_REPS and sum(times) > _MIN_SECONDS:
                    break
        finally:
            await t.close()
        rows.append(
            {
                "backend": served,
                "pair": f"{src_name} -> {dst_name}",
                "tokens": tokens,
                "src_mib": tokens * src.bytes_per_token / 2**20,
                "dst_mib": tokens * dst.bytes_per_token / 2**20,
                "reps": len(times),
                "ms": statistics.median(times) * 1e3,
            }
        )
    return rows


def bench_pull(backend: str, tokens: int, threads: int = 1) -> list[dict[str, Any]]:
    """Median pull time per layout pair over ``backend`` between two processes (the prefill
    process runs torch on ``threads`` threads)."""
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    secret = generate_secret()  # pickled to the child through its pipe, never on a command line
    proc = ctx.Process(
        target=_prefill_peer, args=(child, backend, tokens, threads, secret), daemon=True
    )
    proc.start()
    try:
        return asyncio.run(_pull_pairs(backend, tokens, pipe.recv(), ClusterKey(secret.encode())))
    finally:
        pipe.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def run(args: argparse.Namespace) -> int:
    """``pdserve bench formatter``: the staging table, then the pull table; 0."""
    torch.set_num_threads(args.threads)
    print(f"torch threads: {args.threads}")
    print(f"{'stage':<20}{'tokens':>7}{'out MiB':>9}{'reps':>6}{'ms':>9}{'GB/s':>7}{'copy ms':>9}")
    for tokens in args.tokens:
        for r in bench_stage(tokens):
            print(
                f"{r['pair']:<20}{r['tokens']:>7}{r['out_mib']:>9.1f}{r['reps']:>6}"
                f"{r['ms']:>9.2f}{r['gbps']:>7.2f}{r['copy_ms']:>9.2f}"
            )
    print(f"\n{'pull':<8}{'pair':<20}{'tokens':>7}{'P MiB':>7}{'D MiB':>7}{'reps':>6}{'ms':>9}")
    for backend in args.backends:
        for tokens in args.tokens:
            for r in bench_pull(backend, tokens, args.threads):
                print(
                    f"{r['backend']:<8}{r['pair']:<20}{r['tokens']:>7}{r['src_mib']:>7.1f}"
                    f"{r['dst_mib']:>7.1f}{r['reps']:>6}{r['ms']:>9.2f}"
                )
    return 0
