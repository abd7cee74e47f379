"""Stand-in models with random weights for the engine benchmarks (``pdserve bench gpu``), where
the converted SmolLM2 folder (about 270 MB of bfloat16 weights) cannot be carried and no model
hub can be reached.

- :func:`build_random_llama`: a ``LlamaForCausalLM`` with random weights (default: tiny, 2 layers,
  hidden 64) and the byte-level tokenizer of :func:`byte_tokenizer`, written as a Hugging Face
  model folder any pdserve engine loads.
- :func:`build_random_model`: the same tokenizer and init for another decoder family
  (:data:`FAMILY_ARCH`: Qwen2/3, Mistral, Phi-3, Gemma 2/3, OLMo 2, Granite, Qwen3-MoE,
  Mixtral), tiny, with the family's own features (sliding windows, soft-capping, MoE) on.
- :func:`build_smollm2_like`: the same with SmolLM2-135M-Instruct's architecture
  (:data:`SMOLLM2_ARCH`: 30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64, vocab 49152,
  tied embeddings). Compute, KV layout (720 KiB per 16-token float32 block) and step times are
  SmolLM2's; the text is not: its tokenizer has SmolLM2's 49,152 ids, bytes and merged
  printable-ASCII pairs and triples, so every sampled id streams as visible (random) text.

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


def byte_tokenizer(vocab_size: int | None = None) -> Any:
    """Byte-level tokenizer (a ``transformers.PreTrainedTokenizerFast``): ids 0-255 are the
    bytes (GPT-2 byte-to-unicode alphabet), then, with ``vocab_size``, merged tokens of two and
    three printable ASCII characters (every pair of the 94 characters ``!``..``~``, then triples,
    until the vocabulary holds ``vocab_size`` ids), then the 4 special tokens ``<|bos|> <|eos|>
    <|pad|> <|turn|>`` (ids 256-259 without ``vocab_size``); a small chat template. With
    ``vocab_size``, every id a model can sample decodes to visible text, so a random-weight model
    with a real vocabulary size streams text through the whole stack. Raises ValueError for a
    ``vocab_size`` below 260 or above what pairs and triples give (839,680)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast as Fast

    fast: Any = Fast  # transformers' classes carry no complete annotations

    from pdserve.server.rendering.logprobs import bytes_to_unicode

    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    merges = _printable_merges(vocab_size - 256 - len(BYTE_SPECIAL_TOKENS)) if vocab_size else []
    for left, right in merges:
        vocab[left + right] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
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


def _printable_merges(n: int) -> list[tuple[str, str]]:
    """``n`` BPE merges over printable ASCII (bytes 33-126, their own characters in the
    byte-level alphabet): every pair first, then triples built on the pairs."""
    chars = [chr(b) for b in range(33, 127)]
    pairs = [(a, b) for a in chars for b in chars]
    triples = [(a + b, c) for a in chars for b in chars for c in chars]
    if not 0 <= n <= len(pairs) + len(triples):
        raise ValueError(f"a byte tokenizer holds 260 to {260 + len(pairs) + len(triples)} ids")
    return (pairs + triples)[:n]


def build_random_llama(path: Path, *, seed: int = 0, arch: dict[str, Any] | None = None) -> Path:
    """Write a randomly initialised float32 ``LlamaForCausalLM`` (:data:`TINY_ARCH` with
    ``arch`` over it) and :func:`byte_tokenizer` into the folder ``path``; return ``path``
    (:func:`build_random_model` of the ``llama`` family). Deterministic for a given ``seed``;
    the global torch RNG is left untouched."""
    return build_random_model(path, "llama", seed=seed, arch=arch)


def build_smollm2_like(path: Path, *, seed: int = 0, init_std: float = 0.02) -> Path:
    """:func:`build_random_llama` with :data:`SMOLLM2_ARCH` (weights ~ N(0, ``init_std``)) and
    a :func:`byte_tokenizer` of SmolLM2's 49,152 ids, every one of which decodes to text."""
    return build_random_model(
        path,
        "llama",
        seed=seed,
        arch={**SMOLLM2_ARCH, "initializer_range": init_std},
        vocab_size=SMOLLM2_ARCH["vocab_size"],
    )


FAMILY_ARCH: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 8.0,
            "tie_word_embeddings": False,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "query_pre_attn_scalar": 32,
            "tie_word_embeddings": False,
        },
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.1,
            "logits_scaling": 2.0,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}
"""Decoder families :func:`build_random_model` builds: family -> (transformers config class,
model class, config fields over :data:`TINY_ARCH`). Each family's own features are on in the
tiny model: an 8-token sliding window where the family has one (Qwen2/Qwen3 slide their second
layer, Gemma 2/3 alternate sliding and global layers over 4 layers, Mistral and Phi-3 slide every
layer), Gemma 2's attention and final logit soft-capping tight enough to bite, a
``query_pre_attn_scalar`` other than ``head_dim``, Granite's four multipliers away from 1, 4
experts with 2 routed per token (Qwen3-MoE, Mixtral, gpt-oss), gpt-oss's attention sinks (one
learned logit per head) beside a sliding and a full layer. Mixtral and Qwen3-MoE keep full attention
as their released checkpoints do. Gemma's LM head is untied: its embeddings are scaled by
sqrt(hidden) and built with std 0.25 / sqrt(hidden) (:func:`build_random_model`), which a tied
head would turn into near-tied logits."""


def build_random_model(
    path: Path,
    family: str,
    *,
    seed: int = 0,
    arch: dict[str, Any] | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Write a randomly initialised float32 model of decoder ``family`` (a key of
    :data:`FAMILY_ARCH`: :data:`TINY_ARCH`, less the fields its config class does not declare,
    with the family's fields over it, and ``arch`` over those) and :func:`byte_tokenizer` (of
    ``vocab_size`` ids when given) into the folder ``path``;
    return ``path``. Weights follow the model's own init with ``initializer_range`` 0.25 (as
    :func:`build_random_llama`), and bias vectors (zero at init, e.g. Qwen2's q/k/v biases)
    get the same N(0, 0.25) so that loading them is exercised too. An embedding the model scales
    (Gemma's, by sqrt(hidden)) is divided by its scale, so what enters the first layer has std
    0.25 as elsewhere (else the embedding drowns the layers' normalised outputs and the model
    repeats its input). Deterministic for a given
    ``seed``; the global torch RNG is left untouched. Raises KeyError for an unknown family."""
    import torch
    import transformers

    hf: Any = transformers  # no complete annotations
    config_name, model_name, overrides = FAMILY_ARCH[family]
    config_cls, model_cls = getattr(hf, config_name), getattr(hf, model_name)
    declared: set[str] = set()
    for klass in config_cls.__mro__:
        declared |= set(getattr(klass, "__annotations__", {}))
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in BYTE_SPECIAL_TOKENS}
    base = {k: v for k, v in TINY_ARCH.items() if k in declared}
    config = config_cls(
        **{"vocab_size": len(tok), **base, **overrides, **(arch or {})},
        bos_token_id=ids["<|bos|>"],
        eos_token_id=ids["<|eos|>"],
        pad_token_id=ids["<|pad|>"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, config.initializer_range)
            embed = model.get_input_embeddings()
            scale = getattr(embed, "embed_scale", None)  # Gemma: embeddings times sqrt(hidden)
            if scale is not None:
                embed.weight.div_(scale)
    model.generation_config = hf.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
