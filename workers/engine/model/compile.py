"""The compiled CPU forward: oneDNN-prepacked linears + ``torch.compile`` (inductor), paid at
start-up (after vLLM's CPU backend and its torch.compile integration).

Where eager time goes on a CPU (SmolLM2-135M float32, measured with torch.profiler): 75-85 % of
a step is ``aten::mm``, and torch's CPU build sends float32 GEMMs to MKL, which runs an AVX2 path
on AMD CPUs (about 110 GFLOP/s on one core here) where oneDNN runs AVX-512 (about 250). The rest
is transformers' Python and small elementwise kernels (RMSNorm, RoPE, SiLU, residuals) and the
paged attention. So the compiled forward does two things, as vLLM's CPU backend does (measured
with ``pdserve bench compile``: prepacking alone takes prefill and decode to 0.55-0.7x of the
eager time; compiling on top of it takes decode a further 7-14 % and prefill 0-3 %):

1. **Prepacking** (:func:`prepack_linears`): every ``nn.Linear`` becomes a :class:`OneDNNLinear`
   holding its weight reordered once into oneDNN's blocked layout
   (``torch.ops.mkldnn._reorder_linear_weight``) and calling ``mkldnn._linear_pointwise``
   through the opaque op ``pdserve::onednn_linear`` (vLLM: ``onednn_mm``). Inductor's own
   ``freezing`` does the same but only for graph constants, costs about 80 s of compile per
   graph on two cores, and picks MKL again for a static batch size (decode batch 1).
2. **Compiling** (:class:`CompiledForward`): the whole model forward goes through
   ``torch.compile(fullgraph=True)``; inductor fuses the elementwise work between GEMMs and the
   step runs as one graph call instead of ~600 Python-dispatched ops. The paged attention stays
   out of the graph as the opaque op ``pdserve::paged_attention`` (its per-step metadata is
   bound with :func:`pdserve.workers.engine.model.attention.bind_metadata`, vLLM's forward context). The
   token count ``T`` and the number of sampled rows ``S`` are *unbacked* dynamic sizes
   (``mark_unbacked``): one graph serves every step shape (1..max_num_seqs decode rows, prefill
   chunks, mixed steps, ``S = 0`` for a chunk that does not sample), so nothing recompiles
   after the start-up warm-up. A recompile forced by something else is bounded by dynamo's
   ``recompile_limit`` (then dynamo itself runs that code eagerly). The graph runs with
   inductor's C++ wrapper (``cpp_wrapper``): the ~200 allocations and kernel calls between the
   GEMMs are made from compiled C++ instead of a generated Python function, and the opaque ops
   are :func:`~pdserve.workers.engine.model.light_op.light_op` s. Measured (SmolLM2 bfloat16,
   decode batch 8, one thread, Intel Xeon with AMX): the Python wrapper cost 3.2 ms of a 29.9 ms
   step, the C++ one makes the step 25.0 ms; the first compile of SmolLM2 takes 66 s instead of
   40 s on two cores (later starts load inductor's cache in ~8 s either way).

Start-up: :meth:`CompiledForward.warm_up` runs one forward on a scratch pool, which compiles
the graph, and logs how long it took (tens of seconds on two cores the first time; inductor's
on-disk FX graph and AOT caches, on by default, make a later start with the same model and torch
take a few seconds). A warm-up or step that raises switches the runner to the eager forward for
good (logged; the linears stay prepacked, so it keeps most of the gain, e.g. where no C++
compiler is installed); transformers' plain eager forward stays available with
``EngineConfig.compile = False``.

CPU only: on CUDA the runner keeps the eager forward (and its CUDA graphs). Not thread-safe: the
engine thread runs the steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from pdserve.workers.engine.model.attention import (
    PagedAttentionMetadata,
    PrefillChunk,
    bind_metadata,
)
from pdserve.workers.engine.model.light_op import light_op

log = logging.getLogger(__name__)


def _onednn_linear_fake(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


@light_op(
    "onednn_linear",
    "(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor",
    _onednn_linear_fake,
)
def _onednn_linear_op(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` with ``W`` prepacked by oneDNN -> ``[M, N]``."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return out


def _onednn_qlinear_fake(
    qx: torch.Tensor,
    x_scale: torch.Tensor,
    packed_weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return qx.new_empty((qx.shape[0], out_features), dtype=out_dtype)


@light_op(
    "onednn_qlinear",
    "(Tensor qx, Tensor x_scale, Tensor packed_weight, Tensor w_scale, Tensor w_zero, "
    "Tensor? bias, int out_features, ScalarType out_dtype) -> Tensor",
    _onednn_qlinear_fake,
)
def _onednn_qlinear_op(
    qx: torch.Tensor,
    x_scale: torch.Tensor,
    packed_weight: torch.Tensor,
    w_scale: torch.Tensor,
    w_zero: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(qx * x_scale) @ (Wq * w_scale).T + bias`` -> ``[M, N]`` in ``out_dtype``: ``qx``
    ``[M, K]`` int8 with one float32 scale (0-dim), ``Wq`` int8 prepacked by oneDNN with a
    float32 scale per output channel; the int8 GEMM runs on VNNI / AMX-INT8."""
    zero = torch.zeros((), dtype=torch.int32)
    out: torch.Tensor = torch.ops.onednn.qlinear_pointwise.tensor(
        qx, x_scale, zero, packed_weight, w_scale, w_zero, bias, 1.0, 0, out_dtype, "none", [], ""
    )
    return out


_INT8_MAX = 127.0
_TINY_SCALE = 1e-10  # an all-zero input still gets a finite scale
_ONE = torch.ones((), dtype=torch.float32)


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of ``weight`` ``[N, K]`` with one float32 scale per row (output channel):
    ``(q [N, K] int8, scale [N] float32)``."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(_TINY_SCALE) / _INT8_MAX
    q = (w / scale.unsqueeze(1)).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


class _Packed:
    """A weight ``[N, K]`` (and optional bias ``[N]``) prepacked for oneDNN, in the model's float
    dtype or, with ``int8``, as W8A8 (symmetric int8 per output channel; activations quantized
    per step, see :func:`_gemm`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, int8: bool):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.scale: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        if int8:
            q, self.scale = _quantize_rows(weight)
            self.packed = torch.ops.onednn.qlinear_prepack(q, None)
            self.zero = torch.zeros(self.out_features, dtype=torch.int64)
            self.bias = None if bias is None else bias.float()
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def register(self, module: torch.nn.Module) -> None:
        """Hold the packed tensors as ``module``'s non-persistent buffers (graph inputs when
        compiled; not in ``state_dict``)."""
        module.register_buffer("packed_weight", self.packed, persistent=False)
        module.register_buffer("bias", self.bias, persistent=False)
        module.register_buffer("weight_scale", self.scale, persistent=False)
        module.register_buffer("weight_zero", self.zero, persistent=False)


def _gemm(module: torch.nn.Module, flat: torch.Tensor, out_features: int) -> torch.Tensor:
    """``flat`` ``[M, K]`` times the weight :meth:`_Packed.register` gave ``module`` ->
    ``[M, out_features]`` in ``flat``'s dtype. W8A8: each row of ``flat`` is quantized to int8
    with its own dynamic scale (its absolute maximum / 127), as torchao's and vLLM's dynamic
    per-token int8 activations; compiled, inductor fuses the quantization into one loop and
    the rescaling into the next op."""
    w_scale = cast("torch.Tensor | None", module.weight_scale)
    bias = cast("torch.Tensor | None", module.bias)
    if w_scale is None:
        out: torch.Tensor = torch.ops.pdserve.onednn_linear(
            flat, module.packed_weight, bias, out_features
        )
        return out
    # one scale per row (token); oneDNN's int8 linear takes one per tensor, so it gets 1 and
    # the rows are scaled after the GEMM (exact: the scale factors out of each row's sums)
    x_scale = flat.abs().amax(dim=1, keepdim=True).float().clamp_min(_TINY_SCALE) / _INT8_MAX
    qx = (flat.float() / x_scale).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    out = torch.ops.pdserve.onednn_qlinear(
        qx,
        _ONE,
        module.packed_weight,
        w_scale,
        module.weight_zero,
        None,
        out_features,
        torch.float32,
    )
    out = out * x_scale
    if bias is not None:
        out = out + bias
    return out.to(flat.dtype)


class OneDNNLinear(torch.nn.Module):
    """Drop-in for an inference ``nn.Linear`` with its weight prepacked by oneDNN (float, or
    W8A8 int8 with ``int8``).

    Input ``[..., in_features]``, output ``[..., out_features]``, in the input's dtype. The
    packed weight is an opaque (``OpaqueTensorImpl``) CPU tensor held as a non-persistent buffer
    (not in ``state_dict``; it cannot move devices). No autograd.
    """

    def __init__(self, linear: torch.nn.Linear, int8: bool = False):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        bias = None if linear.bias is None else linear.bias.detach()
        _Packed(linear.weight.detach(), bias, int8).register(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _gemm(self, x.reshape(-1, self.in_features), self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "onednn" if self.weight_scale is None else "onednn w8a8"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)
"""Sibling linears (children of one module) that read the same input in the decoder families
served: each group is prepacked as one weight (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``)."""


class _FusedGroup:
    """The concatenated, prepacked weight of a group of sibling linears, and (eager only) the
    input it last multiplied and the product, which the siblings after the first reuse until
    the last sibling (the group's last columns) drops them."""

    def __init__(self, linears: list[torch.nn.Linear], int8: bool):
        self.in_features = linears[0].in_features
        self.out_features = sum(m.out_features for m in linears)
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.packed = _Packed(weight, bias, int8)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None


class FusedLinearSlice(torch.nn.Module):
    """One linear of a :data:`FUSED_SIBLINGS` group: output columns ``[start, end)`` of the
    group's single GEMM (input ``[..., in_features]``, output ``[..., end - start]``, a strided
    view). Compiled, every sibling emits the same calls and :class:`MergeDuplicateLinears`
    keeps one of each; eager, a sibling called with the very tensor the previous one was
    called with reuses its product (the decoder layers call q, k and v on one hidden-state
    tensor, unmodified in between). No autograd; not thread-safe (the engine thread runs the
    steps).
    """

    def __init__(self, group: _FusedGroup, start: int, end: int):
        super().__init__()
        self.group = group
        self.in_features = group.in_features
        self.out_features = end - start
        self.start, self.end = start, end
        group.packed.register(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if torch.compiler.is_compiling():
            out = _gemm(self, x.reshape(-1, self.in_features), group.out_features)
        elif group.last is not None and group.last[0] is x:
            out = group.last[1]
        else:
            out = _gemm(self, x.reshape(-1, self.in_features), group.out_features)
            group.last = (x, out)
        if self.end == group.out_features:  # the last sibling: hold no activation past it
            group.last = None
        return out[:, self.start : self.end].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "onednn" if self.weight_scale is None else "onednn w8a8"
        return (
            f"in_features={self.in_features}, columns {self.start}:{self.end} of "
            f"{self.group.out_features}, {kind}"
        )


def _hashable(value: object) -> object:
    """``value`` (an FX node's target, args or kwargs) with lists and dicts made tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


_OURS = (torch.ops.pdserve.onednn_linear.default, torch.ops.pdserve.onednn_qlinear.default)
_UNINITIALISED = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
)
"""Allocations whose twins must stay apart (each is written separately), as functorch's CSE."""
_IMPURE_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)


def _mergeable(node: torch.fx.Node) -> bool:
    """A call whose twin (same target, same arguments) computes the same tensor: our GEMMs, and
    ATen's (and its prims') functional, deterministic ops returning a tensor."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target in _OURS:
        return True
    return (
        target.namespace in ("aten", "prims")
        and target.overloadpacket.__name__ not in _UNINITIALISED
        and not target._schema.is_mutable
        and not any(tag in target.tags for tag in _IMPURE_TAGS)
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


class MergeDuplicateLinears(CustomGraphPass):
    """Inductor post-grad pass: of calls with the same target and arguments (:func:`_mergeable`:
    the GEMMs, and the views and int8 quantization feeding them), keep the first. This turns
    the :class:`FusedLinearSlice` siblings' calls into one GEMM (and one activation
    quantization); functorch's CSE does not run on inference graphs. Has a ``uuid`` so
    inductor's FX graph cache keeps working."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        first: dict[object, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if not _mergeable(node):
                continue
            key = _hashable((node.target, node.args, node.kwargs))
            if key in first:
                node.replace_all_uses_with(first[key])
                graph.erase_node(node)
            else:
                first[key] = node

    def uuid(self) -> str:
        return "pdserve.merge-duplicate-linears.5"


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`prepack_linears` applies: a CPU model, oneDNN available, and a dtype its
    CPU kernels support here (float32 always, bfloat16 / float16 where the CPU has them)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def prepack_linears(model: torch.nn.Module, fuse: bool = True, int8: bool = False) -> int:
    """Replace every ``nn.Linear`` under ``model`` by a :class:`OneDNNLinear`, or, with ``fuse``,
    each group of :data:`FUSED_SIBLINGS` (same input width, all with or all without bias) by
    :class:`FusedLinearSlice` views of one prepacked GEMM (in place; the unpacked weights of
    replaced layers are released unless shared, e.g. a tied LM head keeps the embedding).
    ``int8``: W8A8 for every linear but the LM head (``model.get_output_embeddings()``),
    which stays in the model dtype. Returns how many linears were replaced. Call once, after
    the model is on its CPU device and in eval mode."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    replaced = 0
    for parent in list(model.modules()):
        children = dict(parent.named_children())
        if fuse:
            for names in FUSED_SIBLINGS:
                group = [children.get(name) for name in names]
                linears = [m for m in group if type(m) is torch.nn.Linear]
                if len(linears) < len(names):
                    continue
                if len({m.in_features for m in linears}) > 1:
                    continue
                if len({m.bias is None for m in linears}) > 1:
                    continue
                fused = _FusedGroup(linears, int8)
                start = 0
                for name, linear in zip(names, linears, strict=True):
                    setattr(
                        parent, name, FusedLinearSlice(fused, start, start + linear.out_features)
                    )
                    start += linear.out_features
                    replaced += 1
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, OneDNNLinear(child, int8=int8 and child is not head))
                replaced += 1
    return replaced


class CompiledForward:
    """The model forward of one step, compiled once for every step shape.

    ``model``: a transformers causal LM loaded with the paged attention (on a CPU device, eval
    mode); prepacked here when :func:`can_prepack` holds. Call with ``ids`` ``[T]`` long,
    ``positions`` ``[T]`` long, ``keep`` ``[S]`` long (rows whose logits are returned) and the
    step's :class:`PagedAttentionMetadata`; returns logits ``[S, vocab]`` in the model dtype and
    writes the step's K/V into ``meta.pool``, exactly like the eager forward. Run under
    ``torch.inference_mode()`` with inference tensors, as :meth:`ModelRunner.execute` makes
    them (the warm-up compiles that way; other grad modes or tensor kinds fail dynamo's guards
    and recompile once each). Raises what the forward or a compile raises.

    The dynamo cache belongs to the code of :meth:`_forward`, shared by every instance: a second
    runner of the same architecture and shapes in the process reuses the graph (parameters are
    graph inputs), another model adds one entry.

    ``int8``: the linears are prepacked as W8A8 (:func:`prepack_linears`).

    Attributes: ``compile_s`` (seconds the warm-up took, None before it), ``prepacked``
    (linears replaced by :class:`OneDNNLinear` or :class:`FusedLinearSlice`).
    """

    def __init__(
        self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, int8: bool = False
    ):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.prepacked = prepack_linears(model, int8=int8) if can_prepack(device, dtype) else 0
        # transformers returns a 4D mask as is: no packed-sequence check on position_ids
        self._mask4d = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        self._compiled: Callable[..., torch.Tensor] = torch.compile(
            self._forward,
            fullgraph=True,
            dynamic=False,
            options={"post_grad_custom_pre_pass": MergeDuplicateLinears(), "cpp_wrapper": True},
        )
        self.compile_s: float | None = None

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            attention_mask=self._mask4d,
            use_cache=False,
            logits_to_keep=keep,
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        # T and S may be any size, 0 and 1 included: no specialisation, no recompile
        for t in (ids, positions, keep):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        with bind_metadata(meta):
            return self._compiled(ids, positions, keep)

    def warm_up(self, num_layers: int, num_kv_heads: int, head_dim: int) -> float:
        """Compile now: one forward of a 2-token prompt on a scratch pool of one block per
        layer. Returns and logs the seconds it took. Raises what the compile raises."""
        start = time.perf_counter()
        # inputs made as the runner makes them (inference tensors): the guards compare them
        with torch.inference_mode():
            tpb, dev = 2, self.device
            pool = torch.zeros(
                (num_layers, 1, 2, tpb, num_kv_heads, head_dim), dtype=self.dtype, device=dev
            )
            slots = torch.arange(tpb, device=dev)
            meta = PagedAttentionMetadata(
                pool=pool,
                k_slots=slots,
                v_slots=slots + tpb,
                num_decode=0,
                decode_block_tables=None,
                decode_mask=None,
                decode_ctx_len=0,
                prefill=(PrefillChunk(0, tpb, tpb, torch.zeros(1, dtype=torch.long), None),),
            )
            ids = torch.zeros(tpb, dtype=torch.long, device=dev)
            keep = torch.tensor([tpb - 1], dtype=torch.long, device=dev)
            self(ids, slots.clone(), keep, meta)
        self.compile_s = time.perf_counter() - start
        log.info(
            "compiled the model forward in %.1f s (%d linears prepacked for oneDNN)",
            self.compile_s,
            self.prepacked,
        )
        return self.compile_s
