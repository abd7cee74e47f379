"""A CPU paged-attention kernel that reads the KV cache blocks where they are.

:func:`pdserve.workers.engine.model.attention.paged_attention` gathers each sequence's K/V blocks into
a contiguous copy (``index_select``) per layer per step and then calls SDPA; this kernel walks
the block tables instead and computes the same attention (bottom-right aligned causal, sliding
window, soft-capping, attention sinks, GQA) over the pool in place, for decode rows and
prefill chunks alike (:func:`paged_attention_varlen`, varlen like flash-attention's API).

Why a kernel of our own: PyTorch 2.13's FlexAttention on CPU was tried with a paged
``BlockMask``: with dynamic shapes inductor's CPU template fails to compile (C++ error
``cur_kvSplitSize3 was not declared``), with static shapes it compiles once per batch size and
runs 9-17x slower than gather + SDPA at batch 8-32 (1.5x faster only at batch 2, 8k context);
intel-extension-for-pytorch needs torch 2.8; vLLM's and SGLang's CPU kernels are not separately
installable. So: a small C++ kernel (:mod:`pdserve.workers.engine.model.paged_kernel_source`,
embedded so that packaging is unchanged) compiled at first use by ``torch.utils.cpp_extension.load_inline`` (g++, ninja; torch caches
the build in ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions`` and serializes builds
with a file lock), registered as the op ``torch.ops.pdserve_paged.varlen`` (and ``store_attend``, which writes
the step's K/V first: the attention's fast path when every row of a step is the kernel's). It is built with
``-O3 -march=native``, safe because it is built on the machine that runs it (the build's name
carries a hash of the CPU's flags, for caches shared between machines), with ATen's
``Vectorized<float>`` for the capability torch reports (AVX-512 here).

Design: a work item is (sequence, kv head, tile of query rows); it computes all ``H / kvh``
query heads of its kv head for the tile's rows, so each K/V row read from the pool serves every
query vector of the item. Keys go in chunks of 64, their rows found through the block table
(converted to float32 in a per-thread scratch when the cache holds bfloat16/float16/FP8; FP8
by bit operations), with an online softmax per chunk, float32 throughout. Few query vectors
(decode rows) take the *dot path*: the query vector and ``acc += p * v``'s accumulators in
registers, a vectorized dot product per key, the next chunk's rows prefetched. Many (prefill
tiles of up to 4 x the SIMD width) take the *lanes path*: query vectors across the SIMD lanes,
scores and ``acc += p * v`` as register-blocked outer products, no horizontal sums. Items run
on ATen's thread pool, taken dynamically from a list sorted by cost. With fewer items than twice the threads (decode at small batch),
long contexts are split into parts of at least 256 keys (flash-decoding) whose partial results
are combined by their log-sum-exp. Scratch grows once per thread: no heap allocation per item.

``PDSERVE_PAGED_KERNEL=0`` disables the kernel (:func:`available` returns False).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading

import torch

from pdserve.workers.engine.model.kernel_build import build_lock, cpu_build_name
from pdserve.workers.engine.model.paged_kernel_source import SOURCE

log = logging.getLogger(__name__)

BUILD_PREFIX = "pdserve_paged_attention"  # the build's name, before its CPU hash
ENV_DISABLE = "PDSERVE_PAGED_KERNEL"  # "0": :func:`available` is False, nothing compiles

QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CACHE_DTYPES = (*QUERY_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)


_lock = threading.Lock()
_state: dict[str, bool | str] = {}


def _build() -> None:
    from torch.utils.cpp_extension import load_inline

    path = os.environ.get("PATH", "")
    if (bindir := os.path.dirname(sys.executable)) not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + path  # the venv's: torch runs `ninja`
    flags = ["-O3", "-fopenmp", "-DCPU_CAPABILITY=pdserve_native"]
    if (isa := torch.backends.cpu.get_cpu_capability()) in ("AVX512", "AVX2"):  # x86-64
        flags += ["-march=native", f"-DCPU_CAPABILITY_{isa}"]  # ATen's Vectorized for it
    name = cpu_build_name(BUILD_PREFIX)
    with build_lock(name):
        # -fopenmp: at::parallel_for's OpenMP, linked to libgomp.so.1, the one torch has loaded
        load_inline(name, SOURCE, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    is_python_module=False)  # fmt: skip


def available() -> bool:
    """True when the kernel is usable in this process: compiles it on the first call (once per
    process, thread-safe; the first build takes tens of seconds, later processes load torch's
    cached build). A failure is logged once with its reason (:func:`unavailable_reason`) and
    returns False, as does ``PDSERVE_PAGED_KERNEL=0``. Never raises."""
    with _lock:
        if "ok" not in _state:
            if os.environ.get(ENV_DISABLE, "1").strip() == "0":
                _state.update(ok=False, reason=f"disabled by {ENV_DISABLE}=0")
            elif shutil.which(os.environ.get("CXX", "c++")) is None:
                _state.update(ok=False, reason="no C++ compiler (c++ or $CXX) on PATH")
            else:
                try:
                    _build()
                    _state.update(ok=True, reason="")
                except Exception as e:  # noqa: BLE001  # any build failure disables it
                    _state.update(ok=False, reason=f"{type(e).__name__}: {e}")
            if not _state["ok"]:
                log.warning("paged attention kernel unavailable: %s", _state["reason"])
        return bool(_state["ok"])


def unavailable_reason() -> str | None:
    """Why :func:`available` returned False (None before the first call or when it works)."""
    return str(_state.get("reason", "")) or None


def _require(ok: bool, what: str, t: torch.Tensor | None) -> None:
    if not ok:
        got = "" if t is None else f": got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
        raise ValueError(f"paged_attention_varlen: {what} not supported (see its docstring){got}")


def paged_attention_varlen(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``S`` sequences' query rows over their paged KV cache, read in place.

    - ``query``: ``[T, H, hd]`` float32, bfloat16 or float16.
    - ``cache``: one layer's pool ``[num_blocks, 2, tpb, kvh, hd]`` (dim 1: 0 = K, 1 = V) of
      float32/bfloat16/float16/float8_e4m3fn/float8_e5m2 (FP8 unscaled), whatever the query's
      dtype; may be a view into a bigger pool (last dim contiguous). Query head ``h`` reads kv
      head ``h // (H // kvh)``.
    - ``block_tables``: ``[S, W]`` int64 or int32, sequence ``s``'s block ids; entries past
      ``ceil(ctx_lens[s] / tpb)`` (or before its window) are never read.
    - ``query_start``: ``[S + 1]`` int (cu_seqlens from 0 to ``T``): ``s`` owns query rows
      ``[query_start[s], query_start[s + 1])``.
    - ``ctx_lens``: ``[S]`` int, ``s``'s context in tokens including its query rows, which are
      its last positions: row ``i`` is at ``p = ctx - q_len + i`` and sees keys ``j <= p``.
    - ``scale``: multiplies ``q . k``; ``window`` (tokens; None or 0: none): keys
      ``p - window < j <= p``; ``softcap`` (None or 0: none): scores become
      ``softcap * tanh(scores / softcap)``; ``sinks``: ``[H]``, a logit per head that joins
      each softmax's denominator and takes no value (gpt-oss).
    - ``out``: optional contiguous ``[T, H, hd]`` of the query's dtype, written and returned.

    Returns ``[T, H, hd]`` in the query's dtype (scores, softmax, sums in float32). Raises
    ``RuntimeError`` when the kernel is unavailable (:func:`available`); ``ValueError`` on other
    shapes, dtypes or devices, ``q_len > ctx``, a context longer than its table, or a block id
    the context reads outside ``[0, num_blocks)``.
    """
    if not available():
        raise RuntimeError(f"paged attention kernel unavailable: {unavailable_reason()}")
    _require(query.dim() == 3 and query.dtype in QUERY_DTYPES, "query", query)
    heads, hd, c, tables = query.shape[1], query.shape[2], cache, block_tables
    _require(c.dim() == 5 and c.shape[1] == 2 and c.shape[4] == hd, "cache shape", c)
    _require(c.dtype in CACHE_DTYPES and c.stride(4) == 1, "cache dtype or layout", c)
    _require(c.shape[3] > 0 and heads % c.shape[3] == 0, "query heads / kv heads", query)
    seqs = ctx_lens.shape[0] if ctx_lens.dim() == 1 else -1
    _require(tables.dim() == 2 and tables.shape[0] == seqs, "block_tables", tables)
    _require(query_start.shape == (seqs + 1,), "query_start", query_start)
    _require(sinks is None or sinks.shape == (heads,), "sinks", sinks)
    out = torch.empty_like(query, memory_format=torch.contiguous_format) if out is None else out
    _require(out.shape == query.shape and out.dtype == query.dtype, "out", out)
    _require(out.is_contiguous(), "out layout", out)
    _require((window or 1) > 0 and (softcap or 1) > 0, f"window {window}, softcap {softcap}", None)
    for t in (query, cache, block_tables, query_start, ctx_lens, sinks, out):
        _require(t is None or t.device.type == "cpu", "CPU tensors only", t)
    if query.shape[0]:
        torch.ops.pdserve_paged.varlen(
            out, query.contiguous(), cache, tables.to(torch.int64).contiguous(),
            query_start.to(torch.int64).contiguous(), ctx_lens.to(torch.int64).contiguous(),
            float(scale), int(window or 0), float(softcap or 0.0),
            None if sinks is None else sinks.to(torch.float32).contiguous(),
        )  # fmt: skip
    return out
