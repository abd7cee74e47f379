"""``pdserve bench kv-dtype`` runs its engines and prints one row per dtype (tiny model)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.tools.bench_kv_dtype import add_arguments, main


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
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"float32", "fp8_e4m3"}
    assert int(rows["fp8_e4m3"][1]) == 4 * int(rows["float32"][1])
    assert rows["float32"][2:5] == ["4", "of", "4"]  # the reference equals itself
    assert float(rows["fp8_e4m3"][5]) > 0
