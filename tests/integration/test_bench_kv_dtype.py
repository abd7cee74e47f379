"""``pdserve bench kv-dtype`` runs its engines and prints one row per dtype (tiny model)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.bench.engine.bench_kv_dtype import add_arguments, main


def test_rows_show_the_fp8_pool_holding_four_times_float32(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_model_dir), "--kv-dtypes", "float32", "fp8_e4m3", "--kv-cache-mb",
         "1", "--batch", "2", "--tokens", "4", "--no-compile"]
    )  # fmt: skip
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    # weights, kv dtype, blocks, answers ("4 of 4"), perplexity, ms/step
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in lines}
    assert set(rows) == {("none", "float32"), ("none", "fp8_e4m3")}
    assert int(rows["none", "fp8_e4m3"][0]) == 4 * int(rows["none", "float32"][0])
    assert rows["none", "float32"][1:4] == ["4", "of", "4"]  # the reference equals itself
    assert float(rows["none", "fp8_e4m3"][4]) > 1  # a perplexity
    assert float(rows["none", "fp8_e4m3"][5]) > 0
