"""The load-time probe refuses what the paged attention would get wrong, naming the family.

In-process engines on tiny random models: a family with keys and values of different head sizes
(DeepSeek V3's multi-head latent attention) is refused by the shape pass; a paged kernel that
ignored a layer's sliding window is caught by the comparison with transformers' eager attention
(and only by it: with ``load_check`` off that engine starts and serves other tokens); a layer
type the kernel does not serve is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pdserve.bench.engine.bench_models import (
    BYTE_SPECIAL_TOKENS,
    build_random_model,
    byte_tokenizer,
)
from pdserve.errors import ConfigError
from pdserve.protocol import SamplingParams
from pdserve.workers.engine.model import attention
from tests.support.engine import complete, make_engine


def _deepseek_mla(path: Path) -> Path:
    """A tiny DeepSeek V3: K of 16 (8 no-RoPE + 8 RoPE dims) per head, V of 8."""
    hf: Any = transformers
    tok = byte_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in BYTE_SPECIAL_TOKENS}
    config = hf.DeepseekV3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, max_position_embeddings=512, bos_token_id=ids["<|bos|>"],
        eos_token_id=ids["<|eos|>"], pad_token_id=ids["<|pad|>"],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf.DeepseekV3ForCausalLM(config).float().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_latent_attention_is_refused_naming_both_shapes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"DeepseekV3ForCausalLM .*keys have 4 heads of 16 but "
                       r"values 4 of 8 \(latent or asymmetric KV"):  # fmt: skip
        make_engine(_deepseek_mla(tmp_path), compile=False)


def test_a_kernel_that_ignores_the_window_is_caught_by_the_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = build_random_model(tmp_path / "mistral", "mistral")  # 8-token window, every layer

    real = attention.Variant

    def windowless(
        window: int | None = None, softcap: float | None = None, sinks: Any = None
    ) -> attention.Variant:
        return real(None, softcap, sinks)  # every layer treated as full attention

    monkeypatch.setattr(attention, "Variant", windowless)
    with pytest.raises(ConfigError, match="MistralForCausalLM .*disagrees with transformers' "
                       "eager attention on a continued prefill chunk"):  # fmt: skip
        make_engine(model_dir, compile=False)
    # the shape pass alone cannot see it: without the comparison the engine starts
    engine = make_engine(model_dir, compile=False, load_check=False)
    try:
        # ignore_eos: a sampled end of text (the random model's ids include it) would end early
        sampling = SamplingParams(max_tokens=4, ignore_eos=True, seed=0)
        tokens = complete(engine, "r", list(range(40, 70)), sampling).token_ids
        assert len(tokens) == 4
    finally:
        engine.shutdown()


def test_an_unserved_layer_type_is_refused_by_name(tmp_path: Path) -> None:
    model_dir = build_random_model(tmp_path / "qwen2", "qwen2")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["layer_types"] = ["full_attention", "chunked_attention"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="has chunked_attention layers; the paged attention "
                       "serves full_attention and sliding_attention layers only"):  # fmt: skip
        make_engine(model_dir, compile=False)
