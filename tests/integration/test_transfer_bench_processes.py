"""One real, tiny run of the transfer benchmark: real bytes between processes, fitted."""

from __future__ import annotations

import pytest

from pdserve.tools.bench_transfer import CASES, SMOLLM2_LAYOUT, Case, run_transfer_benchmark
from pdserve.tools.bench_transfer_report import check_targets, mapped_ratios, parse_tp_pair


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
    assert "fixed cost" in "\n".join(t.name for t in check_targets(result))


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
