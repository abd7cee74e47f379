"""``--dtype auto``: bfloat16 on CPUs that compute it natively (any checkpoint), else float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.doctor.doctor import check_cpu_features
from pdserve.hardware import checkpoint_dtype, choose_dtype, cpu_flags

AMX = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


def _model(tmp_path: Path, dtype: str | None, key: str = "dtype") -> Path:
    (tmp_path / "config.json").write_text(json.dumps({key: dtype} if dtype else {}))
    return tmp_path


@pytest.mark.parametrize(
    ("ckpt", "flags", "want"),
    [
        ("bfloat16", AMX, "bfloat16"),  # AMX: bfloat16 GEMMs outrun float32
        ("bfloat16", ZEN4, "bfloat16"),  # AVX-512 BF16 with the in-place kernel: 1.45x
        ("bfloat16", AVX2, "float32"),  # no native bfloat16
        ("float16", AMX, "bfloat16"),
        ("float32", AMX, "bfloat16"),  # narrowed, as vLLM's CPU build does
        ("float32", ZEN4, "bfloat16"),
        ("float32", AVX2, "float32"),  # bfloat16 would be emulated: slower
        (None, AMX, "bfloat16"),
        (None, AVX2, "float32"),
    ],
)
def test_auto_on_cpu(tmp_path: Path, ckpt: str | None, flags: frozenset[str], want: str) -> None:
    choice = choose_dtype("auto", _model(tmp_path, ckpt), "cpu", flags)
    assert choice.dtype == want
    assert choice.reason  # logged at start-up


def test_an_explicit_dtype_wins_and_torch_dtype_is_read(tmp_path: Path) -> None:
    assert choose_dtype("float16", _model(tmp_path, "bfloat16"), "cpu", AMX).dtype == "float16"
    assert checkpoint_dtype(_model(tmp_path, "torch.bfloat16", key="torch_dtype")) == "bfloat16"
    bf16 = _model(tmp_path, "bfloat16")
    assert "avx512_bf16" in choose_dtype("auto", bf16, "cpu", ZEN4).reason
    assert "no AMX or AVX-512 BF16" in choose_dtype("auto", bf16, "cpu", AVX2).reason
    # without the in-place kernel, bfloat16 attention (gather + SDPA) is the slow path
    no_kernel = choose_dtype("auto", bf16, "cpu", ZEN4, in_place=False)
    assert no_kernel.dtype == "float32" and "no in-place attention kernel" in no_kernel.reason
    assert choose_dtype("auto", bf16, "cpu", AMX, in_place=False).dtype == "bfloat16"
    fp32 = _model(tmp_path, "float32")
    assert "narrowed" in choose_dtype("auto", fp32, "cpu", AMX).reason
    assert choose_dtype("float32", fp32, "cpu", AMX).dtype == "float32"  # the way to keep it
    assert choose_dtype("auto", fp32, "cpu", ZEN4, in_place=False).dtype == "float32"


def test_doctor_names_the_features_and_the_choice() -> None:
    (finding,) = check_cpu_features(AVX2)
    assert "avx2" in finding.message and "no " in finding.message
    assert "(float32 or bfloat16) in float32" in finding.message
    for flags in (AMX, ZEN4):
        (finding,) = check_cpu_features(flags)
        assert "avx512_bf16" in finding.message and "in bfloat16" in finding.message
    assert isinstance(cpu_flags(), frozenset)
