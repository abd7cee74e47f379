"""The transfer benchmark's arithmetic (fit, targets, case names); its real, tiny run between
processes is tests/integration/test_transfer_bench_processes.py."""

from __future__ import annotations

import math

import pytest

from pdserve.tools.bench_transfer import (
    CASES,
    SMOLLM2_LAYOUT,
    Case,
    Result,
    Series,
    fit_cost,
    resolve_cases,
    unavailable,
)
from pdserve.tools.bench_transfer_peers import block_bytes
from pdserve.tools.bench_transfer_report import check_targets, format_fits, format_table

BB = block_bytes(SMOLLM2_LAYOUT)


def test_fit_recovers_fixed_cost_and_bandwidth_of_exact_data() -> None:
    sizes = [BB * n for n in (1, 4, 16, 64)]
    times = [40e-6 + b / 2.5e9 for b in sizes]
    fit = fit_cost(sizes, times)
    assert fit.fixed_us == pytest.approx(40.0, rel=1e-6)
    assert fit.gbps == pytest.approx(2.5, rel=1e-6)


def test_fit_weights_relative_error_so_small_sizes_set_the_fixed_cost() -> None:
    # 1 ms of noise on the largest size moves the intercept by well under its own size.
    sizes = [BB * n for n in (1, 4, 16, 64)]
    times = [100e-6 + b / 2e9 for b in sizes]
    times[-1] += 1e-3
    assert abs(fit_cost(sizes, times).fixed_us - 100.0) < 60.0


def test_fit_of_time_that_does_not_grow_reports_infinite_bandwidth() -> None:
    assert math.isinf(fit_cost([1, 2], [1e-3, 1e-3]).gbps)


def test_fit_refuses_a_single_size_and_non_positive_times() -> None:
    with pytest.raises(ValueError):
        fit_cost([BB, BB], [1e-3, 2e-3])
    with pytest.raises(ValueError):
        fit_cost([BB, 2 * BB], [0.0, 1e-3])


def test_aliases_expand_to_both_paths_without_repeats() -> None:
    names = [c.name for c in resolve_cases(["tcp", "nixl", "nixl-tcp", "ucx"])]
    assert names == ["tcp", "nixl-tcp", "nixl-shm", "ucx-tcp", "ucx-shm"]
    with pytest.raises(ValueError, match="unknown transfer benchmark case"):
        resolve_cases(["rdma"])


def test_tcp_cases_restrict_ucx_to_loopback_tcp_and_same_host_cases_do_not() -> None:
    assert CASES["nixl-tcp"].env["UCX_TLS"] == "tcp"
    assert "UCX_TLS" not in CASES["nixl-shm"].env and CASES["nixl-shm"].ucx_devices is None


def test_case_of_an_unregistered_backend_is_reported_unavailable() -> None:
    assert unavailable(Case("rdma", "rdma", "tcp")) is not None
    assert unavailable(CASES["tcp"]) is None


def _series(name: str, path: str, gbps: dict[int, float], integrity: bool | None = None) -> Series:
    times = {n: [n * BB / (g * 1e9)] for n, g in gbps.items()}
    return Series(name, path, times, integrity)  # type: ignore[arg-type]


def test_targets_compare_each_path_with_its_reference() -> None:
    blocks = [1, 2, 8]
    result = Result(
        SMOLLM2_LAYOUT,
        blocks,
        [
            _series("memcpy", "reference", {1: 20.0, 2: 20.0, 8: 10.0}),
            _series("raw-socket", "reference", {1: 3.0, 2: 3.0, 8: 3.0}),
            _series("tcp", "tcp", {1: 1.0, 2: 2.8, 8: 2.9}, False),
            _series("tcp+xxh3", "tcp", {1: 0.1, 2: 0.1, 8: 0.1}, True),
            _series("nixl-shm", "same-host", {1: 2.0, 2: 4.0, 8: 9.0}, False),
        ],
        {},
    )
    targets = {t.name.split(" ")[0] + t.name.split(" ")[1]: t for t in check_targets(result)}
    # 1 block (0.7 MiB) is below 1 MiB: only 2 and 8 blocks count, 2.8/3 and 2.9/3 >= 0.9.
    assert targets["TCPpath"].met and "tcp+xxh3" not in targets["TCPpath"].detail
    assert targets["same-hostpath"].met  # 9 / 10 at the largest size
    assert any(t.name.startswith("fixed cost") for t in check_targets(result))
    assert "nixl-shm" in format_table(result) and "memcpy" in format_fits(result)


def test_rounds_pool_the_repetitions_of_each_series() -> None:
    from pdserve.tools.bench_transfer import _add

    result = Result(SMOLLM2_LAYOUT, [1], [], {})
    _add(result, Series("tcp", "tcp", {"1": [1e-3]}))  # type: ignore[dict-item]  # JSON keys
    _add(result, Series("tcp", "tcp", {1: [3e-3, 5e-3]}))
    assert [s.name for s in result.series] == ["tcp"]
    assert result.series[0].times == {1: [1e-3, 3e-3, 5e-3]}
    assert result.series[0].p50(1) == 3e-3
