"""``pdserve bench compile``: eager vs compiled forward of the model runner, in one process.

Prints, for each thread count: the prefill time of one 286-token prompt and the decode step
time at batch 1, 8 and 32 (each sequence at a 300-token context) for three runners built from
the same model folder:

- ``eager``: transformers' forward, ``model.compile: false``;
- ``prepacked``: the same eager forward with oneDNN-prepacked linears only
  (:func:`pdserve.workers.engine.model.compile.prepack_linears`), to show what the packing alone buys;
- ``compiled``: ``model.compile: true`` (prepacked + ``torch.compile``).

Calls alternate between the runners (``--rounds`` rounds, median of each), so load from other
processes hits all three alike; the ratios are the figures to quote. Start-up compile time is
measured in child processes: once with an empty inductor cache (cold) and once reusing it (warm).

    pdserve bench compile [--model DIR] [--threads 1 2] [--rounds 7]

Importing this module is light (torch and the engine load when the benchmark runs); the options
live in :mod:`pdserve.bench.bench_commands`.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.workers.engine.model.model_runner import ModelRunner
    from pdserve.workers.engine.scheduler import ScheduledBatch
    from pdserve.workers.engine.sequence import Sequence

DESCRIPTION = """\
Eager vs compiled forward of the model runner, in this process: for each thread count, the
prefill time of one 286-token prompt and the decode step time at batch 1, 8 and 32 (each
sequence at a 300-token context) for three runners of the same model folder: eager
(transformers' forward), prepacked (the same with oneDNN-prepacked linears only) and compiled
(model.compile: prepacked + torch.compile). Calls alternate between the runners, medians of
--rounds rounds; the ratios are the figures to quote. First the start-up compile time, in child
processes: with an empty inductor cache (cold) and reusing it (warm).
"""
"""The ``pdserve bench compile --help`` text."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench compile``."""
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="DIR",
        help="model folder (default: the converted SmolLM2 in the cache)",
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch thread counts, one table each (default: 1 2)",
    )
    p.add_argument("--rounds", type=int, default=7, help="rounds per case (default: 7)")
    p.add_argument(
        "--skip-startup", action="store_true", help="skip the start-up compile measurement"
    )


PREFILL_TOKENS = 286
DECODE_CONTEXT = 300
DECODE_BATCHES = (1, 8, 32)
TOKENS_PER_BLOCK = 16

STARTUP_CHILD = """
import sys, torch
from pathlib import Path
from pdserve.bench.engine.bench_compile import runner
torch.set_num_threads(int(sys.argv[2]))
print(f"{runner(Path(sys.argv[1]), compile=True).compiled.compile_s:.2f}")
"""


def runner(model: Path, *, compile: bool) -> ModelRunner:
    """A model runner of the model folder ``model``, ``model.compile`` as given, every other
    setting its default (CPU, the model's dtype)."""
    from pdserve.config.loading import EngineConfig
    from pdserve.config.settings import ModelSettings
    from pdserve.workers.engine.model.model_runner import ModelRunner

    return ModelRunner(EngineConfig(model_path=model, model=ModelSettings(compile=compile)))


class Steps:
    """Scheduled batches over one KV pool shared by the runners (same layout, same blocks)."""

    def __init__(self, runner: ModelRunner):
        from pdserve.protocol import KVLayout
        from pdserve.workers.kv.manager import KVCacheManager

        layout = KVLayout(
            model="bench",
            num_layers=runner.num_layers,
            num_kv_heads=runner.num_kv_heads,
            head_dim=runner.head_dim,
            tokens_per_block=TOKENS_PER_BLOCK,
            dtype="float32",
        )
        blocks = (PREFILL_TOKENS + max(DECODE_BATCHES) * (DECODE_CONTEXT + 1)) // TOKENS_PER_BLOCK
        self.kv = KVCacheManager(layout, blocks + max(DECODE_BATCHES) + 8)
        self.kv.pool.normal_(std=0.5)  # resident pages, plausible values
        self.vocab = runner.vocab_size

    def _seq(self, rid: str, prompt_len: int, computed: int) -> Sequence:
        from pdserve.protocol import SamplingParams
        from pdserve.workers.engine.sequence import Sequence

        prompt = [(7 * i + 11) % self.vocab for i in range(prompt_len)]
        sampling = SamplingParams(temperature=0.0, max_tokens=64)
        seq = Sequence(rid, prompt, sampling, "full", need_blocks=0)
        if computed > prompt_len - 1:
            seq.output_token_ids = [42] * (computed - prompt_len + 1)
        seq.num_computed_tokens = computed
        if rid not in self.kv.holders():
            self.kv.allocate(rid, computed + 1 if computed else prompt_len)
        return seq

    def prefill(self) -> ScheduledBatch:
        from pdserve.workers.engine.scheduler import ScheduledBatch, ScheduledSequence

        seq = self._seq("prefill", PREFILL_TOKENS, 0)
        return ScheduledBatch(prefill=[ScheduledSequence.of(seq, PREFILL_TOKENS)])

    def decode(self, batch: int) -> ScheduledBatch:
        from pdserve.workers.engine.scheduler import ScheduledBatch, ScheduledSequence

        seqs = [self._seq(f"decode-{i}", DECODE_CONTEXT, DECODE_CONTEXT) for i in range(batch)]
        return ScheduledBatch(decode=[ScheduledSequence.of(s, 1) for s in seqs])


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median wall time (ms) of each function, calls alternating, after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def startup_s(model: Path, threads: int, cache_dir: str) -> float:
    """Seconds a fresh process takes to compile the runner, inductor cache in ``cache_dir``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, "-c", STARTUP_CHILD, str(model), str(threads)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    """``pdserve bench compile`` (options: :mod:`pdserve.bench.bench_commands`): start-up
    compile times, then the table per thread count; 0. Raises CalledProcessError when a
    start-up child fails."""
    import torch

    from pdserve.config.settings import default_cache_dir
    from pdserve.models import prepare_default_model
    from pdserve.workers.engine.model.compile import prepack_linears

    model = args.model or prepare_default_model(default_cache_dir())

    if not args.skip_startup:
        with tempfile.TemporaryDirectory(prefix="pdserve-inductor-") as cache:
            for threads in args.threads:
                cold = startup_s(model, threads, f"{cache}/t{threads}")
                warm = startup_s(model, threads, f"{cache}/t{threads}")
                print(
                    f"start-up compile, {threads} thread(s): cold cache {cold:.1f} s, "
                    f"warm cache {warm:.1f} s"
                )

    runners = {
        "eager": runner(model, compile=False),
        "prepacked": runner(model, compile=False),
        "compiled": runner(model, compile=True),
    }
    prepack_linears(runners["prepacked"].model)
    steps = Steps(runners["eager"])
    cases = {"prefill 286": steps.prefill()}
    cases.update({f"decode b={b}": steps.decode(b) for b in DECODE_BATCHES})
    print(f"torch {torch.__version__}, model {model.name}, float32, medians of {args.rounds}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(
            f"\n{threads} thread(s)   " + "".join(f"{n:>12}" for n in runners) + "   compiled/eager"
        )
        for case, batch in cases.items():
            fns: dict[str, Callable[[], object]] = {
                n: functools.partial(r.execute, batch, steps.kv) for n, r in runners.items()
            }
            ms = interleaved_ms(fns, args.rounds)
            cells = "".join(f"{ms[n]:>9.1f} ms" for n in runners)
            print(f"{case:<14}{cells}   {ms['compiled'] / ms['eager']:.2f}")
    return 0
