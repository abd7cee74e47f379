"""``--dtype auto``: the checkpoint's dtype where the device computes it natively."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.hardware import checkpoint_dtype, choose_dtype, cpu_flags
from pdserve.tools.doctor import check_cpu_features

AMX = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})


def _model(tmp_path: Path, dtype: str | None, key: str = "dtype") -> Path:
    (tmp_path / "config.json").write_text(json.dumps({key: dtype} if dtype else {}))
    return tmp_path


@pytest.mark.parametrize(
    ("ckpt", "flags", "want"),
    [
        ("bfloat16", AMX, "bfloat16"),  # AMX: bfloat16 GEMMs outrun float32
        ("bfloat16", ZEN4, "float32"),  # AVX-512 BF16 alone measured slower
        ("float16", AMX, "bfloat16"),
        ("float32", AMX, "float32"),  # never widened or narrowed from float32 on CPU
        (None, AMX, "float32"),
    ],
)
def test_auto_on_cpu(tmp_path: Path, ckpt: str | None, flags: frozenset[str], want: str) -> None:
    choice = choose_dtype("auto", _model(tmp_path, ckpt), "cpu", flags)
    assert choice.dtype == want
    assert choice.reason  # logged at start-up


def test_an_explicit_dtype_wins_and_torch_dtype_is_read(tmp_path: Path) -> None:
    assert choose_dtype("float16", _model(tmp_path, "bfloat16"), "cpu", AMX).dtype == "float16"
    assert checkpoint_dtype(_model(tmp_path, "torch.bfloat16", key="torch_dtype")) == "bfloat16"
    assert "no AMX" in choose_dtype("auto", _model(tmp_path, "bfloat16"), "cpu", ZEN4).reason


def test_doctor_names_the_features_and_the_choice() -> None:
    (finding,) = check_cpu_features(ZEN4)
    assert "avx512_bf16" in finding.message and "no " in finding.message
    assert "runs a bfloat16 checkpoint in float32" in finding.message
    (finding,) = check_cpu_features(AMX)
    assert "in bfloat16" in finding.message
    assert isinstance(cpu_flags(), frozenset)
