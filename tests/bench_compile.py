"""Eager vs compiled forward of the model runner, in one process (not part of the test suite).

Prints, for each thread count: the prefill time of one 286-token prompt and the decode step
time at batch 1, 8 and 32 (each sequence at a 300-token context) for three runners built from
the same model folder:

- ``eager``: transformers' forward, ``model.compile: false``;
- ``prepacked``: the same eager forward with oneDNN-prepacked linears only
  (:func:`pdserve.workers.engine.compile.prepack_linears`), to show what the packing alone buys;
- ``compiled``: ``model.compile: true`` (prepacked + ``torch.compile``).

Calls alternate between the runners (``--rounds`` rounds, median of each), so load from other
processes hits all three alike; the ratios are the figures to quote. Start-up compile time is
measured in child processes: once with an empty inductor cache (cold) and once reusing it (warm).

    python tests/bench_compile.py [--model DIR] [--threads 1 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.models import prepare_default_model
from pdserve.protocol import KVLayout, SamplingParams
from pdserve.settings import default_cache_dir
from pdserve.workers.engine.compile import prepack_linears
from pdserve.workers.engine.model_runner import ModelRunner
from pdserve.workers.engine.scheduler import ScheduledBatch, ScheduledSequence
from pdserve.workers.engine.sequence import Sequence
from pdserve.workers.kv.manager import KVCacheManager
from tests.support.engine import engine_config

PREFILL_TOKENS = 286
DECODE_CONTEXT = 300
DECODE_BATCHES = (1, 8, 32)
TOKENS_PER_BLOCK = 16
SAMPLING = SamplingParams(temperature=0.0, max_tokens=64)

STARTUP_CHILD = """
import sys, time, torch
from pathlib import Path
from pdserve.workers.engine.model_runner import ModelRunner
from tests.support.engine import engine_config
torch.set_num_threads(int(sys.argv[2]))
r = ModelRunner(engine_config(Path(sys.argv[1]), compile=True))
print(f"{r.compiled.compile_s:.2f}")
"""


class Steps:
    """Scheduled batches over one KV pool shared by the runners (same layout, same blocks)."""

    def __init__(self, runner: ModelRunner):
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
        prompt = [(7 * i + 11) % self.vocab for i in range(prompt_len)]
        seq = Sequence(rid, prompt, SAMPLING, "full", need_blocks=0)
        if computed > prompt_len - 1:
            seq.output_token_ids = [42] * (computed - prompt_len + 1)
        seq.num_computed_tokens = computed
        if rid not in self.kv.holders():
            self.kv.allocate(rid, computed + 1 if computed else prompt_len)
        return seq

    def prefill(self) -> ScheduledBatch:
        seq = self._seq("prefill", PREFILL_TOKENS, 0)
        return ScheduledBatch(prefill=[ScheduledSequence.of(seq, PREFILL_TOKENS)])

    def decode(self, batch: int) -> ScheduledBatch:
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
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, "-c", STARTUP_CHILD, str(model), str(threads)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2 (cached)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-startup", action="store_true")
    args = parser.parse_args()
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
        "eager": ModelRunner(engine_config(model, compile=False)),
        "prepacked": ModelRunner(engine_config(model, compile=False)),
        "compiled": ModelRunner(engine_config(model, compile=True)),
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
            fns = {n: (lambda r=r, b=batch: r.execute(b, steps.kv)) for n, r in runners.items()}
            ms = interleaved_ms(fns, args.rounds)
            cells = "".join(f"{ms[n]:>9.1f} ms" for n in runners)
            print(f"{case:<14}{cells}   {ms['compiled'] / ms['eager']:.2f}")


if __name__ == "__main__":
    main()
