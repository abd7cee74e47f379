"""Paged attention over the KV block pool, plugged into transformers' attention interface.

This is the approach of vLLM's Transformers backend: the model class stays transformers' own;
only the attention *function* is swapped. :func:`register_paged_attention` registers
:func:`paged_attention_forward` under :data:`ATTENTION_NAME` in ``AttentionInterface`` and a mask
function that returns ``None`` under the same name in ``AttentionMaskInterface`` (so transformers
builds no dense ``[T, T]`` mask); a model loaded with ``attn_implementation=ATTENTION_NAME`` then
calls it from every attention layer.

A step's tokens are flattened (varlen) into batch 1 with explicit ``position_ids``, decode tokens
first::

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |      decode seqs feed 1 token each,
             '---num_decode--' '-prefill chunks-'       prefill seqs a chunk of their prompt

The per-step :class:`PagedAttentionMetadata` travels as the keyword argument
``paged_attention_metadata`` through the model's forward (transformers hands ``**kwargs`` down to
the attention function). Per layer the function

1. writes the step's K (after RoPE) and V into the pool at each token's slot
   (``block_table[pos // tpb]``, offset ``pos % tpb``), then
2. computes causal attention of each sequence's queries over its cached K/V: one batched SDPA for
   all decode tokens (block tables gathered, padded, masked), one SDPA per prefill chunk (on the
   fresh K/V when the chunk is the whole prompt, else on the gathered cache with a bottom-right
   aligned causal mask). GQA uses SDPA's ``enable_gqa``. Gathered K/V land in the step's
   ``workspace`` when the runner provides one (no fresh multi-MiB tensor per layer).
   On CPU, once :mod:`pdserve.workers.engine.model.paged_kernel` compiled, the decode rows and the
   continued chunks instead go to that kernel in one call per layer (:class:`KernelRows`),
   which reads each sequence's blocks where they are; the gather path above serves CUDA and
   CPUs where the kernel did not build.

The compiled forward (:mod:`pdserve.workers.engine.model.compile`) cannot pass the metadata through a traced
graph, so it binds it to the thread with :func:`bind_metadata` and calls the forward without the
kwarg; the attention function then calls the same computation as the opaque custom op
``torch.ops.pdserve.paged_attention`` (vLLM's ``unified_attention`` pattern), which inductor
leaves as an extern call between the compiled pieces of each layer.

Layer variants, read from the keyword arguments transformers' attention modules pass (the
eager reference of each family defines the semantics): ``sliding_window=W`` (Mistral, Qwen2,
Gemma 2/3's local layers, gpt-oss: a query at position ``p`` sees keys ``p - W < j <= p``),
``softcap=c`` (Gemma 2: scores become ``c * tanh(scores / c)`` before the softmax) and
``s_aux`` (gpt-oss's attention sinks: one learned logit per head joins each softmax's
denominator and takes no value). ``scaling`` carries the families' own scales (Gemma's
``query_pre_attn_scalar``, Granite's ``attention_multiplier``). Plain layers and windowed ones go
through SDPA (a window is a boolean mask); soft-capping and sinks through :func:`_attend_eager`,
the explicit ``softmax(q k^T)`` of transformers' eager attention.

Requirements on the model: attention modules carry ``layer_idx`` (the pool layer they use) and
pass ``**kwargs`` to the attention function, as transformers' decoder families do; the model
runner refuses layer types other than full and sliding-window attention.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.workers.engine.model.light_op import light_op

ATTENTION_NAME = "pdserve_paged"
METADATA_KWARG = "paged_attention_metadata"


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill sequence's chunk: query rows ``[q_start, q_start + q_len)`` of the step; the
    sequence holds ``ctx_len`` tokens after the step (``ctx_len == q_len`` for a whole prompt).
    ``block_ids``: its block table, ``[ceil(ctx_len / tpb)]`` long. ``mask``: ``[q_len, ctx_len]``
    bool (True = attend) for a continued chunk, None for a whole prompt (``is_causal``)."""

    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class KernelRows:
    """The step's rows that the in-place CPU kernel (:mod:`pdserve.workers.engine.model.paged_kernel`)
    computes: every decode row and every continued chunk (drafts included), ``S`` sequences in
    step order. ``block_tables`` ``[S, W]``, ``query_start`` ``[S + 1]`` (cu_seqlens over the
    kernel's rows), ``ctx_lens`` ``[S]``: int64, contiguous, on CPU. ``rows``: ``[R]`` int64,
    the step rows the kernel's rows are, in order; None when they are the first ``R`` rows."""

    block_tables: torch.Tensor
    query_start: torch.Tensor
    ctx_lens: torch.Tensor
    rows: torch.Tensor | None
    num_rows: int


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Everything the attention function needs for one step (built once, shared by all layers).

    - ``pool``: ``[num_layers, num_blocks, 2, tpb, kvh, hd]``, the KV cache manager's pool.
    - ``k_slots`` / ``v_slots``: ``[T]`` long, row of each token's K / V in the layer's pool
      viewed as ``[num_blocks * 2 * tpb, kvh, hd]`` (``block * 2 * tpb + {0, tpb} + offset``).
    - ``num_decode``: the first ``num_decode`` tokens are decode tokens, one per sequence.
    - ``decode_block_tables``: ``[num_decode, max_blocks]`` long, padded with block 0.
    - ``decode_mask``: ``[num_decode, 1, 1, max_blocks * tpb]`` bool (True = attend), or None when
      there is a single decode sequence (its gathered K/V is cut to ``decode_ctx_len`` instead).
    - ``prefill``: the prefill chunks, in token order after the decode tokens.
    - ``write_rows``: ``[T]`` long or None; when set, token ``i`` writes the K/V of token
      ``write_rows[i]`` (CUDA-graph padding: padded rows repeat row 0's slot and write row 0's
      K/V, so duplicate slots receive identical bytes).
    - ``workspace``: flat, pool dtype and device, or None; when set, the K/V gathered from the
      pool (decode rows, continued chunks) are copied into it instead of into fresh tensors, and
      it must hold :func:`workspace_numel` elements. On CPU a fresh multi-MiB tensor per layer
      is mapped and page-faulted anew by the allocator, which costs more than the copy itself
      (decode at batch 32 and 300 tokens of context: ~2.5x slower step without it).
    - ``kernel``: :class:`KernelRows`, or None; when set (CPU, the kernel compiled), decode rows
      and continued chunks are computed by the in-place kernel instead of gather + SDPA, and
      no workspace is needed.
    """

    pool: torch.Tensor
    k_slots: torch.Tensor
    v_slots: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None
    decode_ctx_len: int
    prefill: tuple[PrefillChunk, ...]
    write_rows: torch.Tensor | None = None
    workspace: torch.Tensor | None = None
    kernel: KernelRows | None = None


def workspace_numel(
    decode_blocks: int, chunk_blocks: int, tokens_per_block: int, kv_heads: int, head_dim: int
) -> int:
    """Elements :attr:`PagedAttentionMetadata.workspace` needs: K and V of the larger of the
    decode gather (``decode_blocks`` = rows x table width) and the largest continued chunk's
    table (``chunk_blocks``). One layer's gathers are consumed before the next one's, so one
    workspace serves every layer of the step::

        workspace: | K of n blocks | V of n blocks | (rest unused)
    """
    return 2 * max(decode_blocks, chunk_blocks) * tokens_per_block * kv_heads * head_dim


def _gather(
    cache: torch.Tensor, block_ids: torch.Tensor, kv: int, workspace: torch.Tensor | None
) -> torch.Tensor:
    """K (``kv=0``) or V (``kv=1``) of ``block_ids`` (``[nb]`` or ``[B, nb]``) from one layer's
    cache ``[num_blocks, 2, tpb, kvh, hd]`` -> ``[(B,) kvh, nb * tpb, hd]`` (head-major view for
    SDPA), copied into ``workspace`` (K in its first half, V after it) when given, else into a
    fresh tensor. ``index_select`` rather than advanced indexing: the latter is an order of
    magnitude slower on CPU for these small gathers when torch runs more than one thread."""
    tpb, kvh, hd = cache.shape[2:]
    ids = block_ids.reshape(-1)
    if workspace is None:
        blocks = bits(cache[:, kv]).index_select(0, ids).view(cache.dtype)  # a copy
    else:
        n = ids.numel() * tpb * kvh * hd
        blocks = workspace[kv * n : (kv + 1) * n].view(ids.numel(), tpb, kvh, hd)
        torch.index_select(bits(cache[:, kv]), 0, ids, out=bits(blocks))
    flat = blocks.view(*block_ids.shape[:-1], block_ids.shape[-1] * tpb, kvh, hd)
    return flat.transpose(-3, -2)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for an FP8 tensor its bytes as ``uint8`` (same shape and strides):
    torch's CPU index kernels (``index_copy_``, ``index_select``) have no FP8 variant, and
    moving FP8 values is moving their bytes."""
    return t.view(torch.uint8) if t.dtype in FP8 else t


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to the cache ``dtype``; FP8 saturates at the format's largest value (a plain
    cast would turn an out-of-range value into NaN) and is stored unscaled (scale 1.0, vLLM's
    default without calibrated scales)."""
    if dtype in FP8:
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def store_kv(flat_cache: torch.Tensor, slots: torch.Tensor, tok: torch.Tensor) -> None:
    """Write ``tok`` (``[T, kvh, hd]``, any float dtype) into rows ``slots`` (``[T]`` long) of
    one layer's pool viewed as ``[rows, kvh, hd]``, cast to the pool's dtype (:func:`to_cache`)."""
    bits(flat_cache).index_copy_(0, slots, bits(to_cache(tok, flat_cache.dtype)))


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' signature.

    ``query`` ``[1, H, T, hd]``, ``key``/``value`` ``[1, kvh, T, hd]`` (batch 1, ``T`` flattened
    step tokens, keys after RoPE). Returns ``([1, T, H, hd], None)``. ``attention_mask`` is
    ignored (the mask function returns None). ``kwargs`` may carry the layer variants of the
    module docstring (``sliding_window``, ``softcap``, ``s_aux``). The metadata comes from
    ``kwargs["paged_attention_metadata"]`` (eager forwards, CUDA graphs) or, when that kwarg is
    absent, from :func:`bind_metadata` through the opaque op ``torch.ops.pdserve.paged_attention``
    (the compiled forward of :mod:`pdserve.workers.engine.model.compile`). Raises ``KeyError`` when a forward
    runs with neither.
    """
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    variant = Variant(
        int(window) if isinstance(window, int) and window > 0 else None,
        float(softcap) if isinstance(softcap, int | float) and softcap else None,
        sinks if isinstance(sinks, torch.Tensor) else None,
    )
    layer_idx: int = module.layer_idx  # type: ignore[assignment]  # set by transformers
    probe = None if torch.compiler.is_compiling() else _PROBE.get()  # dynamo cannot trace it
    if probe is not None:
        probe.calls.append((layer_idx, tuple(key.shape), tuple(value.shape)))
        if probe.capture_only:  # the probe's first pass: shapes only, no pool
            return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[3]), None
    meta = kwargs.get(METADATA_KWARG)
    if meta is None:  # compiled forward: one opaque op per layer, metadata bound to the step
        layer = torch.ops.pdserve.paged_attention(
            query, key, value, layer_idx, scaling, variant.window, variant.softcap, variant.sinks
        )
        return layer, None
    assert isinstance(meta, PagedAttentionMetadata)
    return paged_attention(meta, layer_idx, query, key, value, scaling, variant), None


@dataclass(frozen=True)
class Variant:
    """A layer's attention variant (module docstring): ``window`` in tokens, ``softcap``,
    ``sinks`` ``[H]`` (one logit per query head); all None for plain causal attention."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def eager(self) -> bool:
        """Needs the explicit softmax (SDPA has no soft-capping and no sinks)."""
        return self.softcap is not None or self.sinks is not None


PLAIN = Variant()


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    variant: Variant,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, Q, hd]`` over ``k``/``v`` ``[B, kvh, K, hd]`` (any dtype, cast
    to q's), ``mask`` broadcastable to ``[B, H, Q, K]`` (True = attend; None: all, or plain
    causal when ``causal``). SDPA unless the variant needs :func:`_attend_eager`."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    if not variant.eager:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=scaling,
            enable_gqa=True,
        )
    if causal and mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return _attend_eager(q, k, v, mask, scaling, variant)


def _attend_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    variant: Variant,
) -> torch.Tensor:
    """transformers' eager attention with soft-capping and sinks (Gemma 2's and gpt-oss's
    ``eager_attention_forward``): scores in the query dtype, softmax in float32."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if variant.sinks is not None:
        sink = variant.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        probs = scores.float().softmax(dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = scores.float().softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def _window_mask(
    q_len: int, ctx_len: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """``[q_len, ctx_len]`` bool: the last ``q_len`` positions of a ``ctx_len`` context
    attending causally (bottom-right aligned), within ``window`` tokens when given."""
    mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=device).tril(ctx_len - q_len)
    if window is not None:
        mask = mask.triu(ctx_len - q_len - window + 1)
    return mask


def paged_attention(
    meta: PagedAttentionMetadata,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    """The paged attention of one layer (steps 1 and 2 of the module docstring, with the
    layer's ``variant``): writes the step's K/V into ``meta.pool[layer_idx]`` and returns
    ``[1, T, H, hd]`` (a view). Raises ValueError when the attention receives K/V of another
    shape than the pool holds (a layout the engine cannot serve)."""
    cache = meta.pool[layer_idx]  # [num_blocks, 2, tpb, kvh, hd]
    if (
        key.shape[1] != cache.shape[-2]
        or key.shape[-1] != cache.shape[-1]
        or (value.shape[1:2] + value.shape[-1:] != key.shape[1:2] + key.shape[-1:])
    ):
        raise ValueError(
            f"layer {layer_idx}: attention receives K {tuple(key.shape)} and V "
            f"{tuple(value.shape)} ([1, kv_heads, tokens, head_size]) but the KV pool holds "
            f"{cache.shape[-2]} heads of {cache.shape[-1]}"
        )
    kr = meta.kernel
    if (
        kr is not None
        and kr.rows is None
        and kr.num_rows == query.shape[2]
        and meta.write_rows is None
        and key.dtype == value.dtype == cache.dtype
    ):  # every row is the kernel's: one C++ call stores the K/V and attends
        out: torch.Tensor = torch.ops.pdserve_paged.store_attend(
            query, key, value, cache, meta.k_slots, meta.v_slots, kr.block_tables,
            kr.query_start, kr.ctx_lens, query.shape[-1] ** -0.5 if scaling is None else scaling,
            variant.window or 0, variant.softcap or 0.0,
            None if variant.sinks is None else variant.sinks.to(torch.float32).contiguous(),
        )  # fmt: skip
        return out
    flat_cache = cache.view(-1, cache.shape[-2], cache.shape[-1])
    k_tok = key[0].transpose(0, 1)  # [T, kvh, hd]
    v_tok = value[0].transpose(0, 1)
    if meta.write_rows is not None:
        k_tok = k_tok.index_select(0, meta.write_rows)
        v_tok = v_tok.index_select(0, meta.write_rows)
    store_kv(flat_cache, meta.k_slots, k_tok)
    store_kv(flat_cache, meta.v_slots, v_tok)

    num_tokens, num_heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    window = variant.window
    parts: list[torch.Tensor] = []
    nd = meta.num_decode
    in_place = _in_place(meta.kernel, cache, query, scaling, variant) if meta.kernel else None
    if in_place is not None:
        if nd:
            parts.append(in_place[:nd])
    elif nd:
        assert meta.decode_block_tables is not None
        q = query[0, :, :nd].transpose(0, 1).unsqueeze(2)  # [nd, H, 1, hd]
        k = _gather(cache, meta.decode_block_tables, 0, meta.workspace)  # [nd, kvh, L, hd]
        v = _gather(cache, meta.decode_block_tables, 1, meta.workspace)
        mask = meta.decode_mask
        if mask is None:  # one sequence: cut to its context (and to its window)
            lo = 0 if window is None else max(0, meta.decode_ctx_len - window)
            k, v = k[:, :, lo : meta.decode_ctx_len], v[:, :, lo : meta.decode_ctx_len]
        elif window is not None:  # keys j >= ctx - window, ctx = the row's context length
            ctx = mask.sum(dim=-1, keepdim=True)
            keys = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (keys >= ctx - window)
        out = _attend(q, k, v, mask, scaling, variant)
        parts.append(out.reshape(nd, num_heads, head_dim))
    done = nd  # kernel rows consumed
    for chunk in meta.prefill:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        q = query[:, :, rows]  # [1, H, q_len, hd]
        if in_place is not None and chunk.mask is not None:  # continued: the kernel's rows
            parts.append(in_place[done : done + chunk.q_len])
            done += chunk.q_len
            continue
        if chunk.mask is None:  # whole prompt: attend to the fresh K/V, plain causal
            k, v = key[:, :, rows], value[:, :, rows]
            mask = None
            if window is not None and window < chunk.q_len:
                mask = _window_mask(chunk.q_len, chunk.q_len, window, q.device)
            out = _attend(q, k, v, mask, scaling, variant, causal=True)
        else:  # continued chunk: earlier chunks' K/V come from the cache
            # (the workspace is free again: the decode rows' attention is computed)
            k = _gather(cache, chunk.block_ids, 0, meta.workspace)[:, : chunk.ctx_len]
            v = _gather(cache, chunk.block_ids, 1, meta.workspace)[:, : chunk.ctx_len]
            mask = chunk.mask
            if window is not None:
                mask = _window_mask(chunk.q_len, chunk.ctx_len, window, q.device)
            out = _attend(q, k.unsqueeze(0), v.unsqueeze(0), mask, scaling, variant)
        parts.append(out[0].transpose(0, 1))  # [q_len, H, hd]
    attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    assert attn.shape[0] == num_tokens
    return attn.unsqueeze(0)


def _in_place(
    kr: KernelRows,
    cache: torch.Tensor,
    query: torch.Tensor,
    scaling: float | None,
    variant: Variant,
) -> torch.Tensor:
    """The kernel's rows of one layer, ``[R, H, hd]`` in the query's dtype: attention over
    ``cache`` read through the block tables (no gather). ``query``: ``[1, H, T, hd]``."""
    q = query[0].transpose(0, 1)  # [T, H, hd], a view
    q = q.index_select(0, kr.rows) if kr.rows is not None else q[: kr.num_rows].contiguous()
    out = torch.empty_like(q)
    sinks = variant.sinks
    torch.ops.pdserve_paged.varlen(
        out,
        q,
        cache,
        kr.block_tables,
        kr.query_start,
        kr.ctx_lens,
        scaling if scaling is not None else q.shape[-1] ** -0.5,
        variant.window or 0,
        variant.softcap or 0.0,
        None if sinks is None else sinks.to(torch.float32).contiguous(),
    )
    return out


# The metadata of the step running on this thread, for the compiled forward: a traced graph takes
# tensors, not the step's Python structure (chunk lists, block tables of varying width), so the
# attention op reads it from here, as vLLM's attention op reads its forward context.
_BOUND_METADATA: ContextVar[PagedAttentionMetadata | None] = ContextVar(
    "pdserve_paged_attention_metadata", default=None
)
Call = tuple[int, tuple[int, ...], tuple[int, ...]]
"""One recorded attention call: ``(layer_idx, K shape, V shape)``."""


@dataclass
class _Recording:
    calls: list[Call]
    capture_only: bool


_PROBE: ContextVar[_Recording | None] = ContextVar("pdserve_paged_attention_probe", default=None)


@contextmanager
def record_calls(*, capture_only: bool = False) -> Iterator[list[Call]]:
    """Record every call of the paged attention function in this context (this thread):
    ``(layer_idx, K shape, V shape)`` per call, for the engine's load-time probe (which layers
    reach the paged kernel, and the K/V heads and sizes they really pass). ``capture_only``:
    the attention returns zeros without touching any pool (the forward needs no metadata)."""
    recording = _Recording([], capture_only)
    token = _PROBE.set(recording)
    try:
        yield recording.calls
    finally:
        _PROBE.reset(token)


@contextmanager
def bind_metadata(meta: PagedAttentionMetadata) -> Iterator[None]:
    """Make ``meta`` the metadata of ``torch.ops.pdserve.paged_attention`` calls made in this
    context (this thread or task) until the block exits; nests and restores."""
    token = _BOUND_METADATA.set(meta)
    try:
        yield
    finally:
        _BOUND_METADATA.reset(token)


def _paged_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))


@light_op(
    "paged_attention",
    "(Tensor query, Tensor key, Tensor value, int layer_idx, float? scaling, int? window, "
    "float? softcap, Tensor? sinks) -> Tensor",
    _paged_attention_fake,
)
def _paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`paged_attention` as one opaque op for ``torch.compile`` (after vLLM's
    ``unified_attention`` op; a :func:`light_op`): the compiled graph keeps it as an extern
    call, so the Python loops over chunks and the data-dependent metadata stay out of it. It
    writes the bound pool in place (a side effect the schema does not name: the op's result is
    always used, so it is never dropped or reordered past its consumers). Returns a contiguous
    ``[1, T, H, hd]``. Raises ``KeyError`` outside :func:`bind_metadata`."""
    meta = _BOUND_METADATA.get()
    if meta is None:
        raise KeyError(f"{METADATA_KWARG}: no metadata bound to this forward")
    variant = Variant(window, softcap, sinks)
    return paged_attention(meta, layer_idx, query, key, value, scaling, variant).contiguous()


def _no_mask(*args: object, **kwargs: object) -> None:
    """Mask function for :data:`ATTENTION_NAME`: the paged kernel builds its own masks."""
    return None


def register_paged_attention() -> str:
    """Register the attention and mask functions with transformers (idempotent) and return the
    name to pass as ``attn_implementation``. Registration is process-global in transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME


def bottom_right_causal_mask(q_len: int, ctx_len: int) -> torch.Tensor:
    """``[q_len, ctx_len]`` bool: query ``i`` (absolute position ``ctx_len - q_len + i``) attends
    to keys ``0 ..= ctx_len - q_len + i``."""
    return torch.ones(q_len, ctx_len, dtype=torch.bool).tril(diagonal=ctx_len - q_len)
