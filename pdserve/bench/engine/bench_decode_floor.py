"""``pdserve bench decode-floor``: the decode step against its memory-bandwidth floor.

A decode step reads every weight it multiplies once (each linear layer's and the LM head's; the
input embedding only by row), so at small batches its time is bounded below by those bytes over
the cores' read bandwidth. For each ``--dtypes`` x ``--batches`` pair, one in-process engine
(the default model unless ``--model``; compiled forward unless ``--no-compile``; ``--threads``
torch threads, a worker's share in ``pdserve up`` by default) decodes ``batch`` sequences
together; the step time is the difference between a long and a short run divided by the tokens
between them, so prefill and start-up cancel. The floor is the weights' bytes over the read
bandwidth measured here with the same threads (the best of several sums over a 1 GiB buffer,
larger than any cache; ``--buffer-mib``). ``--profile`` adds, per dtype, torch.profiler's top operators over a
few steps of the largest batch: what the step spends beyond the GEMMs.

Diagnostic code: it builds engines directly, never a server. Prints one row per pair: step ms,
floor ms, step / floor, and tokens per second.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.engine.bench_kv_dtype import run_together

if TYPE_CHECKING:
    from pdserve.workers.engine.engine import Engine, EngineRequest

HELP = "the decode step's time against its floor: weights' bytes / measured read bandwidth"
DESCRIPTION = __doc__.split("\n\n", 1)[1].rsplit("\n\nDiagnostic", 1)[0] if __doc__ else HELP

BUFFER_MIB = 1024
"""The bandwidth probe's buffer by default: 1 GiB, far past the last-level cache of the CPUs
seen."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench decode-floor``."""
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], help="model dtypes to measure"
    )
    p.add_argument(
        "--batches", nargs="+", type=int, default=[1, 8, 32], help="sequences decoding together"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: a worker's share)"
    )
    p.add_argument("--tokens", type=int, default=96, help="decode steps between the two runs")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager forward")
    p.add_argument(
        "--sampling",
        choices=["greedy", "model"],
        default="greedy",
        help="greedy steps, or the model's generation_config.json sampling (a chat client's "
        "default: the step then includes the sampler's cost)",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "w8a8"],
        default="none",
        help="weights: the dtype's, or W8A8 int8 (the floor then counts their bytes as one each)",
    )
    p.add_argument(
        "--profile", action="store_true", help="top operators of the largest batch's steps"
    )
    p.add_argument(
        "--buffer-mib", type=int, default=BUFFER_MIB, help="the bandwidth probe's buffer, MiB"
    )


def read_bandwidth(threads: int, mib: int = BUFFER_MIB, reps: int = 5) -> float:
    """Bytes per second the CPU reads with ``threads`` torch threads: the best of ``reps`` sums
    over ``mib`` MiB of float32 (it must exceed the last-level cache to measure memory)."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - started)
    return buf.nbytes / best


def weight_bytes_per_step(model: Any, element_size: int) -> int:
    """The bytes of weights a decode step reads: every linear layer's (``in_features x
    out_features`` elements of ``element_size`` bytes, prepacked or not), the LM head's
    included; the input embedding is read by row and the norms' vectors are negligible."""
    return sum(
        m.in_features * m.out_features * (1 if _int8(m) else element_size)
        for m in model.modules()
        if isinstance(getattr(m, "in_features", None), int)
        and isinstance(getattr(m, "out_features", None), int)
    )


def _int8(module: Any) -> bool:
    """Whether ``module`` holds W8A8 int8 weights (one byte an element)."""
    return getattr(module, "weight_scale", None) is not None


def run(args: argparse.Namespace, cfg: object = None) -> int:
    """Measure and print one row per dtype and batch; returns 0."""
    from pdserve.hardware import cpu_model
    from pdserve.models import resolve_model

    path = resolve_model(args.model, cache_dir=None)
    bandwidth = read_bandwidth(args.threads, args.buffer_mib)
    fields = sampling_fields(args.sampling, path)
    print(
        f"{cpu_model()}, {args.threads} thread(s): read bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"model {Path(path).name}, {'compiled' if args.compile else 'eager'} forward, "
        f"weights {args.quantization}, sampling {fields}",
        flush=True,
    )
    print(f"{'dtype':<10}{'batch':>6}{'step ms':>9}{'floor ms':>10}{'x floor':>9}{'tok/s':>9}")
    for dtype in args.dtypes:
        engine = _engine(path, dtype, args)
        try:
            size = engine.runner.dtype.itemsize
            floor_s = weight_bytes_per_step(engine.runner.model, size) / bandwidth
            for batch in args.batches:
                step_s = _step_seconds(engine, batch, args.tokens, fields)
                print(
                    f"{dtype:<10}{batch:>6}{step_s * 1e3:>9.2f}{floor_s * 1e3:>10.3f}"
                    f"{step_s / floor_s:>9.2f}{batch / step_s:>9.1f}",
                    flush=True,
                )
            if args.profile:
                _profile(engine, max(args.batches), dtype, fields)
        finally:
            engine.shutdown()
    return 0


def _engine(path: Path, dtype: str, args: argparse.Namespace) -> Engine:
    from pdserve.config.loading import EngineConfig
    from pdserve.config.settings import KVCacheSettings, ModelSettings, SchedulerSettings
    from pdserve.workers.engine.engine import Engine

    most = max(args.batches)
    cfg = EngineConfig(
        model_path=path,
        model=ModelSettings(compile=args.compile, dtype=dtype, quantization=args.quantization),
        kv_cache=KVCacheSettings(budget_mb=max(256, most * 16)),
        scheduler=SchedulerSettings(threads=args.threads, max_num_seqs=most),
    )
    engine = Engine(cfg)
    engine.start()
    return engine


def _requests(
    engine: Engine, batch: int, tokens: int, tag: str, fields: dict[str, Any]
) -> list[EngineRequest]:
    from pdserve.protocol import SamplingParams
    from pdserve.workers.engine.engine import EngineRequest

    prompt = list(engine.tokenizer("The decode phase reads the whole cache.")["input_ids"])
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, **fields)
    return [EngineRequest(f"{tag}-{i}", prompt, sampling) for i in range(batch)]


def sampling_fields(mode: str, model_path: Path) -> dict[str, Any]:
    """The steps' sampling: ``greedy``, or ``model``: the model folder's
    ``generation_config.json`` defaults, as the router applies them to a request that leaves
    them out (what a chat client sends by default)."""
    if mode == "greedy":
        return {"temperature": 0.0}
    from pdserve.server.chat.sampling_defaults import SamplingDefaults

    d = SamplingDefaults.from_model(model_path)
    return {
        "temperature": d.temperature,
        "top_p": d.top_p,
        "top_k": d.top_k,
        "min_p": d.min_p,
        "repetition_penalty": d.repetition_penalty,
    }


def _step_seconds(engine: Engine, batch: int, tokens: int, fields: dict[str, Any]) -> float:
    """Seconds per decode step of ``batch`` sequences: (long run - short run) / extra steps."""
    short = 8
    run_together(engine, _requests(engine, batch, short, "warm", fields))
    started = time.perf_counter()
    run_together(engine, _requests(engine, batch, short, f"s{batch}", fields))
    short_s = time.perf_counter() - started
    started = time.perf_counter()
    run_together(engine, _requests(engine, batch, short + tokens, f"l{batch}", fields))
    return (time.perf_counter() - started - short_s) / tokens


def _profile(engine: Engine, batch: int, dtype: str, fields: dict[str, Any], top: int = 12) -> None:
    """Print torch.profiler's ``top`` operators by self CPU time over ``batch`` sequences'
    decode steps (the engine thread's, recorded process-wide)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    every_thread = _ExperimentalConfig(profile_all_threads=True)  # the steps run on the engine's
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        run_together(engine, _requests(engine, batch, 24, f"p{batch}", fields))
    print(f"-- {dtype}, batch {batch}: top operators by self CPU time (24 steps + prefill)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)
