"""The transfer benchmark's arithmetic (fit, targets, case names); its real, tiny run between
processes is tests/integration/test_transfer_bench_processes.py."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.transfer.bench_transfer import (
    CASES,
    DEFAULT_BLOCKS,
    SMOLLM2_LAYOUT,
    Case,
    Result,
    Series,
    fit_cost,
    nearest_blocks,
    resolve_cases,
    unavailable,
)
from pdserve.bench.transfer.bench_transfer_peers import block_bytes
from pdserve.bench.transfer.bench_transfer_report import (
    Target,
    check_size,
    check_targets,
    format_fits,
    format_table,
    format_targets,
)

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


def _fixed(
    name: str, path: str, fixed_us: float, gbps: float, blocks: list[int], **kw: object
) -> Series:
    """A series whose times follow t = c + bytes / B exactly."""
    times = {n: [fixed_us * 1e-6 + n * BB / (gbps * 1e9)] for n in blocks}
    return Series(name, path, times, **kw)  # type: ignore[arg-type]


BLOCKS = [1, 2, 8, 23]  # 0.7 (below 1 MiB), 1.4, 5.6 and 16.2 MiB


def _result(*series: Series, skipped: dict[str, str] | None = None) -> Result:
    refs = [
        _series("memcpy", "reference", {1: 20.0, 2: 20.0, 8: 10.0, 23: 10.0}),
        _series("raw-socket", "reference", {1: 3.0, 2: 3.0, 8: 3.0, 23: 3.0}),
    ]
    return Result(SMOLLM2_LAYOUT, BLOCKS, [*refs, *series], skipped or {})


def _by_name(result: Result) -> dict[str, Target]:
    return {t.name: t for t in check_targets(result)}


def _one(result: Result, prefix: str) -> Target:
    (target,) = [t for t in check_targets(result) if t.name.startswith(prefix)]
    return target


def test_all_targets_met() -> None:
    result = _result(
        _series("tcp", "tcp", {1: 1.0, 2: 2.8, 8: 2.9, 23: 3.0}, False),
        _series("tcp+xxh3", "tcp", {1: 1.0, 2: 2.5, 8: 2.5, 23: 2.5}, True),
        _series("nixl-shm", "same-host", {1: 2.0, 2: 4.0, 8: 7.0, 23: 8.0}, False),
        _series("nixl-shm+xxh3", "same-host", {1: 2.0, 2: 4.0, 8: 7.0, 23: 7.2}, True),
    )
    # 1 block (0.7 MiB) is below 1 MiB: only 2, 8 and 23 blocks count, all >= 0.9x.
    tcp = _one(result, "tcp >= 0.9x raw socket")
    assert tcp.met and "lowest 0.93x at 1.4 MiB" in tcp.detail
    shm = _one(result, "nixl-shm >= 0.7x memcpy")
    assert shm.met and "0.80x at 16.2 MiB (23 blocks)" in shm.detail
    assert "closest" not in shm.detail
    digests = [t for t in check_targets(result) if t.name.startswith("digests on")]
    assert [t.name.rsplit(" ", 1)[1] for t in digests] == ["(tcp)", "(nixl-shm)"]
    assert all(t.met for t in digests)
    assert "0.83x at 16.2 MiB (23 blocks)" in digests[0].detail and "0.90x" in digests[1].detail
    assert "nixl-shm" in format_table(result) and "memcpy" in format_fits(result)


def test_fixed_cost_is_checked_on_tcp_and_nixl_shm_and_listed_for_the_others() -> None:
    result = _result(
        _fixed("tcp", "tcp", 80.0, 3.0, BLOCKS, integrity=False),
        _fixed("tcp+xxh3", "tcp", 300.0, 2.0, BLOCKS, integrity=True),
        _fixed("nixl-shm", "same-host", 250.0, 8.0, BLOCKS, integrity=False),
        _fixed("nixl-tcp", "tcp", 700.0, 2.0, BLOCKS, integrity=False),
    )
    targets = _by_name(result)
    tcp = targets["fixed cost <= 100 us (tcp, digests off)"]
    assert tcp.status == "MET" and tcp.detail == "c = 80 us per transfer"
    shm = targets["fixed cost <= 100 us (nixl-shm, digests off)"]
    assert shm.status == "MISSED" and not shm.met and "250 us" in shm.detail
    assert targets["fixed cost (nixl-tcp)"].status == "info"
    assert not any("tcp+xxh3" in name for name in targets if name.startswith("fixed"))
    text = format_targets(check_targets(result))
    assert "[MET] fixed cost <= 100 us (tcp" in text and "[MISSED] fixed cost" in text
    assert "[info] fixed cost (nixl-tcp): c = 700 us" in text


def test_missed_targets_report_their_figures() -> None:
    result = _result(
        _series("tcp", "tcp", {1: 1.0, 2: 2.0, 8: 2.9, 23: 3.0}, False),
        _series("tcp+xxh3", "tcp", {1: 1.0, 2: 1.0, 8: 1.0, 23: 1.5}, True),
        _series("nixl-shm", "same-host", {1: 2.0, 2: 4.0, 8: 5.0, 23: 5.0}, False),
    )
    tcp = _one(result, "tcp >= 0.9x")
    assert tcp.status == "MISSED" and "lowest 0.67x at 1.4 MiB" in tcp.detail
    shm = _one(result, "nixl-shm >= 0.7x")
    assert shm.status == "MISSED" and "0.50x at 16.2 MiB" in shm.detail
    assert "5.00 vs 10.00 GB/s" in shm.detail
    digests = _one(result, "digests on")
    assert digests.status == "MISSED" and digests.name.endswith("(tcp)")
    assert "0.50x at 16.2 MiB" in digests.detail


def test_targets_whose_cases_were_not_measured_say_so() -> None:
    # --backends tcp --integrity off: nothing on nixl-shm, no digests.
    result = _result(
        _series("tcp", "tcp", {1: 1.0, 2: 2.8, 8: 2.9, 23: 3.0}, False),
        skipped={"nixl-shm": "no 'nixl' transfer backend is registered in this build"},
    )
    targets = _by_name(result)
    assert targets["fixed cost <= 100 us (tcp, digests off)"].status in ("MET", "MISSED")
    shm_cost = targets["fixed cost <= 100 us (nixl-shm, digests off)"]
    assert shm_cost.status == "not measured" and "skipped: no 'nixl'" in shm_cost.detail
    assert _one(result, "nixl-shm >= 0.7x").status == "not measured"
    digests = _one(result, "digests on")
    assert digests.status == "not measured" and "--integrity both" in digests.detail
    assert not digests.met
    assert "[not measured] nixl-shm >= 0.7x memcpy" in format_targets(check_targets(result))
    # --backends nixl-shm: the tcp targets are the ones not measured.
    only_shm = _result(_series("nixl-shm", "same-host", {1: 2.0, 2: 4.0, 8: 7.0, 23: 8.0}, False))
    tcp = _one(only_shm, "tcp >= 0.9x")
    assert tcp.status == "not measured" and "tcp was not measured" in tcp.detail
    assert _one(only_shm, "nixl-shm >= 0.7x").met


def test_sixteen_mib_targets_use_the_closest_size_and_say_which() -> None:
    result = Result(
        SMOLLM2_LAYOUT,
        [1, 16, 32],
        [
            _series("memcpy", "reference", {1: 10.0, 16: 10.0, 32: 10.0}),
            _series("raw-socket", "reference", {1: 3.0, 16: 3.0, 32: 3.0}),
            _series("nixl-shm", "same-host", {1: 2.0, 16: 9.0, 32: 1.0}, False),
        ],
        {},
    )
    assert check_size(result) == (16, "11.2 MiB (16 blocks), the measured size closest to 16 MiB")
    shm = _one(result, "nixl-shm >= 0.7x")
    assert shm.met and "at 11.2 MiB (16 blocks), the measured size closest" in shm.detail


def test_default_sizes_include_the_block_count_closest_to_16_mib() -> None:
    assert nearest_blocks(SMOLLM2_LAYOUT, 16 * 2**20) == 23  # 16.2 MiB; 22 blocks: 15.5 MiB
    assert 23 in DEFAULT_BLOCKS and max(DEFAULT_BLOCKS) == 91
    assert nearest_blocks(SMOLLM2_LAYOUT, 1) == 1


def test_a_single_size_has_no_fit_and_says_so() -> None:
    result = Result(
        SMOLLM2_LAYOUT,
        [23],
        [
            _series("memcpy", "reference", {23: 10.0}),
            _series("tcp", "tcp", {23: 3.0}, False),
        ],
        {},
    )
    cost = _by_name(result)["fixed cost <= 100 us (tcp, digests off)"]
    assert cost.status == "not measured" and "two sizes" in cost.detail
    assert "tcp" in format_fits(result)


def test_rounds_pool_the_repetitions_of_each_series() -> None:
    from pdserve.bench.transfer.bench_transfer import _add

    result = Result(SMOLLM2_LAYOUT, [1], [], {})
    _add(result, Series("tcp", "tcp", {"1": [1e-3]}))  # type: ignore[dict-item]  # JSON keys
    _add(result, Series("tcp", "tcp", {1: [3e-3, 5e-3]}))
    assert [s.name for s in result.series] == ["tcp"]
    assert result.series[0].times == {1: [1e-3, 3e-3, 5e-3]}
    assert result.series[0].p50(1) == 3e-3
