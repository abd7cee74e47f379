"""``pdserve bench gpu``: engine step time (TPOT) and KV transfer GB/s on a GPU (the CPU side of
the comparison runs the same code with ``--device cpu``)::

    pdserve bench gpu engine --device cuda --model smollm2-like --dtype float32 bfloat16 \
        --cuda-graphs on off
    pdserve bench gpu transfer --backends tcp nixl --devices cuda:cuda cpu:cpu

``engine``: one Engine in this process; per concurrency level ``c``, ``c`` requests of
``--prompt-tokens`` random token ids are submitted together and generate ``--max-tokens`` tokens
each (``ignore_eos``), twice; the second pass is reported. TTFT = submit -> first token, TPOT = (last
token - first token) / (tokens - 1) per request, as ``pdserve bench serve`` defines them; with
every request decoding in lockstep, TPOT is the decode step time at batch ``c``. Prefill
tokens/s: the level's ``c x --prompt-tokens`` prompt tokens over the time to its last first
token. ``--cuda-graphs on
off`` runs each dtype twice, with and without CUDA graphs of decode steps (``EngineConfig.
cuda_graphs``; no effect on CPU); graphs are captured in the first pass of a level.

The models are built on the spot with random weights (:mod:`pdserve.bench.engine.bench_models`: the
tiny one, or one with SmolLM2-135M's architecture), so nothing is downloaded.

``transfer``: a spawned prefill peer (:class:`pdserve.bench.transfer.bench_transfer_peers.PatternPeer`)
and a decode transceiver in this process, pools on the given devices, SmolLM2's KV layout (30
layers, 3 KV heads, head dim 64, 16 tokens per block, float32: 720 KiB per block). Each size is pulled once
to warm up, then at least 5 times and for at least 0.5 s; GB/s at the median. The bytes are
checked after the timed pulls. Integrity on between two CUDA pools digests with mix64 on the
GPU (:mod:`pdserve.transfer.integrity.mix64`), elsewhere with xxh3 on the CPU.

Prints one ``PDSERVE-GPU <json>`` line per result and a markdown table at the end. Importing
this module is light (torch loads when a benchmark runs); the options live in
:mod:`pdserve.bench.bench_commands`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdserve.config.loading import EngineConfig

RESULT_PREFIX = "PDSERVE-GPU "
SMOL_LAYOUT = {
    "model": "smollm2-like",
    "num_layers": 30,
    "num_kv_heads": 3,
    "head_dim": 64,
    "tokens_per_block": 16,
    "dtype": "float32",
}


def _emit(result: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({torch.get_num_threads()} torch threads)"


# --- engine ------------------------------------------------------------------------------------


def _model_dir(name: str, root: Path) -> Path:
    from pdserve.bench.engine.bench_models import build_random_llama, build_smollm2_like

    if name == "tiny":
        return build_random_llama(root / "tiny", seed=0)
    return build_smollm2_like(root / "smollm2-like", seed=0)


def engine_config(
    model_dir: Path,
    *,
    device: str,
    dtype: str,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    cuda_graphs: bool,
    tokens_per_block: int = 16,
    compile: bool | None = None,
) -> EngineConfig:
    """The engine of one benchmark run: the model's ``device`` and ``dtype``, a pool of exactly
    ``num_blocks`` blocks, the scheduler's bounds, CUDA graphs of decode steps on or off,
    ``model.compile`` when given; every other setting its default."""
    from pdserve.config.loading import EngineConfig
    from pdserve.config.settings import KVCacheSettings, ModelSettings, SchedulerSettings

    model: dict[str, Any] = {"device": device, "dtype": dtype}
    if compile is not None:
        model["compile"] = compile
    return EngineConfig(
        model_path=model_dir,
        model=ModelSettings.model_validate(model),
        kv_cache=KVCacheSettings(tokens_per_block=tokens_per_block, num_blocks=num_blocks),
        scheduler=SchedulerSettings(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            cuda_graphs=cuda_graphs,
        ),
    )


def _run_level(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, float]]:
    """Submit ``prompts`` together; (TTFT, TPOT) seconds per request."""
    from pdserve.protocol import SamplingParams
    from pdserve.workers.engine.engine import EngineRequest

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    stamps: dict[str, list[float]] = {f"b{i}": [] for i in range(len(prompts))}
    left, done, lock = [len(prompts)], threading.Event(), threading.Lock()

    def sink(out: Any) -> None:
        now = time.perf_counter()
        with lock:
            stamps[out.request_id].extend([now] * len(out.token_ids))
            if out.finish_reason is not None:
                left[0] -= 1
                if not left[0]:
                    done.set()

    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"b{i}", prompt, sampling), sink)
    if not done.wait(600):
        raise RuntimeError("benchmark requests did not finish in 600 s")
    return [(s[0] - t0, (s[-1] - s[0]) / (len(s) - 1)) for s in stamps.values()]


def bench_engine(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every ``--dtype`` x ``--cuda-graphs`` engine on the stand-in ``--model``."""
    import torch

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(args.model, Path(tmp))
        gen = torch.Generator().manual_seed(0)
        for dtype in args.dtype:
            for graphs in args.cuda_graphs:
                results += _bench_engine_config(args, model_dir, gen, dtype, graphs == "on")
    return results


def _bench_engine_config(
    args: argparse.Namespace, model_dir: Path, gen: torch.Generator, dtype: str, graphs: bool
) -> list[dict[str, Any]]:
    """One engine (``dtype``, CUDA graphs on or off), every concurrency level."""
    import torch

    from pdserve.workers.engine.engine import Engine

    results = []
    top = max(args.concurrency)
    tokens = top * (args.prompt_tokens + args.max_tokens)
    engine = Engine(
        engine_config(
            model_dir,
            device=args.device,
            dtype=dtype,
            tokens_per_block=16,
            num_blocks=tokens // 16 + 2 * top + 8,
            max_num_seqs=top,
            max_num_batched_tokens=max(2048, top * args.prompt_tokens),
            cuda_graphs=graphs,
        )
    )
    engine.start()
    try:
        vocab = min(engine.runner.vocab_size, 256)
        warm = torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist()
        _run_level(engine, [warm], 8)
        for c in args.concurrency:
            prompts = [
                torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist()
                for _ in range(c)
            ]
            # twice: the first pass meets new shapes (kernel choice, lazy loading and graph
            # capture on CUDA), the second is reported
            _run_level(engine, prompts, args.max_tokens)
            samples = _run_level(engine, prompts, args.max_tokens)
            ttft = [s[0] for s in samples]
            tpot = [s[1] for s in samples]
            runner_graphs = engine.runner.graphs
            result = {
                "kind": "engine",
                "model": args.model,
                "device": _device_name(args.device),
                "dtype": dtype,
                "cuda_graphs": runner_graphs is not None,
                "cuda_graphs_requested": graphs,
                "graphs_captured": runner_graphs.captures if runner_graphs else 0,
                "concurrency": c,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "ttft_ms_p50": 1e3 * statistics.median(ttft),
                "tpot_ms_p50": 1e3 * statistics.median(tpot),
                "tpot_ms_mean": 1e3 * statistics.mean(tpot),
                "decode_tokens_per_s": c / statistics.median(tpot),
                # the level's prompts (prefilled together) over the time to the last first token
                "prefill_tokens_per_s": c * args.prompt_tokens / max(ttft),
            }
            _emit(result)
            results.append(result)
    finally:
        engine.shutdown()
    return results


# --- transfer ----------------------------------------------------------------------------------


async def _time_pulls(t: Any, handle: Any, ids: list[int], min_s: float) -> list[float]:
    await t.pull(handle, ids)  # warm-up (connection, handshake, registrations)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 5 or (len(times) < 200 and time.perf_counter() - started < min_s):
        t0 = time.perf_counter()
        await t.pull(handle, ids)
        times.append(time.perf_counter() - t0)
    return times


async def pull_sizes(
    backend: str, dst_device: str, peer: Any, sizes: list[int], integrity: bool
) -> dict[int, list[float]]:
    """Pull each of ``sizes`` blocks (SmolLM2's layout) from ``peer`` into a ``dst_device``
    pool over ``backend``, integrity on or off: seconds per timed pull, by size. Raises
    RuntimeError when the pulled bytes are wrong."""
    import torch

    from pdserve.bench.transfer.bench_transfer_peers import empty_pool, pattern, transfer_settings
    from pdserve.protocol import KVLayout
    from pdserve.transfer import create_transceiver

    layout = KVLayout(**SMOL_LAYOUT)
    pool = empty_pool(layout, max(sizes), dst_device)
    t = create_transceiver(
        transfer_settings(backend, ucx_devices="lo", integrity=integrity),
        pool=pool,
        layout=layout,
        worker_id="gpu-bench-decode",
        epoch=1,
        parked=None,
        key=peer.key,
    )
    await t.start()
    try:
        out = {}
        for n in sizes:
            ids = list(range(n))
            handle = peer.park(f"bench-{n}", ids)
            out[n] = await _time_pulls(t, handle, ids, 0.5)
            want = pattern(layout, max(sizes), dst_device)[:, :n]
            if not torch.equal(pool[:, :n], want):
                raise RuntimeError(f"{backend} {n}-block pulls delivered wrong bytes")
            pool.zero_()
    finally:
        await t.close()
    return out


def bench_transfer(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every ``--backends`` x ``--devices`` pair, integrity off then on, each ``--blocks``."""
    from pdserve.bench.transfer.bench_transfer_peers import PatternPeer
    from pdserve.protocol import KVLayout
    from pdserve.transfer.integrity import mix64

    layout = KVLayout(**SMOL_LAYOUT)
    block = layout.block_bytes_per_layer * layout.num_layers
    results = []
    for backend in args.backends:
        for pair in args.devices:
            src, dst = pair.split(":")
            peer = PatternPeer(backend, layout, max(args.blocks), src)
            try:
                for integrity in (False, True):
                    times = asyncio.run(pull_sizes(backend, dst, peer, args.blocks, integrity))
                    for n, ts in times.items():
                        p50 = statistics.median(ts)
                        result = {
                            "kind": "transfer",
                            "backend": peer.backend,
                            "src": src,
                            "dst": dst,
                            "device": _device_name("cuda" if "cuda" in pair else "cpu"),
                            "integrity": integrity,
                            "blocks": n,
                            "mib": n * block / 2**20,
                            "ms_p50": 1e3 * p50,
                            "gbps_p50": n * block / p50 / 1e9,
                            "reps": len(ts),
                            # this (decode) side's compiled mix64 kernels (CUDA pools)
                            "digest_compiled": mix64.compiled_devices(),
                        }
                        _emit(result)
                        results.append(result)
            finally:
                peer.stop()
    return results


# --- report ------------------------------------------------------------------------------------


def _table(results: list[dict[str, Any]]) -> str:
    engine = [r for r in results if r["kind"] == "engine"]
    transfer = [r for r in results if r["kind"] == "transfer"]
    lines = []
    if engine:
        lines += [
            "| model | device | dtype | CUDA graphs | concurrency | TTFT p50 (ms) | TPOT p50 (ms)"
            " | tokens/s | prefill tokens/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in engine:
            lines.append(
                f"| {r['model']} | {r['device']} | {r['dtype']} | "
                f"{'on' if r['cuda_graphs'] else 'off'} | {r['concurrency']} | "
                f"{r['ttft_ms_p50']:.1f} | {r['tpot_ms_p50']:.2f} | {r['decode_tokens_per_s']:.0f} | "
                f"{r['prefill_tokens_per_s']:.0f} |"
            )
    if transfer:
        lines += [
            "",
            "| backend | pools | integrity | blocks | MiB | ms p50 | GB/s p50 |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in transfer:
            lines.append(
                f"| {r['backend']} | {r['src']} -> {r['dst']} | {'on' if r['integrity'] else 'off'}"
                f" | {r['blocks']} | {r['mib']:.2f} | {r['ms_p50']:.2f} | {r['gbps_p50']:.2f} |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``pdserve bench gpu engine|transfer`` (options: :mod:`pdserve.bench.bench_commands`):
    print each result as it comes and the table at the end; 0."""
    if args.what == "engine":
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        results = bench_engine(args)
    else:
        results = bench_transfer(args)
    print(_table(results))
    return 0
