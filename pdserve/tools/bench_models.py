"""Stand-in models with random weights for the engine benchmarks (``pdserve bench gpu``), where
the converted SmolLM2 folder (about 520 MB of float32 weights) cannot be carried and no model
hub can be reached.

- :func:`build_random_llama`: a ``LlamaForCausalLM`` with random weights (default: tiny, 2 layers,
  hidden 64) and the byte-level tokenizer of :func:`byte_tokenizer`, written as a Hugging Face
  model folder any pdserve engine loads.
- :func:`build_smollm2_like`: the same with SmolLM2-135M-Instruct's architecture
  (:data:`SMOLLM2_ARCH`: 30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64, vocab 49152,
  tied embeddings). Compute, KV layout (720 KiB per 16-token float32 block) and step times are
  SmolLM2's; the text is not (ids >= 260 decode to nothing).

Importing this module is light; torch, tokenizers and transformers load when a model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|turn|>")
BYTE_CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for m in messages %}{{ '<|turn|>' + m['role'] + '\\n' + m['content'] "
    "+ '<|eos|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|turn|>assistant\\n' }}"
    "{% endif %}"
)
TINY_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "initializer_range": 0.25,
    "tie_word_embeddings": True,
}
"""The tiny model's ``LlamaConfig`` fields (a wide init: greedy decoding rarely meets ties)."""
SMOLLM2_ARCH: dict[str, Any] = {
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


def byte_tokenizer() -> Any:
    """Byte-level tokenizer (a ``transformers.PreTrainedTokenizerFast``): ids 0-255 are the
    bytes (GPT-2 byte-to-unicode alphabet, no merges), 256-259 the special tokens ``<|bos|>
    <|eos|> <|pad|> <|turn|>``; a small chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast as Fast

    fast: Any = Fast  # transformers' classes carry no complete annotations

    from pdserve.server.tokens import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    bos, eos, pad, _ = BYTE_SPECIAL_TOKENS
    return fast(
        tokenizer_object=core,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        chat_template=BYTE_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_random_llama(path: Path, *, seed: int = 0, arch: dict[str, Any] | None = None) -> Path:
    """Write a randomly initialised float32 ``LlamaForCausalLM`` (:data:`TINY_ARCH` with
    ``arch`` over it) and :func:`byte_tokenizer` into the folder ``path``; return ``path``.
    Deterministic for a given ``seed``; the global torch RNG is left untouched."""
    import torch
    import transformers

    hf: Any = transformers  # no complete annotations
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in BYTE_SPECIAL_TOKENS}
    config = hf.LlamaConfig(
        **{"vocab_size": len(tok), **TINY_ARCH, **(arch or {})},
        bos_token_id=ids["<|bos|>"],
        eos_token_id=ids["<|eos|>"],
        pad_token_id=ids["<|pad|>"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf.LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = hf.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_smollm2_like(path: Path, *, seed: int = 0, init_std: float = 0.02) -> Path:
    """:func:`build_random_llama` with :data:`SMOLLM2_ARCH` (weights ~ N(0, ``init_std``))."""
    return build_random_llama(path, seed=seed, arch={**SMOLLM2_ARCH, "initializer_range": init_std})
