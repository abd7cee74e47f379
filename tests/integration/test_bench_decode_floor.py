"""``pdserve bench decode-floor`` times decode steps against the weights' bytes over the
measured read bandwidth, and profiles them (tiny model)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from pdserve.bench.engine.bench_decode_floor import add_arguments, run, weight_bytes_per_step
from pdserve.workers.engine.model.compile import prepack_linears


def test_the_floor_counts_every_linear_once_prepacked_or_not(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    want = sum(m.weight.numel() * 4 for m in linears)  # the tied LM head among them, once
    assert weight_bytes_per_step(model, 4) == want
    assert prepack_linears(model) == len(linears)
    assert weight_bytes_per_step(model, 2) == want // 2


def test_rows_and_the_profile_are_printed(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_model_dir), "--dtypes", "float32", "--batches", "1", "2",
         "--tokens", "4", "--no-compile", "--buffer-mib", "64", "--profile"]
    )  # fmt: skip
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "read bandwidth" in out and "GB/s" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("float32 ")]
    assert [r[1] for r in rows] == ["1", "2"]
    for _, _, step_ms, floor_ms, ratio, tok_s in rows:
        assert float(step_ms) > 0 and float(floor_ms) > 0 and float(tok_s) > 0
        assert float(ratio) > 1  # the tiny model's step is all overhead: far above its floor
    assert "top operators by self CPU time" in out
    assert "aten::" in out  # the engine thread's operators were recorded


def test_w8a8_weights_count_a_byte_each_and_model_sampling_runs(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for weights, sampling in (("none", "greedy"), ("w8a8", "model")):
        args = parser.parse_args(
            ["--model", str(tiny_model_dir), "--dtypes", "float32", "--batches", "2",
             "--tokens", "4", "--no-compile", "--buffer-mib", "64",
             "--quantization", weights, "--sampling", sampling]
        )  # fmt: skip
        assert run(args) == 0
        out = capsys.readouterr().out
        assert f"weights {weights}" in out
        assert ("'temperature': 0.0" in out) == (sampling == "greedy")
        (row,) = [line.split() for line in out.splitlines() if line.startswith("float32 ")]
        assert float(row[2]) > 0

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    head = model.get_output_embeddings()
    others = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    )
    prepack_linears(model, int8=True)
    # W8A8 weights are a byte each; the LM head stays float32
    assert weight_bytes_per_step(model, 4) == others + head.weight.numel() * 4
