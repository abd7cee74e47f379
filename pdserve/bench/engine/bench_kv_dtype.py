"""``pdserve bench kv-dtype``: what a KV storage dtype (and int8 weights) cost and keep, in one run.

For each ``--quantization`` x ``--kv-dtypes`` pair, one in-process engine over the same model
(the default model unless ``--model``): the pool's blocks for ``--kv-cache-mb``, greedy
answers to a few chat prompts compared with the first pair's (the reference), the perplexity
of a fixed English text (from the engine's prompt logprobs), and the decode step time of
``--batch`` sequences generating ``--tokens`` tokens together (after a warm-up). Diagnostic
code: it builds engines directly, never a server.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.workers.engine.engine import Engine, EngineOutput, EngineRequest

TEXT = (
    "The prefill phase computes the key and value tensors of every prompt token in one "
    "forward pass, while the decode phase produces one token per step and reads the whole "
    "cache each time. Serving systems therefore separate the two phases onto different "
    "workers, move the cache between them over the network, and tune each pool for its own "
    "bottleneck: compute for prefill, memory bandwidth for decode."
)
"""The fixed text whose perplexity the benchmark reports."""

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench kv-dtype``."""
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument(
        "--kv-dtypes",
        nargs="+",
        default=["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"],
        help="KV dtypes to compare; the first is the reference of the answers",
    )
    p.add_argument("--kv-cache-mb", type=int, default=64, help="pool size per engine, MiB")
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    p.add_argument("--tokens", type=int, default=128, help="tokens each sequence decodes")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager forward")
    p.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        choices=["none", "int8", "w8a8"],
        help="weights: none (the model dtype), int8 (weight-only, torchao), w8a8 (int8 weights and activations, oneDNN)",
    )


def main(args: argparse.Namespace) -> int:
    """Run and print one row per dtype; returns 0."""
    from pdserve.config.loading import EngineConfig
    from pdserve.config.settings import KVCacheSettings, ModelSettings, SchedulerSettings
    from pdserve.models import resolve_model
    from pdserve.protocol import SamplingParams
    from pdserve.workers.engine.engine import Engine, EngineRequest

    path = resolve_model(args.model, cache_dir=None)
    answers: dict[tuple[str, str], list[list[int]]] = {}
    print(f"model {Path(path).name}, {args.kv_cache_mb} MiB pool, {args.batch} x {args.tokens}")
    print(
        f"{'weights':<8}{'kv dtype':<10}{'blocks':>8}{'answers = ref':>15}{'ppl':>8}{'ms/step':>9}"
    )
    for weights, dtype in ((w, d) for w in args.quantization for d in args.kv_dtypes):
        cfg = EngineConfig(
            model_path=path,
            model=ModelSettings(compile=args.compile, quantization=weights),
            kv_cache=KVCacheSettings(dtype=dtype, budget_mb=args.kv_cache_mb),
            scheduler=SchedulerSettings(threads=args.threads, max_num_seqs=max(args.batch, 4)),
        )
        engine = Engine(cfg)
        engine.start()
        try:
            prompts = [_chat(engine, q) for q in PROMPTS]
            greedy = SamplingParams(max_tokens=32, temperature=0.0)
            answers[weights, dtype] = [
                _tokens(run_together(engine, [EngineRequest(f"a{i}", p, greedy)])[0])
                for i, p in enumerate(prompts)
            ]
            ppl = _perplexity(engine)
            long = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            run_together(engine, [EngineRequest(f"w{i}", prompts[i % 4], long) for i in range(2)])
            started = time.perf_counter()
            run_together(
                engine, [EngineRequest(f"b{i}", prompts[i % 4], long) for i in range(args.batch)]
            )
            step_ms = (time.perf_counter() - started) / args.tokens * 1e3
        finally:
            engine.shutdown()
        ref = answers[args.quantization[0], args.kv_dtypes[0]]
        same = sum(a == b for a, b in zip(answers[weights, dtype], ref, strict=True))
        blocks = engine.kv_cache.num_blocks
        print(
            f"{weights:<8}{dtype:<10}{blocks:>8}{f'{same} of {len(ref)}':>15}{ppl:>8.2f}"
            f"{step_ms:>9.1f}",
            flush=True,
        )
    return 0


def _chat(engine: Engine, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(str(text), add_special_tokens=False)["input_ids"])


def run_together(engine: Engine, reqs: list[EngineRequest]) -> list[list[EngineOutput]]:
    """Submit ``reqs`` together; each one's outputs once every request finished (600 s at
    most, else TimeoutError). Shared by the in-process engine benchmarks."""
    outs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in reqs}
    done, lock, left = threading.Event(), threading.Lock(), [len(reqs)]

    def sink(out: EngineOutput) -> None:
        with lock:
            outs[out.request_id].append(out)
            if out.finish_reason is not None:
                left[0] -= 1
                if not left[0]:
                    done.set()

    for r in reqs:
        engine.add_request(r, sink)
    if not done.wait(600):
        raise TimeoutError("the benchmark's requests did not finish within 600 s")
    return [outs[r.request_id] for r in reqs]


def _perplexity(engine: Engine) -> float:
    """exp of the mean negative log-likelihood of :data:`TEXT`'s tokens after the first."""
    from pdserve.protocol import SamplingParams
    from pdserve.workers.engine.engine import EngineRequest

    ids = list(engine.tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (first, *_) = run_together(engine, [EngineRequest("ppl", ids, sampling)])[0]
    lps = [lp.logprob for lp in first.prompt_logprobs or () if lp is not None]
    return math.exp(-sum(lps) / len(lps)) if lps else math.nan


def _tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]
