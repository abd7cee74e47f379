"""Tables, fits and target checks of the transfer benchmark, and its command line.

The targets (issue 25), each reported MET or MISSED with its figure, or "not measured" when a
case it needs was not measured (``--backends``, ``--integrity``, a backend missing here)::

    fixed cost   the fit's c (digests off) is <= 100 us on the tcp and on the nixl-shm case
                 (other cases' c is listed as info)
    tcp          the tcp case reaches >= 0.9x the raw socket at every size >= 1 MiB (digests off)
    same host    the nixl-shm case reaches >= 0.7x memcpy at 16 MiB (digests off)
    digests      every case measured with digests off and on reaches >= 0.8x of its digests-off
                 GB/s with them on, at 16 MiB
    mapped       a hand-off between tensor parallel layouts (--tp-pairs) takes <= 1.3x the
                 time of the unmapped one of the same bytes, at every size >= 1 MiB

"At 16 MiB" is the measured size closest to 16 MiB (the default sizes hold 23 SmolLM2 blocks,
16.2 MiB); the report names the size it used.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Literal

from pdserve.bench.transfer.bench_transfer import (
    DEFAULT_BLOCKS,
    SMOLLM2_LAYOUT,
    Fit,
    Result,
    Series,
    integrity_settings,
    nearest_blocks,
    resolve_cases,
    run_transfer_benchmark,
)
from pdserve.bench.transfer.bench_transfer_peers import block_bytes
from pdserve.bench.transfer.bench_transfer_profile import profile_backends, run_profiles
from pdserve.protocol import KVLayout

FIXED_COST_US = 100.0
FIXED_COST_CASES = ("tcp", "nixl-shm")
TCP_RATIO = 0.9
SAME_HOST_RATIO = 0.7
DIGEST_RATIO = 0.8
CHECK_MIB = 16.0
"""The size (MiB) of the same-host and digest targets."""
MAPPED_RATIO = 1.3
DEFAULT_BACKENDS = ["tcp", "nixl", "ucx"]
PROFILE_BACKENDS = ["tcp", "nixl"]
_MIB = 2**20

Status = Literal["MET", "MISSED", "not measured", "info"]


@dataclass(frozen=True)
class Target:
    """One target: its status and a sentence with the figure (or why it was not measured);
    ``"info"`` lines carry a figure no target judges."""

    name: str
    status: Status
    detail: str

    @property
    def met(self) -> bool:
        return self.status == "MET"


def _judge(ok: bool) -> Status:
    return "MET" if ok else "MISSED"


def _case(result: Result, name: str, digests: bool) -> Series | None:
    """The unmapped series of case ``name`` with digests on or off (off includes a build whose
    settings have no digests)."""
    s = result.get(name + ("+xxh3" if digests else ""))
    if s is None or s.baseline or bool(s.integrity) != digests:
        return None
    return s


def _why_missing(result: Result, name: str, digests: bool = False) -> str:
    if name in result.skipped:
        return f"{name} skipped: {result.skipped[name]}"
    if digests:
        return f"{name} was not measured with digests on (--backends, --integrity)"
    return f"{name} was not measured with digests off (--backends, --integrity)"


def _mib(layout: KVLayout, blocks: int) -> str:
    return f"{blocks * block_bytes(layout) / _MIB:.1f} MiB"


def _fit(s: Series, layout: KVLayout) -> Fit | None:
    """The series' fit, None with fewer than two sizes."""
    return s.fit(layout) if len(s.times) >= 2 else None


def check_size(result: Result) -> tuple[int, str]:
    """The measured size (blocks) closest to :data:`CHECK_MIB` and how to name it, e.g.
    ``"16.2 MiB (23 blocks)"``, with a note when it is not the block count closest to 16 MiB."""
    layout = result.layout
    target = nearest_blocks(layout, CHECK_MIB * _MIB)
    n = min(result.blocks, key=lambda b: (abs(b * block_bytes(layout) - CHECK_MIB * _MIB), b))
    text = f"{_mib(layout, n)} ({n} blocks)"
    if n != target:
        text += f", the measured size closest to {CHECK_MIB:.0f} MiB"
    return n, text


def mapped_ratios(result: Result) -> dict[str, dict[int, float]]:
    """Per mapped series (tensor parallel layouts): p50 time / its unmapped baseline's p50
    time, per size in blocks (> 1: the mapping costs time)."""
    out: dict[str, dict[int, float]] = {}
    for s in result.series:
        base = result.get(s.baseline) if s.baseline else None
        if base is not None:
            out[s.name] = {n: s.p50(n) / base.p50(n) for n in result.blocks}
    return out


def _fixed_cost_targets(result: Result) -> list[Target]:
    layout, out = result.layout, []
    for name in FIXED_COST_CASES:
        title = f"fixed cost <= {FIXED_COST_US:.0f} us ({name}, digests off)"
        s = _case(result, name, False)
        fit = _fit(s, layout) if s is not None else None
        if s is None:
            out.append(Target(title, "not measured", _why_missing(result, name)))
        elif fit is None:
            out.append(Target(title, "not measured", "a fit needs at least two sizes"))
        else:
            detail = f"c = {fit.fixed_us:.0f} us per transfer"
            if fit.fixed_us < 0:
                detail += " (below 0: noise decides the fit; more --rounds or --min-seconds)"
            out.append(Target(title, _judge(fit.fixed_us <= FIXED_COST_US), detail))
    for s in result.series:
        if s.path == "reference" or s.baseline or s.integrity or s.name in FIXED_COST_CASES:
            continue
        if (fit := _fit(s, layout)) is not None:
            out.append(Target(f"fixed cost ({s.name})", "info", f"c = {fit.fixed_us:.0f} us"))
    return out


def _tcp_target(result: Result) -> Target:
    layout = result.layout
    title = f"tcp >= {TCP_RATIO}x raw socket at every size >= 1 MiB (digests off)"
    tcp, raw = _case(result, "tcp", False), result.get("raw-socket")
    big = [n for n in result.blocks if n * block_bytes(layout) >= _MIB]
    if tcp is None:
        return Target(title, "not measured", _why_missing(result, "tcp"))
    if raw is None:
        return Target(title, "not measured", "no raw-socket reference in this result")
    if not big:
        return Target(title, "not measured", "no size >= 1 MiB (--sizes-mib)")
    ratio = {n: tcp.gbps(n, layout) / raw.gbps(n, layout) for n in big}
    worst = min(big, key=lambda n: ratio[n])
    sizes = ", ".join(f"{_mib(layout, n)} {ratio[n]:.2f}" for n in big)
    detail = f"lowest {ratio[worst]:.2f}x at {_mib(layout, worst)} ({sizes})"
    return Target(title, _judge(ratio[worst] >= TCP_RATIO), detail)


def _same_host_target(result: Result) -> Target:
    layout = result.layout
    title = f"nixl-shm >= {SAME_HOST_RATIO}x memcpy at {CHECK_MIB:.0f} MiB (digests off)"
    shm, memcpy = _case(result, "nixl-shm", False), result.get("memcpy")
    if shm is None:
        return Target(title, "not measured", _why_missing(result, "nixl-shm"))
    if memcpy is None:
        return Target(title, "not measured", "no memcpy reference in this result")
    n, size = check_size(result)
    a, b = shm.gbps(n, layout), memcpy.gbps(n, layout)
    detail = f"{a / b:.2f}x at {size}: {a:.2f} vs {b:.2f} GB/s"
    return Target(title, _judge(a / b >= SAME_HOST_RATIO), detail)


def _digest_targets(result: Result) -> list[Target]:
    layout, out = result.layout, []
    n, size = check_size(result)
    for off in result.series:
        if off.path == "reference" or off.baseline or off.integrity is not False:
            continue
        if (on := _case(result, off.name, True)) is None:
            continue
        ratio = on.gbps(n, layout) / off.gbps(n, layout)
        out.append(
            Target(
                f"digests on >= {DIGEST_RATIO}x digests off at {CHECK_MIB:.0f} MiB ({off.name})",
                _judge(ratio >= DIGEST_RATIO),
                f"{ratio:.2f}x at {size}: {on.gbps(n, layout):.2f} vs "
                f"{off.gbps(n, layout):.2f} GB/s",
            )
        )
    if not out:
        out.append(
            Target(
                f"digests on >= {DIGEST_RATIO}x digests off at {CHECK_MIB:.0f} MiB",
                "not measured",
                "no case was measured with digests both off and on (--integrity both)",
            )
        )
    return out


def check_targets(result: Result) -> list[Target]:
    """Evaluate the targets (see the module docstring) on ``result``: the fixed costs (and the
    other cases' as info), tcp vs raw socket, nixl-shm vs memcpy, digests on vs off per case,
    then the mapped hand-offs (only with --tp-pairs)."""
    layout = result.layout
    targets = _fixed_cost_targets(result)
    targets += [_tcp_target(result), _same_host_target(result), *_digest_targets(result)]
    big = [n for n in result.blocks if n * block_bytes(layout) >= _MIB]
    for name, by_size in mapped_ratios(result).items():
        if name.endswith("+xxh3") or not big:
            continue
        highest = max(by_size[n] for n in big)
        targets.append(
            Target(
                f"mapped hand-off <= {MAPPED_RATIO}x unmapped ({name})",
                _judge(highest <= MAPPED_RATIO),
                f"highest time ratio {highest:.2f} over {len(big)} sizes >= 1 MiB",
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
        p50 = f"{s.p50(first) * 1e6:>18.0f}"
        if (fit := _fit(s, result.layout)) is None:
            lines.append(f"{s.name:<16}{'-':>9}{'-':>10}{p50}")
        else:
            lines.append(f"{s.name:<16}{fit.fixed_us:>9.0f}{fit.gbps:>10.2f}{p50}")
    return "\n".join(lines)


def format_targets(targets: list[Target]) -> str:
    lines = ["targets (digests off, except the digest targets):"]
    lines += [f"  [{t.status}] {t.name}: {t.detail}" for t in targets]
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
    print(
        "-tcp: UCX_TLS=tcp on loopback; -shm: UCX default transports (CMA / shared memory); "
        "+xxh3: integrity digests on"
    )
    print(format_table(result), end="\n\n")
    if mapped := format_mapped(result):
        print(mapped, end="\n\n")
    print(format_fits(result), end="\n\n")
    for name, why in result.skipped.items():
        print(f"skipped {name}: {why}")
    print(format_targets(check_targets(result)))


def run_from_args(args: argparse.Namespace) -> int:
    """Run with the parsed flags of ``pdserve bench transfer`` (``sizes_mib``, ``backends``,
    ``integrity``, ``min_seconds``, ``rounds``, ``tp_pairs``, ``profile``, ``profile_pulls``;
    see :mod:`pdserve.bench.bench_commands`) and print. ``backends`` None: the mode's default
    (:data:`DEFAULT_BACKENDS`; with ``profile``, :data:`PROFILE_BACKENDS`). Returns 0 when it
    ran (targets met or missed: they are reported, not an error), 1 when a profile failed, 2 for
    an unknown case name, a tensor parallel pair that does not split the layout's KV heads or
    fewer than one pull to profile."""
    layout = SMOLLM2_LAYOUT
    if getattr(args, "profile", False):
        return _profile_from_args(args)
    if args.sizes_mib:
        blocks = [max(1, math.ceil(m * _MIB / block_bytes(layout))) for m in args.sizes_mib]
    else:
        blocks = DEFAULT_BLOCKS
    try:
        cases = resolve_cases(args.backends or DEFAULT_BACKENDS)
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


def _profile_from_args(args: argparse.Namespace) -> int:
    """``--profile``: digests on only with ``--integrity on`` (the fixed-cost target is
    checked with them off)."""
    if args.profile_pulls < 1:
        print("pdserve bench transfer: --profile-pulls must be at least 1")
        return 2
    try:
        backends = profile_backends(args.backends or PROFILE_BACKENDS)
    except ValueError as exc:
        print(f"pdserve bench transfer: {exc}")
        return 2
    modes = integrity_settings(args.integrity)
    integrity = None if not modes else modes == [True]
    return run_profiles(backends, args.profile_pulls, integrity)


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
