"""The C++ paged-attention kernel (:mod:`pdserve.workers.engine.model.paged_kernel`) computes what a
float64 reference computes over K/V gathered through the block tables, and what today's path
(:func:`pdserve.workers.engine.model.attention.paged_attention`, gather + SDPA) returns: decode rows,
continued prefill chunks and whole prompts in one call; GQA group sizes 1, 3 and 4; head sizes
64 and 128; 1, 16 and 32 tokens per block; sliding window, soft-capping and sinks; float32,
bfloat16, FP8 caches under float32 and bfloat16 queries; the split-context (flash-decoding)
path; table entries past the context that are garbage. The kernel is compiled once for the
module (tens of seconds the first time, then torch's build cache)."""

from __future__ import annotations

import argparse
import math
import os
import shutil

import pytest
import torch

from pdserve.bench.engine import bench_paged_kernel as bench
from pdserve.workers.engine.model import attention as att
from pdserve.workers.engine.model import paged_kernel

F32, BF16 = torch.float32, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler (c++ or $CXX): the kernel is compiled at first use")
    assert paged_kernel.available(), paged_kernel.unavailable_reason()


class Step:
    """A random step: ``seqs`` = ``(q_len, ctx_len)`` per sequence, a shuffled pool of
    ``[num_blocks, 2, tpb, kvh, hd]`` and tables padded with garbage ids."""

    def __init__(
        self,
        seqs: list[tuple[int, int]],
        heads: int = 9,
        kv_heads: int = 3,
        head_dim: int = 64,
        tpb: int = 16,
        cache_dtype: torch.dtype = F32,
        query_dtype: torch.dtype = F32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seqs, self.heads, self.tpb = seqs, heads, tpb
        per_seq = [math.ceil(c / tpb) for _, c in seqs]
        width = max(per_seq) + 2
        num_blocks = sum(per_seq) + 3
        pool = torch.randn(num_blocks, 2, tpb, kv_heads, head_dim, generator=gen)
        self.cache = att.to_cache(pool * 2, cache_dtype)
        ids = torch.randperm(num_blocks, generator=gen)
        # past each context: garbage, out of range both ways (never read)
        self.tables = torch.randint(-(10**9), 10**9, (len(seqs), width), generator=gen)
        start = 0
        for s, n in enumerate(per_seq):
            self.tables[s, :n] = ids[start : start + n]
            start += n
        q_lens = torch.tensor([q for q, _ in seqs])
        self.query_start = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        self.query_start[1:] = q_lens.cumsum(0)
        self.ctx = torch.tensor([c for _, c in seqs], dtype=torch.int64)
        tokens = int(q_lens.sum())
        self.query = torch.randn(tokens, heads, head_dim, generator=gen).to(query_dtype)
        self.scale = head_dim**-0.5
        self.sinks = torch.randn(heads, generator=gen) * 2

    def kernel(
        self,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        args = (self.query, self.cache, self.tables, self.query_start, self.ctx, self.scale)
        return paged_kernel.paged_attention_varlen(*args, window, softcap, sinks, out)

    def reference(
        self, window: int | None = None, softcap: float | None = None, sinks: bool = False
    ) -> torch.Tensor:
        """float64 attention over each sequence's K/V gathered through its table."""
        cache = self.cache.to(torch.float64)
        kvh, hd = cache.shape[3:]
        groups = self.heads // kvh
        outs = []
        for s, (q_len, ctx) in enumerate(self.seqs):
            q0 = int(self.query_start[s])
            q = self.query[q0 : q0 + q_len].to(torch.float64)
            blocks = cache[self.tables[s, : math.ceil(ctx / self.tpb)]]
            k = blocks[:, 0].reshape(-1, kvh, hd)[:ctx].repeat_interleave(groups, 1)
            v = blocks[:, 1].reshape(-1, kvh, hd)[:ctx].repeat_interleave(groups, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            pos = torch.arange(ctx - q_len, ctx)[:, None]
            keys = torch.arange(ctx)[None, :]
            mask = keys <= pos
            if window is not None:
                mask &= keys > pos - window
            scores = scores.masked_fill(~mask, float("-inf"))
            if sinks:
                sink = self.sinks.to(torch.float64).view(-1, 1, 1).expand(-1, q_len, 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        return torch.cat(outs)

    def check(
        self,
        window: int | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        got = self.kernel(window=window, softcap=softcap, sinks=self.sinks if sinks else None)
        want = self.reference(window, softcap, sinks)
        assert got.dtype == self.query.dtype and got.shape == self.query.shape
        tol = 1e-5 if self.query.dtype == F32 else 1e-2  # bf16: the output's rounding
        torch.testing.assert_close(got.to(torch.float64), want, atol=tol, rtol=tol)


DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 100), (1, 257)]
MIXED = [(1, 40), (1, 1), (5, 40), (33, 33), (1, 77), (20, 300), (17, 17), (1, 129)]


def test_decode_rows_of_different_lengths() -> None:
    step = Step(DECODE)
    step.check()
    step.tables = step.tables.to(torch.int32)  # int32 tables, a query that is a strided view
    step.query = step.query.transpose(0, 1).contiguous().transpose(0, 1)
    step.check()


def test_prefill_chunks_mixed_with_decode_rows() -> None:
    Step(MIXED).check()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "tpb"),
    [(9, 3, 64, 16), (8, 2, 128, 1), (4, 4, 64, 32), (8, 2, 64, 32), (4, 4, 128, 1),
     (32, 2, 64, 16), (72, 1, 32, 16), (4, 2, 80, 16), (2, 1, 256, 16), (6, 3, 8, 16)],
)  # fmt: skip
def test_gqa_groups_head_sizes_and_block_sizes(
    heads: int, kv_heads: int, head_dim: int, tpb: int
) -> None:
    """Also groups of 16 (decode rows on the lanes path) and 72 (prefill on the dot path),
    head sizes off the vector width (80, 8) and 256."""
    Step(MIXED, heads, kv_heads, head_dim, tpb).check()


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_fp8_every_bit_pattern(cache_dtype: torch.dtype) -> None:
    """Random bytes as K and V, from subnormals to the format's largest values, and NaN (in V of
    the last sequence only: its rows come out NaN, as the reference's)."""
    step = Step([(1, 30), (4, 50), (1, 70)], seed=10)
    gen = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, step.cache.shape, dtype=torch.uint8, generator=gen)
    raw[~raw.view(cache_dtype).float().isfinite()] = 0  # e5m2's infinities too
    step.cache = raw.view(cache_dtype)
    step.scale = 1e-6  # scores of a few units despite K up to 57344
    atol = 1e-6 * torch.finfo(cache_dtype).max  # float32 sums of values up to that
    torch.testing.assert_close(step.kernel().double(), step.reference(), atol=atol, rtol=1e-5)
    raw[int(step.tables[2, 1]), 1, 3, 0, 5] = 0x7F if cache_dtype == E4M3 else 0x7E
    got, want = step.kernel(), step.reference()
    assert got[-1].isnan().any() and not got[:-1].isnan().any()
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize(
    ("window", "softcap", "sinks"),
    [(16, None, False), (1, None, False), (None, 3.0, False), (None, None, True),
     (24, 5.0, True)],
)  # fmt: skip
def test_window_softcap_and_sinks(window: int | None, softcap: float | None, sinks: bool) -> None:
    Step(MIXED, seed=1).check(window, softcap, sinks)
    Step(MIXED, 8, 2, 128, 1, seed=2).check(window, softcap, sinks)


@pytest.mark.parametrize("cache_dtype", [F32, BF16, E4M3, E5M2])
@pytest.mark.parametrize("query_dtype", [F32, BF16])
def test_cache_and_query_dtypes(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> None:
    step = Step(MIXED, cache_dtype=cache_dtype, query_dtype=query_dtype, seed=3)
    step.check()
    step.check(window=20, softcap=4.0, sinks=True)


def test_float16_query_and_cache() -> None:
    Step(MIXED, cache_dtype=torch.float16, query_dtype=torch.float16).check(window=30)


@pytest.mark.parametrize("sinks", [False, True])
def test_long_decode_splits_its_context(sinks: bool) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # the split needs more threads than work items
    try:
        Step([(1, 5000)], seed=4).check(sinks=sinks)
        Step([(1, 5000)], 8, 2, 128, 16, cache_dtype=BF16, seed=5).check(window=3000)
        Step([(1, 4000), (1, 3)], 4, 1, 64, 1, seed=6).check(softcap=2.0, sinks=sinks)
    finally:
        torch.set_num_threads(threads)


def test_single_thread() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Step(MIXED + [(1, 3000)], seed=7).check(sinks=True)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [None, 19])
def test_matches_todays_gather_and_sdpa(window: int | None) -> None:
    """Decode rows then a continued chunk, through attention.paged_attention's own metadata
    (its store writes the step's K/V first; the kernel then reads them from the pool)."""
    step = Step([(1, 50), (1, 7), (1, 33), (12, 60)], seed=8)
    tpb, kvh, hd = step.cache.shape[2:]
    tokens = step.query.shape[0]
    gen = torch.Generator().manual_seed(9)
    key = torch.randn(1, kvh, tokens, hd, generator=gen)
    value = torch.randn(1, kvh, tokens, hd, generator=gen)
    pos = torch.cat([torch.arange(c - q, c) for q, c in step.seqs])
    rows = torch.arange(len(step.seqs)).repeat_interleave(torch.tensor([q for q, _ in step.seqs]))
    k_slots = step.tables[rows, pos // tpb] * 2 * tpb + pos % tpb
    used = torch.arange(4)[None] < (step.ctx[:3, None] + tpb - 1) // tpb
    decode_tables = step.tables[:3, :4].masked_fill(~used, 0)  # today's path reads padding
    keys = torch.arange(4 * tpb)
    chunk_blocks = step.tables[3, : math.ceil(60 / tpb)]
    meta = att.PagedAttentionMetadata(
        pool=step.cache.unsqueeze(0),
        k_slots=k_slots,
        v_slots=k_slots + tpb,
        num_decode=3,
        decode_block_tables=decode_tables,
        decode_mask=(keys[None] < step.ctx[:3, None]).view(3, 1, 1, -1),
        decode_ctx_len=0,
        prefill=(att.PrefillChunk(3, 12, 60, chunk_blocks, att.bottom_right_causal_mask(12, 60)),),
    )
    query = step.query.transpose(0, 1).unsqueeze(0)  # [1, H, T, hd]
    want = att.paged_attention(meta, 0, query, key, value, step.scale, att.Variant(window))[0]
    out = torch.full_like(step.query, float("nan"))
    got = step.kernel(window=window, out=out)
    assert got is out
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("window", [None, 19])
def test_store_attend_equals_the_store_then_gather_and_sdpa(
    dtype: torch.dtype, window: int | None
) -> None:
    """The fast path (every row of the step is the kernel's: one ``store_attend`` call) writes
    the same pool bytes and returns what the store + gather + SDPA path returns, for K/V in
    transformers' strided layout (``[1, T, kvh, hd]`` transposed)."""
    step = Step([(1, 50), (1, 7), (1, 33), (12, 60)], cache_dtype=dtype, query_dtype=dtype, seed=3)
    tpb, kvh, hd = step.cache.shape[2:]
    tokens = step.query.shape[0]
    gen = torch.Generator().manual_seed(4)
    key = torch.randn(1, tokens, kvh, hd, generator=gen).to(dtype).transpose(1, 2)
    value = torch.randn(1, tokens, kvh, hd, generator=gen).to(dtype).transpose(1, 2)
    pos = torch.cat([torch.arange(c - q, c) for q, c in step.seqs])
    rows = torch.arange(len(step.seqs)).repeat_interleave(torch.tensor([q for q, _ in step.seqs]))
    k_slots = step.tables[rows, pos // tpb] * 2 * tpb + pos % tpb
    used = torch.arange(4)[None] < (step.ctx[:3, None] + tpb - 1) // tpb
    keys = torch.arange(4 * tpb)
    chunk = att.PrefillChunk(3, 12, 60, step.tables[3, :4], att.bottom_right_causal_mask(12, 60))

    def meta(kernel: att.KernelRows | None) -> att.PagedAttentionMetadata:
        return att.PagedAttentionMetadata(
            pool=step.cache.clone().unsqueeze(0),
            k_slots=k_slots,
            v_slots=k_slots + tpb,
            num_decode=3,
            decode_block_tables=step.tables[:3, :4].masked_fill(~used, 0),
            decode_mask=(keys[None] < step.ctx[:3, None]).view(3, 1, 1, -1),
            decode_ctx_len=0,
            prefill=(chunk,),
            kernel=kernel,
        )

    slow, fast = (
        meta(None),
        meta(att.KernelRows(step.tables, step.query_start, step.ctx, None, tokens)),
    )
    query = step.query.transpose(0, 1).unsqueeze(0)  # [1, H, T, hd]
    variant = att.Variant(window)
    want = att.paged_attention(slow, 0, query, key, value, step.scale, variant)
    got = att.paged_attention(fast, 0, query, key, value, step.scale, variant)
    assert got.shape == want.shape == (1, tokens, step.heads, hd) and got.is_contiguous()
    assert torch.equal(fast.pool, slow.pool)  # the same K/V bytes in the same rows
    tol = 1e-5 if dtype == F32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    bad = att.PagedAttentionMetadata(**{**fast.__dict__, "k_slots": k_slots + 10**6})
    with pytest.raises(ValueError, match="slot"):
        att.paged_attention(bad, 0, query, key, value, step.scale, variant)


def test_rejects_what_it_cannot_read() -> None:
    step = Step([(1, 20), (3, 40)])
    bad = step.tables.clone()
    bad[1, 1] = step.cache.shape[0]  # inside the context: out of range
    with pytest.raises(ValueError, match="block 1"):
        paged_kernel.paged_attention_varlen(
            step.query, step.cache, bad, step.query_start, step.ctx, 1.0
        )
    with pytest.raises(ValueError, match="query rows"):
        paged_kernel.paged_attention_varlen(
            step.query, step.cache, step.tables, step.query_start, torch.tensor([1, 2]), 1.0
        )
    with pytest.raises(ValueError, match="kv heads"):
        paged_kernel.paged_attention_varlen(
            step.query[:, :8], step.cache, step.tables, step.query_start, step.ctx, 1.0
        )


def test_bench_prints_a_row_per_case(capsys: pytest.CaptureFixture[str]) -> None:
    """``pdserve bench paged-attention``: every case timed, the outputs of both paths agree."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.main(parser.parse_args(["--dtypes", "float32", "--min-time", "0"])) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "float32" in line]
    assert len(rows) == len(bench.DECODE_CASES) + 1
    for row in rows:  # dtype, case words, ms, ms, ratio, max |diff|
        assert float(row[-4]) > 0 and float(row[-3]) > 0 and float(row[-1]) < 1e-5


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_on() -> None:
    """torch's ``lock`` file, left in the build directory by a process killed during the
    build, made every later process wait forever; a fresh process now removes it and loads."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    from pdserve.workers.engine.model.kernel_build import cpu_build_name

    name = cpu_build_name(paged_kernel.BUILD_PREFIX)
    stale = Path(_get_build_directory(name, verbose=False)) / "lock"
    stale.touch()
    code = (
        "import logging; logging.basicConfig()\n"
        "from pdserve.workers.engine.model import paged_kernel\n"
        "assert paged_kernel.available(), paged_kernel.unavailable_reason()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "left by a build that did not finish" in done.stderr
    assert not stale.exists()
