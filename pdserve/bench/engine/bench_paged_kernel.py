"""``pdserve bench paged-attention``: the paged-attention kernel against today's gather + SDPA.

One layer's attention on SmolLM2-135M's layout (9 query heads, 3 kv heads, head size 64,
16 tokens per block) with random data: decode steps of ``B`` sequences at a context of ``C``
tokens each (``BxC``), and one continued prefill chunk (``q Q/C``: Q query rows over a C-token
context). Blocks are scattered over the pool (a random permutation), as in a served pool.

Columns: time per layer call of :func:`pdserve.workers.engine.model.attention.paged_attention` (the
step's K/V store, the ``index_select`` gather into a workspace, SDPA) and of the same store
followed by :func:`pdserve.workers.engine.model.paged_kernel.paged_attention_varlen`, medians;
``speed-up`` is their ratio; ``max|diff|`` the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when the benchmark runs, not when the CLI is built
    import torch

HEADS, KV_HEADS, HEAD_DIM, TPB = 9, 3, 64, 16  # SmolLM2-135M
DECODE_CASES = ((1, 512), (2, 512), (2, 8192), (8, 300), (32, 300), (32, 1000))
PREFILL_CASE = (256, 2048)  # query rows, context


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench paged-attention``."""
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16"],
        help="model and KV cache dtype, one table section each (default: float32 bfloat16)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--min-time",
        type=float,
        default=0.25,
        help="seconds each path of each case is timed for, at least 5 calls (default: 0.25)",
    )
    p.add_argument(
        "--steps",
        action="store_true",
        help="instead: whole decode steps of the model (--model, default SmolLM2; --dtype "
        "auto) at batch 2 and contexts of 512, 2048 and 8192 tokens, in-place kernel vs "
        "gather + SDPA, and each path's 8192 / 512 step-time ratio",
    )
    p.add_argument("--model", default=None, help="--steps: model folder (default: SmolLM2)")
    p.add_argument("--dtype", default="auto", help="--steps: model dtype (default: auto)")


@dataclass
class _Case:
    label: str
    seqs: int
    q_len: int
    ctx: int


def _cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _median_ms(fn: Callable[[], object], min_time: float) -> float:
    fn()  # warm-up
    times: list[float] = []
    deadline = time.perf_counter() + min_time
    while len(times) < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _run_case(case: _Case, dtype: torch.dtype, min_time: float) -> tuple[float, float, float]:
    """(gather + SDPA ms, kernel ms, max |diff|) of one case."""
    import torch

    from pdserve.workers.engine.model import attention as att
    from pdserve.workers.engine.model.paged_kernel import paged_attention_varlen

    gen = torch.Generator().manual_seed(0)
    per_seq = math.ceil(case.ctx / TPB)
    num_blocks = case.seqs * per_seq + 1
    pool = torch.randn(1, num_blocks, 2, TPB, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: case.seqs * per_seq]
    tables = tables.view(case.seqs, per_seq)
    tokens = case.seqs * case.q_len
    query = torch.randn(1, HEADS, tokens, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen).to(dtype)
    ctx = torch.full((case.seqs,), case.ctx, dtype=torch.int64)
    pos = torch.arange(case.ctx - case.q_len, case.ctx).repeat(case.seqs)
    rows = torch.arange(case.seqs).repeat_interleave(case.q_len)
    k_slots = tables[rows, pos // TPB] * 2 * TPB + pos % TPB
    workspace = torch.empty(
        att.workspace_numel(tables.numel(), per_seq, TPB, KV_HEADS, HEAD_DIM), dtype=dtype
    )
    decode = case.q_len == 1
    mask = None
    if decode and case.seqs > 1:
        keys = torch.arange(per_seq * TPB)
        mask = (keys[None, :] < ctx[:, None]).view(case.seqs, 1, 1, -1)
    chunks: tuple[att.PrefillChunk, ...] = ()
    if not decode:
        mask_chunk = att.bottom_right_causal_mask(case.q_len, case.ctx)
        chunks = (att.PrefillChunk(0, case.q_len, case.ctx, tables[0], mask_chunk),)
    meta = att.PagedAttentionMetadata(
        pool=pool,
        k_slots=k_slots,
        v_slots=k_slots + TPB,
        num_decode=case.seqs if decode else 0,
        decode_block_tables=tables if decode else None,
        decode_mask=mask,
        decode_ctx_len=case.ctx,
        prefill=chunks,
        workspace=workspace,
    )
    scale = HEAD_DIM**-0.5
    query_start = torch.arange(case.seqs + 1, dtype=torch.int64) * case.q_len
    cache = pool[0]
    flat = cache.view(-1, KV_HEADS, HEAD_DIM)
    out = torch.empty(tokens, HEADS, HEAD_DIM, dtype=dtype)
    q_rows = query[0].transpose(0, 1)  # [T, H, hd], copied by the kernel's wrapper as SDPA's is

    def baseline() -> torch.Tensor:
        return att.paged_attention(meta, 0, query, key, value, scale)[0]

    def kernel() -> torch.Tensor:
        att.store_kv(flat, meta.k_slots, key[0].transpose(0, 1))
        att.store_kv(flat, meta.v_slots, value[0].transpose(0, 1))
        return paged_attention_varlen(q_rows, cache, tables, query_start, ctx, scale, out=out)

    diff = (baseline().float() - kernel().float()).abs().max().item()
    base_ms = _median_ms(baseline, min_time)
    kernel_ms = _median_ms(kernel, min_time)
    return base_ms, kernel_ms, diff


STEP_CONTEXTS = (512, 2048, 8192)


def _steps(args: argparse.Namespace) -> int:
    """``--steps``: decode step time of the whole model at batch 2 against context length."""
    import torch

    from pdserve.config.loading import EngineConfig
    from pdserve.config.settings import KVCacheSettings, ModelSettings, SchedulerSettings
    from pdserve.models import resolve_model
    from pdserve.protocol import SamplingParams
    from pdserve.workers.engine.engine import Engine
    from pdserve.workers.engine.scheduler import ScheduledBatch, ScheduledSequence
    from pdserve.workers.engine.sequence import Sequence

    blocks = 2 * (max(STEP_CONTEXTS) // TPB + 1)
    cfg = EngineConfig(
        model_path=resolve_model(args.model, cache_dir=None),
        model=ModelSettings(dtype=args.dtype),
        kv_cache=KVCacheSettings(num_blocks=blocks, tokens_per_block=TPB),
        scheduler=SchedulerSettings(threads=args.threads),
    )
    engine = Engine(cfg)  # not started: this thread runs the steps
    runner, kv = engine.runner, engine.kv_cache
    print(
        f"CPU: {_cpu_model()}; {runner.dtype_name}, {torch.get_num_threads()} threads, "
        f"compiled {runner.compiled is not None}; ms per decode step, batch 2"
    )
    print(f"{'context':>8}{'gather+SDPA':>13}{'in-place':>10}{'speed-up':>10}")
    times: dict[bool, list[float]] = {True: [], False: []}
    for ctx in STEP_CONTEXTS:  # the pool's contents do not matter for the time
        seqs = []
        for i in range(2):
            seq = Sequence(f"s{i}", [7] * ctx, SamplingParams(max_tokens=2), "full", 0)
            kv.allocate(seq.request_id, ctx)
            seq.num_computed_tokens = ctx - 1
            seqs.append(seq)
        batch = ScheduledBatch(decode=[ScheduledSequence.of(s, 1) for s in seqs])
        row = []
        for in_place in (False, True):
            runner.in_place = in_place
            ms = _median_ms(functools.partial(runner.execute, batch, kv), args.min_time * 8)
            times[in_place].append(ms)
            row.append(ms)
        for seq in seqs:
            kv.free(seq.request_id)
        print(f"{ctx:>8}{row[0]:>13.2f}{row[1]:>10.2f}{row[0] / row[1]:>9.2f}x", flush=True)
    for in_place, label in ((False, "gather+SDPA"), (True, "in-place")):
        t = times[in_place]
        print(f"{label}: step at {STEP_CONTEXTS[-1]} / at {STEP_CONTEXTS[0]} = {t[-1] / t[0]:.2f}x")
    engine.shutdown()
    return 0


def main(args: argparse.Namespace) -> int:
    """Print the table; returns 0, or 1 when the kernel is unavailable."""
    import torch

    from pdserve.workers.engine.model.paged_kernel import available, unavailable_reason

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps:
        return _steps(args)
    started = time.perf_counter()
    if not available():
        print(f"paged attention kernel unavailable: {unavailable_reason()}")
        return 1
    print(
        f"CPU: {_cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"kernel ready in {time.perf_counter() - started:.1f} s"
    )
    print(f"layout: H={HEADS}, kvh={KV_HEADS}, hd={HEAD_DIM}, tpb={TPB}; ms per layer call")
    cases = [_Case(f"decode {b}x{c}", b, 1, c) for b, c in DECODE_CASES]
    q, c = PREFILL_CASE
    cases.append(_Case(f"prefill q {q}/{c}", 1, q, c))
    print(
        f"{'dtype':<10}{'case':<18}{'gather+SDPA':>12}{'kernel':>10}{'speed-up':>10}"
        f"{'max|diff|':>11}"
    )
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for case in cases:
            base_ms, kernel_ms, diff = _run_case(case, dtype, args.min_time)
            print(
                f"{name:<10}{case.label:<18}{base_ms:>12.3f}{kernel_ms:>10.3f}"
                f"{base_ms / kernel_ms:>9.2f}x{diff:>11.1e}",
                flush=True,
            )
    return 0
