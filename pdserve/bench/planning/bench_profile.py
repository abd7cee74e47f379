"""``pdserve bench profile``: measure the model on this machine and write the profile the planner
reads (:class:`pdserve.planner.profile.Profile`; ``pdserve plan --profile FILE``).

For each ``--threads`` count, in a fresh spawned process (one OpenMP team per process, as a
worker has; :mod:`pdserve.workers.engine.omp`), one :class:`Engine` with the resolved settings
(``--config``, ``PDSERVE_*``: model, dtype, compile, KV dtype) and a step budget large enough that
every measured prompt is one step:

- **prefill**: a fresh random prompt of each ``--prefill-tokens`` length, ``max_tokens`` 1;
  time from submit to the first token (the median of ``--reps``), i.e. one prefill step;
- **decode**: for each batch of ``--batches`` and context of ``--contexts``, that many requests
  sharing one prompt of that length (its blocks cached by a first request, so that setting the
  batch up costs one prefill), 16 tokens each in lockstep; the step time is the median gap
  between tokens, at context = prompt + 8;
- **mixed**: ``b`` requests decoding (context 128) when a fresh prompt of ``p`` tokens arrives;
  the step that prefills it is timed from the decode rows' token before it to its first token
  (:func:`_step_ending_at`).

Then the hand-off: KV pulls of 1, 4, 16 and 64 blocks of SmolLM2's layout (720 KiB each)
between this process and a spawned prefill peer over the configured ``transfer.backend``,
integrity as configured (:func:`pdserve.bench.gpu.bench_gpu.pull_sizes`); the median per size.

``router_s`` and ``leg_s`` keep their defaults (one real trace of SmolLM2 on this 2-core AMD
EPYC: tokenize + route 1.4 ms; the prefill leg's HTTP round trip beyond the worker's compute
4 ms; docs/planning.md).

Benchmark code only: the serving path never imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig

DESCRIPTION = """\
The profile `pdserve plan` reads (docs/planning.md): in a fresh process per --threads count,
one engine of the configured model times prefill steps against prompt length, decode steps
against batch size and context, and mixed steps; then KV pulls of 1 to 64 blocks over the
configured transfer backend. Writes --out (JSON) and prints every point as it is measured.
"""
"""The ``pdserve bench profile --help`` text."""
HELP = "prefill, decode-step and hand-off times of this model here: the planner's profile"
"""The one line ``pdserve bench --help`` lists."""

DECODE_TOKENS = 16
"""Tokens each decode-profile request generates (the step time is the median gap)."""
HANDOFF_BLOCKS = (1, 4, 16, 64)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench profile``."""
    p.add_argument(
        "--out",
        default="pdserve-profile.json",
        metavar="FILE",
        help="the profile file to write (default: pdserve-profile.json)",
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="torch threads per engine, one engine each (default: 1 and every core "
        "of this machine: a worker's share in `pdserve up` with 2 workers and with 1)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="+",
        default=[16, 64, 128, 256, 512, 1024, 2048],
        help="prompt lengths of the prefill profile (default: 16 .. 2048)",
    )
    p.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16, 32],
        help="decode batch sizes (default: 1 4 8 16 32)",
    )
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[128, 1024],
        help="decode context lengths, tokens (default: 128 1024)",
    )
    p.add_argument(
        "--mixed",
        nargs="+",
        default=["64x1", "256x1", "64x8", "256x8"],
        metavar="PxB",
        help="mixed steps: a P-token prompt beside B decode rows (default: 64x1 256x1 64x8 256x8)",
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions per prefill point (default: 3)")
    p.add_argument(
        "--model",
        default=None,
        help="local model folder (default: the configured model, else SmolLM2)",
    )


# --- one engine, in a child process --------------------------------------------------------------


class _Sink:
    """Token arrival times per request id (the engine's step thread calls it)."""

    def __init__(self) -> None:
        self.stamps: dict[str, list[float]] = {}
        self.done: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def watch(self, rid: str) -> None:
        self.stamps[rid], self.done[rid] = [], threading.Event()

    def __call__(self, out: Any) -> None:
        now = time.perf_counter()
        with self.lock:
            self.stamps[out.request_id].extend([now] * len(out.token_ids))
        if out.finish_reason is not None:
            self.done[out.request_id].set()

    def wait(self, rids: Sequence[str]) -> None:
        for rid in rids:
            if not self.done[rid].wait(600):
                raise RuntimeError(f"profile request {rid} did not finish in 600 s")


def _submit(engine: Any, sink: _Sink, rid: str, prompt: list[int], max_tokens: int) -> None:
    from pdserve.protocol import SamplingParams
    from pdserve.workers.engine.engine import EngineRequest

    sink.watch(rid)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(EngineRequest(rid, prompt, sampling), sink)


def _step_ending_at(end: float, rows: Sequence[Sequence[float]]) -> float:
    """The length of the step that ended at ``end`` (a token time) seen from decode rows
    running through it: each row's token of that step is the one nearest ``end`` (one step's
    outputs are stamped together), the step began at the row's token before it. The median
    over the rows, seconds."""
    spans = []
    for stamps in rows:
        j = min(range(len(stamps)), key=lambda i: abs(stamps[i] - end))
        if j > 0:
            spans.append(end - stamps[j - 1])
    if not spans:
        raise RuntimeError("no decode row ran through the mixed step")
    return statistics.median(spans)


def measure_engine(
    cfg: PdserveConfig, model_path: Path, threads: int, args: dict[str, Any]
) -> dict[str, Any]:
    """One engine at ``threads`` threads: the ``prefill``, ``decode`` and ``mixed`` tables
    (seconds) and the layout's ``kv_bytes_per_token``. Runs in a spawned child."""
    from pdserve.config.loading import EngineConfig
    from pdserve.config.settings import KVCacheSettings
    from pdserve.workers.engine.engine import Engine

    top_b, top_c = max(args["batches"]), max(args["contexts"])
    longest = max(args["prefill_tokens"])
    chunk = max(longest, top_b, *(p + b for p, b in args["mixed"]))
    tokens = top_b * (top_c + DECODE_TOKENS + 32) + 2 * longest + 4096
    engine = Engine(
        EngineConfig(
            model_path=model_path,
            model=cfg.model,
            kv_cache=KVCacheSettings(
                tokens_per_block=cfg.kv_cache.tokens_per_block,
                num_blocks=tokens // cfg.kv_cache.tokens_per_block + 64,
                dtype=cfg.kv_cache.dtype,
            ),
            scheduler=cfg.scheduler.model_copy(
                update={
                    "threads": threads,
                    "max_num_batched_tokens": chunk,
                    "max_num_seqs": max(top_b + 1, cfg.scheduler.max_num_seqs),
                    "speculative_tokens": 0,
                }
            ),
        )
    )
    engine.start()
    sink, rng, n = _Sink(), random.Random(threads), [0]

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, 10100) for _ in range(length)]

    def rid() -> str:
        n[0] += 1
        return f"p{n[0]}"

    def one(p: list[int], max_tokens: int) -> list[float]:
        r = rid()
        t0 = time.perf_counter()
        _submit(engine, sink, r, p, max_tokens)
        sink.wait([r])
        return [t0, *sink.stamps[r]]

    try:
        one(prompt(32), 4)  # warm-up
        prefill = []
        for length in args["prefill_tokens"]:
            times = [(s := one(prompt(length), 1))[1] - s[0] for _ in range(args["reps"])]
            prefill.append((length, statistics.median(times)))
            print(
                f"  threads {threads}: prefill {length} tokens {1e3 * prefill[-1][1]:.1f} ms",
                flush=True,
            )
        decode = []
        for c in args["contexts"]:
            shared = prompt(c)
            one(shared, 1)  # its full blocks now in the prefix cache
            for b in args["batches"]:
                rids = [rid() for _ in range(b)]
                for r in rids:
                    _submit(engine, sink, r, shared, DECODE_TOKENS)
                sink.wait(rids)
                gaps = [
                    y - x
                    for r in rids
                    for x, y in zip(sink.stamps[r][1:], sink.stamps[r][2:], strict=False)
                ]
                decode.append((b, c + DECODE_TOKENS // 2, statistics.median(gaps)))
                print(
                    f"  threads {threads}: decode batch {b} context {c}: "
                    f"{1e3 * decode[-1][2]:.1f} ms/step",
                    flush=True,
                )
        mixed = []
        base = prompt(128)
        one(base, 1)
        for p_len, b in args["mixed"]:
            rids = [rid() for _ in range(b)]
            for r in rids:
                _submit(engine, sink, r, base, 64)
            while min(len(sink.stamps[r]) for r in rids) < 4:  # all decoding
                time.sleep(0.001)
            new = rid()
            _submit(engine, sink, new, prompt(p_len), 1)
            sink.wait([new, *rids])
            first = sink.stamps[new][0]
            mixed.append(
                (p_len, b, 128 + 32, _step_ending_at(first, [sink.stamps[r] for r in rids]))
            )
            print(
                f"  threads {threads}: mixed {p_len} prompt tokens + {b} decode rows: "
                f"{1e3 * mixed[-1][3]:.1f} ms",
                flush=True,
            )
        layout = engine.layout
        return {
            "threads": threads,
            "prefill": prefill,
            "decode": decode,
            "mixed": mixed,
            "kv_bytes_per_token": layout.bytes_per_token,
            "tokens_per_block": layout.tokens_per_block,
            "dtype": str(layout.dtype),
        }
    finally:
        engine.shutdown()


def measure_handoff(cfg: PdserveConfig) -> tuple[str, list[tuple[int, float]]]:
    """``(backend, [(bytes, seconds)])``: median KV pulls of :data:`HANDOFF_BLOCKS` blocks."""
    from pdserve.bench.gpu.bench_gpu import SMOL_LAYOUT, pull_sizes
    from pdserve.bench.transfer.bench_transfer_peers import PatternPeer
    from pdserve.protocol import KVLayout

    layout = KVLayout(**SMOL_LAYOUT)
    block = layout.block_bytes
    backend = cfg.transfer.backend
    peer = PatternPeer(backend, layout, max(HANDOFF_BLOCKS), "cpu")
    try:
        times = asyncio.run(
            pull_sizes(backend, "cpu", peer, list(HANDOFF_BLOCKS), cfg.transfer.integrity)
        )
    finally:
        peer.stop()
    return peer.backend, [(n * block, statistics.median(ts)) for n, ts in times.items()]


def run(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """Measure, write ``--out``, print the tables' sizes. 0, or 2 for bad options."""
    from pdserve.hardware import cpu_model
    from pdserve.models import resolve_model
    from pdserve.planner.profile import EngineProfile, Profile

    try:
        mixed = [tuple(int(x) for x in m.lower().split("x")) for m in args.mixed]
        if any(len(m) != 2 or min(m) < 1 for m in mixed):
            raise ValueError
    except ValueError:
        print(
            f"bench profile: --mixed takes PxB pairs, e.g. 64x8; got {args.mixed}", file=sys.stderr
        )
        return 2
    cores = os.cpu_count() or 1
    threads = sorted(set(args.threads or [1, cores]))
    if min(threads) < 1 or min(args.prefill_tokens + args.batches + args.contexts) < 1:
        print("bench profile: threads, lengths and batches must be at least 1", file=sys.stderr)
        return 2
    path = args.model or (str(cfg.model.path) if cfg.model.path is not None else None)
    model_path = resolve_model(path, cache_dir=cfg.model.cache_dir)
    grid = {
        "prefill_tokens": args.prefill_tokens,
        "batches": args.batches,
        "contexts": args.contexts,
        "mixed": mixed,
        "reps": args.reps,
    }
    print(
        f"bench profile: {model_path.name} on {cpu_model()} ({cores} cores), threads "
        f"{threads}; each engine in a fresh process",
        flush=True,
    )
    engines = []
    for t in threads:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            engines.append(pool.submit(measure_engine, cfg, model_path, t, grid).result())
    print("bench profile: hand-off (KV pulls of 1, 4, 16, 64 blocks)", flush=True)
    backend, handoff = measure_handoff(cfg)
    for size, s in handoff:
        print(f"  {size / 2**20:.2f} MiB: {1e3 * s:.2f} ms ({size / s / 1e9:.2f} GB/s)")
    first = engines[0]
    profile = Profile(
        model=model_path.name,
        engines=[
            EngineProfile(e["threads"], e["prefill"], e["decode"], e["mixed"]) for e in engines
        ],
        handoff=handoff,
        kv_bytes_per_token=first["kv_bytes_per_token"],
        tokens_per_block=first["tokens_per_block"],
        transfer_backend=backend,
        meta={
            "cpu": cpu_model(),
            "cores": cores,
            "device": cfg.model.device,
            "kv_dtype": first["dtype"],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "tool": "pdserve bench profile",
        },
    )
    profile.save(Path(args.out))
    print(f"wrote {args.out}")
    return 0
