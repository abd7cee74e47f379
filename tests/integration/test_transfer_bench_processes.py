"""One real, tiny run of the transfer benchmark: real bytes between processes, fitted."""

from __future__ import annotations

import re

import pytest

from pdserve.bench.transfer.bench_transfer import (
    CASES,
    SMOLLM2_LAYOUT,
    Case,
    run_transfer_benchmark,
)
from pdserve.bench.transfer.bench_transfer_report import (
    check_targets,
    format_targets,
    mapped_ratios,
    parse_tp_pair,
    run_from_args,
)
from pdserve.cli import build_parser


def test_tiny_run_moves_real_bytes_between_processes_and_fits_them() -> None:
    result = run_transfer_benchmark(
        SMOLLM2_LAYOUT, [1, 2], [CASES["tcp"], Case("rdma", "rdma", "tcp")],
        integrity="both", min_seconds=0.01,
    )  # fmt: skip
    names = [s.name for s in result.series]
    assert names[:3] == ["memcpy", "raw-socket", "tcp"]
    assert "rdma" in result.skipped
    for s in result.series:
        assert sorted(s.times) == [1, 2] and all(t > 0 for t in s.times[1])
    targets = check_targets(result)
    assert "fixed cost" in "\n".join(t.name for t in targets)
    by_name = {t.name: t.status for t in targets}
    assert by_name["fixed cost <= 100 us (tcp, digests off)"] in ("MET", "MISSED")
    assert by_name["fixed cost <= 100 us (nixl-shm, digests off)"] == "not measured"
    assert "[not measured] nixl-shm >= 0.7x memcpy" in format_targets(targets)


def test_tensor_parallel_pairs_are_measured_against_the_unmapped_case() -> None:
    """``--tp-pairs``: each pull lands the decode ranks' heads (the pull role checks the bytes
    arrived in every rank's shard) and is reported as a time ratio to the unmapped series."""
    result = run_transfer_benchmark(
        SMOLLM2_LAYOUT, [1, 2], [CASES["tcp"]], integrity="off", min_seconds=0.01,
        tp_pairs=[(1, 3), (3, 1)],
    )  # fmt: skip
    mapped = {s.name: s.baseline for s in result.series if s.baseline}
    assert mapped == {"tcp tp1>3": "tcp", "tcp tp3>1": "tcp"}
    ratios = mapped_ratios(result)
    assert set(ratios) == set(mapped) and all(r > 0 for v in ratios.values() for r in v.values())
    with pytest.raises(ValueError, match="does not split 3 KV heads"):
        parse_tp_pair("2:1", SMOLLM2_LAYOUT)


def test_profile_prints_the_cpu_time_per_pull_and_the_top_functions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--profile``: tcp only, a few pulls, in a child process; one table of functions."""
    args = build_parser().parse_args(
        ["bench", "transfer", "--profile", "--backends", "tcp", "--profile-pulls", "50"]
    )
    assert run_from_args(args) == 0
    out = capsys.readouterr().out
    cpu = re.search(r"CPU time per pull: (\d+) us", out)
    assert cpu is not None and int(cpu[1]) > 0, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "share" not in line]
    assert len(rows) >= 5, out
    assert all(re.fullmatch(r"\| .+ \(.+\) \| \d+\.\d \| \d+\.\d% \|", row) for row in rows), rows
    assert "nixl" not in out.split("\n", 1)[1]  # --backends tcp: no other backend profiled
