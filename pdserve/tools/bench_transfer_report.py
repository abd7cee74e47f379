"""Tables, fits and target checks of the transfer benchmark, and its command line.

The targets, checked on the series measured with integrity digests off (the
digest cost is shown beside them, not counted against the transport)::

    tcp path     the best TCP-path case reaches >= 0.9x the raw socket at every size >= 1 MiB
    same host    the best same-host case reaches >= 0.8x memcpy at the largest size
    fixed cost   the fitted fixed cost per transfer is <= 50 us (checked per case)
    mapped       a hand-off between tensor parallel layouts (--tp-pairs) takes <= 1.3x the
                 time of the unmapped one of the same bytes, at every size >= 1 MiB
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from pdserve.protocol import KVLayout
from pdserve.tools.bench_transfer import (
    DEFAULT_BLOCKS,
    SMOLLM2_LAYOUT,
    Result,
    Series,
    resolve_cases,
    run_transfer_benchmark,
)
from pdserve.tools.bench_transfer_peers import block_bytes

TCP_RATIO = 0.9
SAME_HOST_RATIO = 0.8
FIXED_COST_US = 50.0
MAPPED_RATIO = 1.3
_MIB = 2**20


@dataclass(frozen=True)
class Target:
    """One target of the issue: ``met`` and a sentence saying by how much."""

    name: str
    met: bool
    detail: str


def _transport_series(result: Result, path: str) -> list[Series]:
    """The unmapped cases of ``path`` measured without digests (integrity off or not
    available)."""
    return [s for s in result.series if s.path == path and not s.integrity and not s.baseline]


def mapped_ratios(result: Result) -> dict[str, dict[int, float]]:
    """Per mapped series (tensor parallel layouts): p50 time / its unmapped baseline's p50
    time, per size in blocks (> 1: the mapping costs time)."""
    out: dict[str, dict[int, float]] = {}
    for s in result.series:
        base = result.get(s.baseline) if s.baseline else None
        if base is not None:
            out[s.name] = {n: s.p50(n) / base.p50(n) for n in result.blocks}
    return out


def check_targets(result: Result) -> list[Target]:
    """Evaluate the three targets (see the module docstring) on ``result``."""
    layout, targets = result.layout, []
    raw, memcpy = result.get("raw-socket"), result.get("memcpy")
    big = [n for n in result.blocks if n * block_bytes(layout) >= _MIB]
    tcp = _transport_series(result, "tcp")
    if raw is not None and tcp and big:
        worst = {s.name: min(s.gbps(n, layout) / raw.gbps(n, layout) for n in big) for s in tcp}
        best = max(worst, key=lambda name: worst[name])
        targets.append(
            Target(
                f"TCP path >= {TCP_RATIO}x raw socket at >= 1 MiB",
                worst[best] >= TCP_RATIO,
                f"best {best}: lowest ratio {worst[best]:.2f} over {len(big)} sizes "
                f"({', '.join(f'{k} {v:.2f}' for k, v in worst.items())})",
            )
        )
    local = _transport_series(result, "same-host")
    if memcpy is not None and local:
        top = max(result.blocks)
        ratio = {s.name: s.gbps(top, layout) / memcpy.gbps(top, layout) for s in local}
        best = max(ratio, key=lambda name: ratio[name])
        targets.append(
            Target(
                f"same-host path >= {SAME_HOST_RATIO}x memcpy",
                ratio[best] >= SAME_HOST_RATIO,
                f"best {best}: {ratio[best]:.2f} at {top * block_bytes(layout) / _MIB:.1f} MiB "
                f"({memcpy.gbps(top, layout):.2f} GB/s memcpy)",
            )
        )
    for name, by_size in mapped_ratios(result).items():
        if name.endswith("+xxh3") or not big:
            continue
        highest = max(by_size[n] for n in big)
        targets.append(
            Target(
                f"mapped hand-off <= {MAPPED_RATIO}x unmapped ({name})",
                highest <= MAPPED_RATIO,
                f"highest time ratio {highest:.2f} over {len(big)} sizes >= 1 MiB",
            )
        )
    for s in [*tcp, *local]:
        fit = s.fit(layout)
        targets.append(
            Target(
                f"fixed cost <= {FIXED_COST_US:.0f} us ({s.name})",
                fit.fixed_us <= FIXED_COST_US,
                f"{fit.fixed_us:.0f} us per transfer",
            )
        )
    return targets


def _columns(result: Result) -> list[str]:
    return [s.name for s in result.series]


def format_table(result: Result) -> str:
    """GB/s at p50 per size (rows) and series (columns), then the ratio of every transport
    case to its reference (raw socket for the TCP path, memcpy for the same host)."""
    layout, names = result.layout, _columns(result)
    width = {n: max(len(n), 7) + 2 for n in names}
    head = f"{'MiB':>7}{'blocks':>7}" + "".join(f"{n:>{width[n]}}" for n in names)
    lines = ["GB/s at p50 (1 GB = 1e9 bytes)", head]
    for n in result.blocks:
        row = f"{n * block_bytes(layout) / _MIB:>7.1f}{n:>7}"
        row += "".join(f"{s.gbps(n, layout):>{width[s.name]}.2f}" for s in result.series)
        lines.append(row)
    ratios = [s for s in result.series if s.path != "reference" and not s.baseline]
    if ratios:
        lines += ["", "ratio to the reference (tcp path: raw-socket; same host: memcpy)"]
        lines.append(
            f"{'MiB':>7}{'blocks':>7}" + "".join(f"{s.name:>{width[s.name]}}" for s in ratios)
        )
        for n in result.blocks:
            row = f"{n * block_bytes(layout) / _MIB:>7.1f}{n:>7}"
            for s in ratios:
                ref = result.get("raw-socket" if s.path == "tcp" else "memcpy")
                value = s.gbps(n, layout) / ref.gbps(n, layout) if ref else math.nan
                row += f"{value:>{width[s.name]}.2f}"
            lines.append(row)
    return "\n".join(lines)


def format_mapped(result: Result) -> str:
    """Time of each mapped series over its unmapped baseline's, per size ("" when none)."""
    ratios = mapped_ratios(result)
    if not ratios:
        return ""
    layout = result.layout
    width = {n: max(len(n), 7) + 2 for n in ratios}
    lines = ["mapped / unmapped time at p50 (tensor parallel layouts; same bytes)"]
    lines.append(f"{'MiB':>7}{'blocks':>7}" + "".join(f"{n:>{width[n]}}" for n in ratios))
    for b in result.blocks:
        row = f"{b * block_bytes(layout) / _MIB:>7.1f}{b:>7}"
        row += "".join(f"{ratios[n][b]:>{width[n]}.2f}" for n in ratios)
        lines.append(row)
    return "\n".join(lines)


def format_fits(result: Result) -> str:
    """Per series: fixed cost (us) and bandwidth (GB/s) of ``t = c + bytes / B``, and the p50
    time of the smallest request."""
    lines = [
        "fit t = c + bytes / B (least squares over the sizes, weights 1/t^2)",
        f"{'series':<16}{'c (us)':>9}{'B (GB/s)':>10}{'p50 1 block (us)':>18}",
    ]
    first = min(result.blocks)
    for s in result.series:
        fit = s.fit(result.layout)
        lines.append(
            f"{s.name:<16}{fit.fixed_us:>9.0f}{fit.gbps:>10.2f}{s.p50(first) * 1e6:>18.0f}"
        )
    return "\n".join(lines)


def format_targets(targets: list[Target]) -> str:
    lines = ["targets (integrity off):"]
    lines += [f"  [{'MET' if t.met else 'MISSED'}] {t.name}: {t.detail}" for t in targets]
    return "\n".join(lines)


def print_results(result: Result) -> None:
    """Print the table, the fits, the skipped cases and the targets."""
    layout = result.layout
    print(
        f"KV transfer, 2 processes per measurement, {layout.model} layout "
        f"({layout.num_layers} layers, {layout.num_kv_heads} kv heads, head dim "
        f"{layout.head_dim}, {layout.tokens_per_block} tokens/block, {layout.dtype}: "
        f"{block_bytes(layout)} bytes/block)"
    )
    print("-tcp: UCX_TLS=tcp on loopback; -shm: UCX default transports (CMA / shared memory); "
          "+xxh3: integrity digests on")  # fmt: skip
    print(format_table(result), end="\n\n")
    if mapped := format_mapped(result):
        print(mapped, end="\n\n")
    print(format_fits(result), end="\n\n")
    for name, why in result.skipped.items():
        print(f"skipped {name}: {why}")
    print(format_targets(check_targets(result)))


def run_from_args(args: argparse.Namespace) -> int:
    """Run with the parsed flags of ``pdserve bench transfer`` (``sizes_mib``, ``backends``,
    ``integrity``, ``min_seconds``, ``rounds``, ``tp_pairs``; see :mod:`pdserve.cli`) and print.
    Returns 0 when it ran (targets met or missed: they are reported, not an error), 2 for an
    unknown case name or a tensor parallel pair that does not split the layout's KV heads."""
    layout = SMOLLM2_LAYOUT
    if args.sizes_mib:
        blocks = [max(1, math.ceil(m * _MIB / block_bytes(layout))) for m in args.sizes_mib]
    else:
        blocks = DEFAULT_BLOCKS
    try:
        cases = resolve_cases(args.backends)
        pairs = [parse_tp_pair(text, layout) for text in args.tp_pairs or ()]
    except ValueError as exc:
        print(f"pdserve bench transfer: {exc}")
        return 2
    result = run_transfer_benchmark(
        layout,
        blocks,
        cases,
        integrity=args.integrity,
        min_seconds=args.min_seconds,
        rounds=args.rounds,
        tp_pairs=pairs,
    )
    print_results(result)
    return 0


def parse_tp_pair(text: str, layout: KVLayout) -> tuple[int, int]:
    """``"1:3"`` -> ``(1, 3)``; raises ValueError for another form or sizes that do not split
    ``layout``'s KV heads (one must divide the other)."""
    m, sep, n = text.partition(":")
    if not sep or not m.isdigit() or not n.isdigit() or int(m) < 1 or int(n) < 1:
        raise ValueError(f"--tp-pairs takes PREFILL:DECODE sizes such as 1:3, got {text!r}")
    heads = layout.num_kv_heads
    for size in (int(m), int(n)):
        if heads % size and size % heads:
            raise ValueError(f"tensor parallel size {size} does not split {heads} KV heads")
    return int(m), int(n)
