"""A model with SmolLM2-135M's architecture and random weights, for GPU runs.

The GPU machine has no network and the converted SmolLM2 folder (about 520 MB of float32
weights) is too large to carry there, so GPU tests and benchmarks build this stand-in on the
spot: LlamaForCausalLM with SmolLM2-135M-Instruct's config (30 layers, hidden 576, 9 heads,
3 KV heads, head_dim 64, vocab 49152, tied embeddings) and the tiny byte-level tokenizer of
:func:`tests.fixtures.models.build_tiny_model` (ids >= 260 decode to nothing). Compute, KV layout
(720 KiB per 16-token float32 block) and step times are SmolLM2's; the text is not.
"""

from __future__ import annotations

from pathlib import Path

SMOLLM2_ARCH = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
"""SmolLM2-135M-Instruct's config.json fields that shape compute and the KV layout."""


def build_smollm2_like(path: Path, *, seed: int = 0, init_std: float = 0.02) -> Path:
    """Write the stand-in model (float32, seed ``seed``, weights ~ N(0, ``init_std``)) and the
    tiny tokenizer into ``path``; return ``path``. Leaves the global torch RNG untouched."""
    from tests.fixtures.models import build_tiny_model

    return build_tiny_model(path, seed=seed, arch={**SMOLLM2_ARCH, "initializer_range": init_std})
