"""The load-time probe: a model is served only if the paged path computes what transformers does.

Design origin: vLLM's Transformers backend checks at load that a model's attention goes through
its attention interface; this probe goes further and compares numbers, so that a family whose
layers the paged kernel does not reproduce (an unknown mask, a kwarg it does not read, K/V of
another shape than the configuration suggests) is refused at start-up, naming the family and
the mismatch, instead of failing or drifting on the first request. Two passes, on the loaded
model, before it is sharded or compiled:

1. :func:`capture_kv_shapes`: one forward over a few tokens in which the paged attention
   function only records what each layer passes it (no pool): every layer must reach it, and
   the K/V it receives fix the KV layout's heads and head size (not ``config.json``'s guesses).
   Keys and values of different sizes (latent or asymmetric KV) are refused by name.
2. :func:`check_against_reference`: the same prompt through the paged path in three steps
   (a whole-prompt chunk, a continued chunk that reads the first one back from the pool, one
   decode token) and through transformers' own ``eager`` attention in one forward; the logits
   of the last two steps must agree within a tolerance of the model dtype. The prompt (48
   tokens) is longer than a tiny test model's sliding window, so windows are exercised there;
   a real model's window (thousands of tokens) is exercised by the masks' code, not the probe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.errors import ConfigError
from pdserve.protocol import KVLayout, SamplingParams
from pdserve.workers.engine.model.attention import ATTENTION_NAME, record_calls
from pdserve.workers.engine.scheduler import ScheduledBatch, ScheduledSequence
from pdserve.workers.engine.sequence import Sequence
from pdserve.workers.kv.manager import KVCacheManager


class Runner(Protocol):
    """What the probe needs of :class:`~pdserve.workers.engine.model.model_runner.ModelRunner`."""

    model: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_position_embeddings: int

    def prepare_inputs(
        self, batch: ScheduledBatch, kv_cache: KVCacheManager
    ) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]: ...


log = logging.getLogger(__name__)

PROBE_TOKENS = 48
"""Prompt length of the probe (first chunk 32 tokens, continued chunk 15, one decode token)."""
TOLERANCE = {torch.float32: 2e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
"""Largest |paged - reference| logit difference allowed, relative to the largest |logit|."""


@dataclass(frozen=True)
class KVShape:
    """What every attention layer passes the paged kernel: ``num_layers`` layers of
    ``num_kv_heads`` K/V heads of ``head_dim``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def _family(model: Any) -> str:
    return f"{type(model).__name__} (model_type {model.config.model_type!r})"


def _tokens(vocab: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, max(1, min(vocab, 32000)), (n,), generator=gen)


@torch.inference_mode()
def capture_kv_shapes(model: Any, device: torch.device, num_layers: int) -> KVShape:
    """Pass 1 of the module docstring. Raises ConfigError naming the family when a layer never
    reaches the paged attention, or when the K/V shapes differ between layers or between keys
    and values."""
    ids = _tokens(model.config.get_text_config().vocab_size, 4).to(device)
    with record_calls(capture_only=True) as calls:
        model(
            input_ids=ids[None], position_ids=torch.arange(4, device=device)[None], use_cache=False
        )
    family = _family(model)
    reached = sorted({layer for layer, _, _ in calls})
    if reached != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(reached))
        raise ConfigError(
            f"{family}: layers {missing or reached} never reach the paged attention (their "
            "attention does not go through transformers' attention interface); not supported"
        )
    shapes = {(k[1], k[-1], v[1], v[-1]) for _, k, v in calls}
    if len(shapes) != 1:
        raise ConfigError(
            f"{family}: layers pass K/V of different shapes {sorted(shapes)}; "
            "the KV pool holds one shape for every layer"
        )
    ((kvh, k_dim, v_heads, v_dim),) = shapes
    if (v_heads, v_dim) != (kvh, k_dim):
        raise ConfigError(
            f"{family}: keys have {kvh} heads of {k_dim} but values {v_heads} of {v_dim} "
            "(latent or asymmetric KV, e.g. multi-head latent attention); not supported"
        )
    return KVShape(num_layers, kvh, k_dim)


@torch.inference_mode()
def check_against_reference(runner: Runner, shape: KVShape) -> float:
    """Pass 2 of the module docstring on ``runner`` (rank 0, before sharding and compiling).
    Returns the largest relative logit difference; raises ConfigError naming the family and
    the step when it exceeds :data:`TOLERANCE`."""
    model, device, dtype = runner.model, runner.device, runner.dtype
    n = min(PROBE_TOKENS, runner.max_position_embeddings)
    first, second = (n * 2) // 3, n - 1 - (n * 2) // 3  # whole chunk, continued chunk
    ids = _tokens(runner.vocab_size, n)
    layout = KVLayout(
        model="probe",
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tokens_per_block=4,
        dtype=str(dtype).removeprefix("torch."),
    )
    kv = KVCacheManager(layout, -(-n // 4), device)
    seq = Sequence("probe", ids.tolist(), SamplingParams(max_tokens=1), "prefill", 0)
    kv.allocate(seq.request_id, n)
    steps = [
        ScheduledBatch(prefill=[ScheduledSequence(seq, first, 0, True)]),
        ScheduledBatch(prefill=[ScheduledSequence(seq, second, first, True)]),
        ScheduledBatch(decode=[ScheduledSequence(seq, 1, n - 1, True)]),
    ]
    paged = []
    for batch in steps:
        inputs, positions, meta, keep = runner.prepare_inputs(batch, kv)
        out = model(
            input_ids=inputs[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
            paged_attention_metadata=meta,
        )
        paged.append(out.logits[0, -1].float())
    model.set_attn_implementation("eager")
    try:
        ref = model(input_ids=ids.to(device)[None], use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    tol = TOLERANCE.get(dtype, 6e-2)
    worst = 0.0
    for name, got, want in (
        (f"a continued prefill chunk (position {n - 2})", paged[1], ref[n - 2]),
        (f"a decode step (position {n - 1})", paged[2], ref[n - 1]),
    ):
        diff = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
        worst = max(worst, diff)
        if not diff <= tol:  # NaN fails too
            raise ConfigError(
                f"{_family(model)}: the paged attention disagrees with transformers' eager "
                f"attention on {name}: logits differ by {diff:.2e} of their scale (tolerance "
                f"{tol:.0e}); this family's attention is not supported"
            )
    log.info("load-time probe: paged attention matches transformers (max rel. diff %.1e)", worst)
    return worst
