"""A model with SmolLM2-135M's architecture and random weights, for GPU runs.

The GPU machine has no network and the converted SmolLM2 folder (about 520 MB of float32
weights) is too large to carry there, so GPU tests and benchmarks build this stand-in on the
spot: LlamaForCausalLM with SmolLM2-135M-Instruct's config (30 layers, hidden 576, 9 heads,
3 KV heads, head_dim 64, vocab 49152, tied embeddings) and the tiny byte-level tokenizer of
:func:`tests.support.models.build_tiny_model` (ids >= 260 decode to nothing); built by
:func:`pdserve.bench.engine.bench_models.build_smollm2_like`, which ``pdserve bench gpu`` uses too. Compute, KV layout
(720 KiB per 16-token float32 block) and step times are SmolLM2's; the text is not.

Also the GPU tests' helpers: :func:`hf_greedy_on` (transformers' greedy generate on the model's
device) and :func:`syncs_per_forward` (host synchronisations inside each forward).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from pdserve.bench.engine.bench_models import SMOLLM2_ARCH, build_smollm2_like
from pdserve.protocol import SamplingParams
from tests.support.engine import complete, make_engine

__all__ = ["SMOLLM2_ARCH", "build_smollm2_like", "hf_greedy_on", "syncs_per_forward"]


def hf_greedy_on(model, prompt: list[int], max_new_tokens: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy generate() on the model's own device."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def syncs_per_forward(model_dir: Path, **overrides: object) -> list[list[str]]:
    """Host synchronisations CUDA reports (``set_sync_debug_mode("warn")``) inside each
    ``ModelRunner.execute`` of one greedy request (a prefill step, then decode steps); the
    sampler's copy of the logits comes after ``execute`` and is not counted."""
    engine = make_engine(model_dir, device="cuda", **overrides)
    original = engine.runner.execute
    per_call: list[list[str]] = []

    def counted(batch, kv_cache):  # noqa: ANN001, ANN202 - runs on the engine thread
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return original(batch, kv_cache)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                per_call.append([str(w.message).splitlines()[0] for w in caught])

    engine.runner.execute = counted  # type: ignore[method-assign]
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        complete(engine, "sync-probe", list(range(10, 50)), sampling)
    finally:
        engine.shutdown()
    return per_call
