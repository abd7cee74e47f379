"""One real, tiny run of the transfer benchmark: real bytes between processes, fitted."""

from __future__ import annotations

from pdserve.tools.bench_transfer import CASES, SMOLLM2_LAYOUT, Case, run_transfer_benchmark
from pdserve.tools.bench_transfer_report import check_targets


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
