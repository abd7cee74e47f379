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
   ``recompile_limit`` (then dynamo itself runs that code eagerly).

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

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from pdserve.workers.engine.model.attention import (
    PagedAttentionMetadata,
    PrefillChunk,
    bind_metadata,
)

log = logging.getLogger(__name__)


@torch.library.custom_op(
    "pdserve::onednn_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor",
)
def _onednn_linear_op(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` with ``W`` prepacked by oneDNN -> ``[M, N]``."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return out


@_onednn_linear_op.register_fake
def _onednn_linear_fake(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


_MERGEABLE = frozenset(
    {
        torch.ops.pdserve.onednn_linear.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten.view.default,
        torch.ops.aten._unsafe_view.default,
    }
)
"""Pure calls :class:`MergeDuplicateLinears` merges when their arguments are equal."""


class OneDNNLinear(torch.nn.Module):
    """Drop-in for an inference ``nn.Linear`` with its weight prepacked by oneDNN.

    Input ``[..., in_features]``, output ``[..., out_features]``, in the weight's dtype. The
    packed weight is an opaque (``OpaqueTensorImpl``) CPU tensor held as a non-persistent buffer
    (not in ``state_dict``; it cannot move devices). No autograd.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out: torch.Tensor = torch.ops.pdserve.onednn_linear(
            flat, self.packed_weight, self.bias, self.out_features
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)
"""Sibling linears (children of one module) that read the same input in the decoder families
served: each group is prepacked as one weight (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``)."""


class _FusedGroup:
    """The concatenated, prepacked weight of a group of sibling linears, and (eager only) the
    last input it multiplied and the product, which the siblings after the first reuse."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.in_features = linears[0].in_features
        self.out_features = sum(m.out_features for m in linears)
        weight = torch.cat([m.weight.detach() for m in linears])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None


class FusedLinearSlice(torch.nn.Module):
    """One linear of a :data:`FUSED_SIBLINGS` group: output columns ``[start, end)`` of the
    group's single GEMM (input ``[..., in_features]``, output ``[..., end - start]``, a strided
    view). Compiled, every sibling emits the same ``pdserve::onednn_linear`` call and
    :class:`MergeDuplicateLinears` keeps one; eager, a sibling called with the very tensor
    the previous one was called with reuses its product (the decoder layers call q, k and v on
    one hidden-state tensor, unmodified in between). No autograd; not thread-safe (the engine
    thread runs the steps).
    """

    def __init__(self, group: _FusedGroup, start: int, end: int):
        super().__init__()
        self.group = group
        self.in_features = group.in_features
        self.out_features = end - start
        self.start, self.end = start, end
        self.register_buffer("packed_weight", group.packed, persistent=False)
        self.register_buffer("bias", group.bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if torch.compiler.is_compiling():
            out: torch.Tensor = torch.ops.pdserve.onednn_linear(
                x.reshape(-1, self.in_features), self.packed_weight, self.bias, group.out_features
            )
        elif group.last is not None and group.last[0] is x:
            out = group.last[1]
        else:
            out = torch.ops.pdserve.onednn_linear(
                x.reshape(-1, self.in_features), self.packed_weight, self.bias, group.out_features
            )
            group.last = (x, out)
        return out[:, self.start : self.end].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, columns {self.start}:{self.end} of "
            f"{self.group.out_features}, onednn"
        )


def _hashable(value: object) -> object:
    """``value`` (an FX node's target, args or kwargs) with lists and dicts made tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


class MergeDuplicateLinears(CustomGraphPass):
    """Inductor post-grad pass: of ``pdserve::onednn_linear`` calls (and the views feeding them)
    with the same arguments (same input node, same packed weight), keep the first. This is what turns the
    :class:`FusedLinearSlice` siblings' calls into one GEMM; functorch's CSE does not run on
    inference graphs. Has a ``uuid`` so inductor's FX graph cache keeps working."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        first: dict[object, torch.fx.Node] = {}
        for node in list(graph.nodes):
            # each sibling reshapes the shared input itself: merge those views first
            if node.op != "call_function" or node.target not in _MERGEABLE:
                continue
            key = _hashable((node.target, node.args, node.kwargs))
            if key in first:
                node.replace_all_uses_with(first[key])
                graph.erase_node(node)
            else:
                first[key] = node

    def uuid(self) -> str:
        return "pdserve.merge-duplicate-linears.2"


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


def prepack_linears(model: torch.nn.Module, fuse: bool = True) -> int:
    """Replace every ``nn.Linear`` under ``model`` by a :class:`OneDNNLinear`, or, with ``fuse``,
    each group of :data:`FUSED_SIBLINGS` (same input width, all with or all without bias) by
    :class:`FusedLinearSlice` views of one prepacked GEMM (in place; the unpacked weights of
    replaced layers are released unless shared, e.g. a tied LM head keeps the embedding).
    Returns how many linears were replaced. Call once, after the model is on its CPU device
    and in eval mode."""
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
                fused = _FusedGroup(linears)
                start = 0
                for name, linear in zip(names, linears, strict=True):
                    setattr(
                        parent, name, FusedLinearSlice(fused, start, start + linear.out_features)
                    )
                    start += linear.out_features
                    replaced += 1
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, OneDNNLinear(child))
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

    Attributes: ``compile_s`` (seconds the warm-up took, None before it), ``prepacked``
    (linears replaced by :class:`OneDNNLinear`).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.prepacked = prepack_linears(model) if can_prepack(device, dtype) else 0
        # transformers returns a 4D mask as is: no packed-sequence check on position_ids
        self._mask4d = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        self._compiled: Callable[..., torch.Tensor] = torch.compile(
            self._forward,
            fullgraph=True,
            dynamic=False,
            options={"post_grad_custom_pre_pass": MergeDuplicateLinears()},
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
