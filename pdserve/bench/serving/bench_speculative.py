"""``pdserve bench speculative``: n-gram speculative decoding against plain decoding, one run.

For each workload (``copy``: repeat a given text; ``edit``: rewrite a given text with one
change; ``chat``: an open question, nothing to copy) and each ``--speculative-tokens`` value
(0 = plain decoding, the reference), one in-process engine answers the workload's prompt
``--requests`` times, one request at a time (concurrency 1), greedy. Per run: output tokens,
whether the tokens equal the reference's, TTFT, ITL p50 (gaps between consecutive tokens as a
streaming client receives them: tokens verified in the same step arrive together), TPOT (time
per output token after the first), tokens per verifying step and the draft acceptance rate.
Diagnostic code: it builds engines directly, never a server.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.workers.engine.engine import Engine

PASSAGE = (
    "The KV cache stores the keys and values of every token a request has seen, so that each "
    "decode step attends to them without recomputing them. Disaggregated serving runs the "
    "prefill on one worker and the decode on another, and moves the KV cache between them "
    "over the network. The prefill worker is bound by compute; the decode worker by memory "
    "bandwidth, which is why the two phases are sized separately."
)

WORKLOADS = {
    "copy": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "edit": "Rewrite the following text, replacing the word 'worker' with 'server' "
    f"everywhere and changing nothing else:\n\n{PASSAGE}",
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench speculative``."""
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument(
        "--workloads",
        nargs="+",
        default=list(WORKLOADS),
        choices=list(WORKLOADS),
        help="copy (repeat a text), edit (rewrite it with one change), chat (nothing to copy)",
    )
    p.add_argument(
        "--speculative-tokens",
        nargs="+",
        type=int,
        default=[0, 4],
        dest="spec",
        help="drafts per step to compare; 0 (plain decoding) is the reference",
    )
    p.add_argument("--requests", type=int, default=3, help="requests per workload (one at a time)")
    p.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager forward")
    p.add_argument("--dtype", default="auto", help="model dtype (default: auto)")


@dataclass
class _Run:
    tokens: list[int]
    ttft_s: float
    gaps_s: list[float]


def _one(engine: Engine, rid: str, prompt: list[int], max_tokens: int) -> _Run:
    """One greedy request; token arrival times as the sink sees them."""
    from pdserve.protocol import SamplingParams
    from pdserve.workers.engine.engine import EngineOutput, EngineRequest

    stamps: list[float] = []
    tokens: list[int] = []
    done = threading.Event()
    errors: list[str] = []

    def sink(out: EngineOutput) -> None:
        now = time.perf_counter()
        stamps.extend(now for _ in out.token_ids)
        tokens.extend(out.token_ids)
        if out.error:
            errors.append(out.error)
        if out.finish_reason is not None:
            done.set()

    start = time.perf_counter()
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.add_request(EngineRequest(rid, prompt, sampling), sink)
    if not done.wait(600):
        raise TimeoutError(f"{rid} did not finish in 600 s")
    if errors:
        raise RuntimeError(f"{rid}: {errors[0]}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return _Run(tokens, stamps[0] - start, gaps)


def main(args: argparse.Namespace) -> int:
    """Run every workload under every ``--speculative-tokens`` value and print one row each;
    returns 1 when a speculative run's tokens differ from plain decoding's, else 0."""
    from pdserve.config.loading import EngineConfig
    from pdserve.config.settings import KVCacheSettings, ModelSettings, SchedulerSettings
    from pdserve.hardware import cpu_model
    from pdserve.models import resolve_model
    from pdserve.workers.engine.engine import Engine

    path = resolve_model(args.model, cache_dir=None)
    print(f"model {Path(path).name}, dtype {args.dtype}, compile {args.compile}, cpu {cpu_model()}")
    print(f"{args.requests} greedy requests per workload, one at a time, {args.max_tokens} tokens")
    head = f"{'workload':<9}{'spec':>5}{'tokens':>8}{'= ref':>7}{'TTFT ms':>9}{'ITL p50':>9}"
    print(head + f"{'TPOT ms':>9}{'TPOT/ref':>9}{'tok/step':>9}{'accept':>8}")
    reference: dict[str, tuple[list[list[int]], float]] = {}
    status = 0
    for k in sorted(set(args.spec)):
        cfg = EngineConfig(
            model_path=path,
            model=ModelSettings(compile=args.compile, dtype=args.dtype),
            kv_cache=KVCacheSettings(budget_mb=256),
            scheduler=SchedulerSettings(threads=args.threads, speculative_tokens=k),
        )
        engine = Engine(cfg)
        engine.start()
        try:
            tok = engine.tokenizer
            _one(engine, "warm-up", tok.encode("Hello"), 8)
            for name in args.workloads:
                msgs = [{"role": "user", "content": WORKLOADS[name]}]
                text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                prompt = tok.encode(text, add_special_tokens=False)
                before = engine.load()
                runs = [
                    _one(engine, f"{name}-{k}-{i}", prompt, args.max_tokens)
                    for i in range(args.requests)
                ]
                after = engine.load()
                outs = [r.tokens for r in runs]
                n_out = sum(len(t) for t in outs)
                tpot = sum(sum(r.gaps_s) for r in runs) / max(1, n_out - len(runs))
                ref_outs, ref_tpot = reference.setdefault(name, (outs, tpot))
                same = outs == ref_outs
                status |= 0 if same else 1
                gaps = [g for r in runs for g in r.gaps_s]
                steps = after.spec_drafts - before.spec_drafts
                drafted = after.spec_draft_tokens - before.spec_draft_tokens
                acc = after.spec_accepted_tokens - before.spec_accepted_tokens
                per_step = f"{1 + acc / steps:.2f}" if steps else "-"
                rate = f"{acc / drafted:.0%}" if drafted else "-"
                print(
                    f"{name:<9}{k:>5}{n_out:>8}{'yes' if same else 'NO':>7}"
                    f"{statistics.median(r.ttft_s for r in runs) * 1e3:>9.1f}"
                    f"{statistics.median(gaps) * 1e3 if gaps else 0:>9.1f}"
                    f"{tpot * 1e3:>9.1f}{tpot / ref_tpot:>8.2f}x{per_step:>9}{rate:>8}",
                    flush=True,
                )
        finally:
            engine.shutdown()
    return status
