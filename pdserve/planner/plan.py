"""``pdserve plan``: predict each candidate deployment's TTFT, ITL, throughput and goodput for a
workload with the simulator (:mod:`pdserve.planner.simulate`) and recommend one.

The recommendation, after DistServe's placement search (OSDI'24: the cheapest configuration
whose goodput meets the SLO attainment target): among the candidates whose share of requests
meeting every SLO is at least ``attainment``, the one with the fewest workers, ties broken by
the most goodput; when none meets it, the one with the most goodput per worker, flagged as
missing the target.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.planner.profile import Profile, ProfileError
from pdserve.planner.simulate import Deployment, LengthDist, Workload, simulate


@dataclass(frozen=True)
class Targets:
    """SLO targets, seconds (None: none), and the share of requests that must meet them."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None
    attainment: float = 0.9


def candidates(
    prefill: Iterable[int],
    decode: Iterable[int],
    chunks: Iterable[int],
    local_prefill: Iterable[int],
    *,
    max_workers: int | None = None,
    max_num_seqs: int = 32,
    cores: int | None = None,
    threads_per_worker: int | None = None,
) -> list[Deployment]:
    """Every combination (decode workers at least 1; at most ``max_workers`` in all)."""
    out = []
    for p, d, c, lp in itertools.product(prefill, decode, chunks, local_prefill):
        if d < 1 or (max_workers is not None and p + d > max_workers):
            continue
        out.append(Deployment(p, d, c, max_num_seqs, lp, cores, threads_per_worker))
    return out


def evaluate(
    profile: Profile, deployments: Sequence[Deployment], workload: Workload, targets: Targets
) -> list[dict[str, Any]]:
    """One row per deployment: the deployment and its predicted figures
    (:func:`pdserve.planner.simulate.simulate`)."""
    return [
        {
            "deployment": asdict(d),
            "label": d.label(),
            "workers": d.workers,
            **simulate(profile, d, workload, targets),
        }
        for d in deployments
    ]


def recommend(rows: Sequence[dict[str, Any]], targets: Targets) -> tuple[dict[str, Any], bool]:
    """The recommended row and whether it meets the attainment target (module docstring).
    Raises ValueError for no rows."""
    if not rows:
        raise ValueError("no candidate deployment")

    def goodput(r: dict[str, Any]) -> float:
        return float(r["goodput"]["requests_per_s"] or 0.0)

    meeting = [r for r in rows if r["goodput"]["fraction"] >= targets.attainment]
    if meeting:
        return min(meeting, key=lambda r: (r["workers"], -goodput(r))), True
    return max(rows, key=lambda r: goodput(r) / r["workers"]), False


def _f(v: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def format_table(rows: Sequence[dict[str, Any]], best: dict[str, Any] | None = None) -> str:
    """One line per candidate: predicted TTFT/ITL/TPOT p50 and p90 (ms), tokens/s, goodput."""
    head = (
        f"  {'deployment':<30} {'TTFT p50':>8} {'p90':>8} {'ITL p50':>8} {'p90':>7} "
        f"{'TPOT p50':>8} {'tok/s':>7} {'good%':>5} {'good/s':>6} {'util P/D':>9}"
    )
    lines = [head]
    for r in rows:
        u = r["utilization"]
        util = f"{u.get('prefill', 0):.2f}/{u.get('decode', 0):.2f}"
        mark = "*" if r is best else " "
        lines.append(
            f"{mark} {r['label']:<30} {_f(r['ttft_ms']['p50'], 8)} {_f(r['ttft_ms']['p90'], 8)} "
            f"{_f(r['itl_ms']['p50'], 8)} {_f(r['itl_ms']['p90'], 7)} "
            f"{_f(r['tpot_ms']['p50'], 8)} {_f(r['output_tokens_per_s'], 7)} "
            f"{_f(100 * r['goodput']['fraction'], 5, 0)} "
            f"{_f(r['goodput']['requests_per_s'], 6, 2)} {util:>9}"
        )
    return "\n".join(lines)


# --- the command line ------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    """``"2"`` -> [2]; ``"0:3"`` -> [0, 1, 2, 3]; ``"256,512"`` -> [256, 512]."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition(":")
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve plan``."""
    p.add_argument(
        "--profile",
        required=True,
        metavar="FILE",
        help="the profile `pdserve bench profile` wrote for this model and hardware",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--input-len",
        default="256",
        metavar="N|LO:HI",
        help="prompt tokens per request, fixed or uniform in LO:HI (default: 256)",
    )
    w.add_argument(
        "--output-len",
        default="64",
        metavar="N|LO:HI",
        help="output tokens per request, fixed or uniform in LO:HI (default: 64)",
    )
    load = w.add_mutually_exclusive_group()
    load.add_argument(
        "--request-rate",
        type=float,
        default=None,
        metavar="REQ_PER_S",
        help="Poisson arrivals at this rate (requests/s)",
    )
    load.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="a closed loop keeping this many requests in flight (default: 8 "
        "when no --request-rate)",
    )
    w.add_argument(
        "--num-requests",
        type=int,
        default=200,
        help="simulated requests per candidate (default: 200)",
    )
    w.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    s = p.add_argument_group("service-level objectives (goodput counts requests meeting all)")
    s.add_argument("--ttft-slo-ms", type=float, default=None, metavar="MS")
    s.add_argument("--tpot-slo-ms", type=float, default=None, metavar="MS")
    s.add_argument(
        "--itl-slo-ms",
        type=float,
        default=None,
        metavar="MS",
        help="target for each request's 90th-percentile inter-token gap",
    )
    s.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="share of requests that must meet every SLO (default: 0.9)",
    )
    c = p.add_argument_group("candidates (N, LO:HI or a,b,c)")
    c.add_argument(
        "--prefill",
        type=_ints,
        default=[0, 1, 2],
        metavar="SET",
        help="prefill worker counts (default: 0:2)",
    )
    c.add_argument(
        "--decode",
        type=_ints,
        default=[1, 2, 3],
        metavar="SET",
        help="decode worker counts (default: 1:3)",
    )
    c.add_argument(
        "--chunk",
        type=_ints,
        default=[512],
        metavar="SET",
        help="max_num_batched_tokens values (default: 512)",
    )
    c.add_argument(
        "--local-prefill-max-tokens",
        type=_ints,
        default=[0, 256],
        metavar="SET",
        help="conditional-disaggregation thresholds (default: 0,256)",
    )
    c.add_argument("--max-workers", type=int, default=None, help="at most this many workers")
    c.add_argument("--max-num-seqs", type=int, default=32, help="running sequences per worker")
    c.add_argument(
        "--cores",
        type=int,
        default=None,
        help="all workers share one host of this many cores (as `pdserve up` on "
        "this machine); default: each worker on hardware of its own",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write every row as JSON")


def run(args: argparse.Namespace) -> int:
    """``pdserve plan``: 0 with a recommendation meeting the targets, 1 when none meets them,
    2 for bad input (an unreadable profile, a bad length)."""
    try:
        profile = Profile.load(Path(args.profile))
        workload = Workload(
            LengthDist.parse(args.input_len),
            LengthDist.parse(args.output_len),
            num_requests=args.num_requests,
            request_rate=args.request_rate,
            concurrency=None if args.request_rate else (args.concurrency or 8),
            seed=args.seed,
        )
    except (ProfileError, ValueError) as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    ms = [
        None if v is None else v / 1e3
        for v in (args.ttft_slo_ms, args.tpot_slo_ms, args.itl_slo_ms)
    ]
    targets = Targets(ms[0], ms[1], ms[2], args.attainment)
    deps = candidates(
        args.prefill,
        args.decode,
        args.chunk,
        args.local_prefill_max_tokens,
        max_workers=args.max_workers,
        max_num_seqs=args.max_num_seqs,
        cores=args.cores,
    )
    if not deps:
        print(
            "plan: no candidate (every decode count is 0, or --max-workers excludes all)",
            file=sys.stderr,
        )
        return 2
    rows = evaluate(profile, deps, workload, targets)
    best, ok = recommend(rows, targets)
    load = (
        f"{workload.request_rate:g} req/s"
        if workload.request_rate
        else f"concurrency {workload.concurrency}"
    )
    print(
        f"plan: {profile.model} ({profile.meta.get('cpu', 'unknown hardware')}), prompts "
        f"{workload.input_len}, outputs {workload.output_len}, {load}, "
        f"{workload.num_requests} simulated requests per candidate"
    )
    print(format_table(rows, best))
    verdict = "meets" if ok else "MISSES"
    print(
        f"recommended: {best['label']} ({best['workers']} workers): {verdict} the "
        f"{100 * targets.attainment:.0f} % attainment target "
        f"({100 * best['goodput']['fraction']:.0f} % of requests meet every SLO)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "recommended": best["label"], "meets_target": ok}, indent=1)
            + "\n"
        )
    return 0 if ok else 1
