"""``pdserve bench autoscale``: ``pdserve up --autoscale`` against a fixed deployment sized for
the peak, under a load that steps from low to high and back.

Two arms, one after the other, each a stack of the configured model on this machine:

- **fixed**: ``--fixed PxD`` workers (default the planner's maximum), all the time;
- **autoscale**: the planner (:mod:`pdserve.planner.autoscale`, ``--planner-profile`` and the
  other ``planner.*`` settings) starting from its minimum and starting and draining workers as
  ``pdserve up --autoscale`` does (:mod:`pdserve.planner.local`).

Each arm gets the same load (``--phases C:SECONDS ...``, default ``1:120 8:120 1:120``): a
closed loop of C streamed /v1/completions of fresh random token ids (``--input-len``,
``--output-len``, ignore_eos) for that long, requests in flight at a phase's end finishing in
it. Reported per arm and phase: requests, failures, goodput (requests within
``planner.ttft_slo_ms`` and ``planner.itl_slo_ms``, as ``bench serve``'s ``Slo``: TTFT and the
request's ITL p90), TTFT and ITL p50/p90; per arm the worker-seconds (workers alive, counted
every second) and each scaling event with its time.

Benchmark code only: the serving path never imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig

DESCRIPTION = """\
pdserve up --autoscale against a fixed deployment sized for the peak: the same stepped load
(--phases C:SECONDS, default 1:120 8:120 1:120, closed loops of C streams) through each; per
phase requests, failures, goodput within planner.ttft_slo_ms / planner.itl_slo_ms, TTFT and ITL
p50/p90; per arm worker-seconds and the scaling events. Planner settings from --config and
PDSERVE_PLANNER__* (its profile: --planner-profile through the config or environment).
"""
"""The ``pdserve bench autoscale --help`` text."""
HELP = "up --autoscale vs a fixed peak deployment under a stepped load: goodput, worker-seconds"
"""The one line ``pdserve bench --help`` lists."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench autoscale``."""
    p.add_argument(
        "--phases",
        nargs="+",
        default=["1:120", "8:120", "1:120"],
        metavar="C:S",
        help="concurrency:seconds, in order (default: 1:120 8:120 1:120)",
    )
    p.add_argument("--input-len", type=int, default=384, help="prompt tokens (default: 384)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    p.add_argument(
        "--fixed",
        default=None,
        metavar="PxD",
        help="the fixed arm's workers (default: the planner's maxima)",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        choices=["fixed", "autoscale"],
        default=["fixed", "autoscale"],
        help="arms to run (default: both)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


async def _phases(
    url: str,
    headers: dict[str, str],
    model: str,
    args: argparse.Namespace,
    phases: list[tuple[int, float]],
) -> list[list[Any]]:
    """The results of each phase's requests (closed loops until the phase's deadline)."""
    import httpx

    from pdserve.bench.serving import bench_serve as bs

    rng = random.Random(args.seed)
    top = max(c for c, _ in phases) + 4
    out: list[list[Any]] = []
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(900, connect=30),
        headers=headers,
        limits=httpx.Limits(max_connections=top),
    ) as client:

        async def one() -> Any:
            ids = [rng.randrange(100, 10100) for _ in range(args.input_len)]
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": args.output_len,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            return await bs.stream_openai(client, f"{url}/v1/completions", body, "completions")

        await one()  # warm-up
        for c, seconds in phases:
            deadline = time.monotonic() + seconds
            results: list[Any] = []

            async def loop(until: float, into: list[Any]) -> None:
                while time.monotonic() < until:
                    into.append(await one())

            await asyncio.gather(*(loop(deadline, results) for _ in range(c)))
            out.append(results)
            print(
                f"  phase c={c} {seconds:g} s: {len(results)} requests, "
                f"{sum(not r.ok for r in results)} failed",
                flush=True,
            )
    return out


def _summary(results: list[Any], slo: Any) -> dict[str, Any]:
    from pdserve.bench.serving import bench_serve as bs

    ok = [r for r in results if r.ok]
    good = sum(slo.met(r) for r in results)

    def pct(values: list[float], q: float) -> float | None:
        v = bs.percentile(values, q)
        return None if v is None else 1e3 * v

    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "good": good,
        "goodput_fraction": good / len(results) if results else None,
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90)},
        "itl_ms": {"p50": pct(itl, 50), "p90": pct(itl, 90)},
        "first_error": next((r.error for r in results if not r.ok), None),
    }


class _NoteHandler(logging.Handler):
    """The planner's decision lines (logged at info when the counts change) as events."""

    def __init__(self, note: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.note = note

    def emit(self, record: logging.LogRecord) -> None:
        self.note(record.getMessage())


def _arm(
    name: str,
    cfg: PdserveConfig,
    model_path: Path,
    counts: dict[str, int],
    args: argparse.Namespace,
    phases: list[tuple[int, float]],
    logs: Path,
    autoscale: bool,
) -> dict[str, Any]:
    """One arm: start the stack, drive the phases, count worker-seconds."""
    from pdserve.bench.bench import READY_TIMEOUT_S, bench_stack, stack_settings
    from pdserve.bench.serving.bench_serve import slo_from_args
    from pdserve.launch.stack import with_replicas
    from pdserve.launch.supervisor import RestartPolicy
    from pdserve.planner.local import LocalActuator, start_autoscaler
    from pdserve.planner.profile import Profile

    # sized for the planner's maximum in both arms: the same threads and KV share per worker
    p = cfg.planner
    peak = {"prefill": p.max_prefill, "decode": p.max_decode}
    settings = with_replicas(stack_settings(cfg, model_path, peak), counts)
    events: list[str] = []
    t0 = time.monotonic()

    def note(line: str) -> None:
        events.append(f"{time.monotonic() - t0:6.1f} s {line}")
        print(f"  {events[-1]}", flush=True)

    with bench_stack(settings, logs / name) as stack:
        stack.start()
        stack.wait_ready(READY_TIMEOUT_S, what=f"the {name} stack")
        stopping = threading.Event()
        actuator: LocalActuator | None = None
        loop = None
        decisions = _NoteHandler(note)
        planner_log = logging.getLogger("pdserve.planner")
        if autoscale:
            planner_log.addHandler(decisions)
            planner_log.setLevel(logging.INFO)
            profile = Profile.load(p.profile) if p.profile else None
            loop, actuator = start_autoscaler(
                settings.model_copy(update={"planner": p.model_copy(update={"port": 0})}),
                stack,
                profile,
                note,
            )
        tick: Callable[[], None] | None = actuator.tick if actuator else None
        current = actuator.current if actuator else (lambda: dict(counts))
        samples: list[int] = []
        watcher = threading.Thread(
            target=stack.supervisor.watch,
            args=(stopping.is_set, RestartPolicy(), tick),
            daemon=True,
        )
        watcher.start()
        sampler_stop = threading.Event()

        def sample() -> None:
            while not sampler_stop.wait(1.0):
                samples.append(sum(current().values()))

        sampler = threading.Thread(target=sample, daemon=True)
        t0 = time.monotonic()
        sampler.start()
        try:
            model = str(settings.model.served_name)
            per_phase = asyncio.run(_phases(stack.url, stack.api_headers(), model, args, phases))
        finally:
            sampler_stop.set()
            planner_log.removeHandler(decisions)
            if loop is not None:
                loop.stop()
            stopping.set()
            watcher.join(30)
    slo = slo_from_args(
        argparse.Namespace(ttft_slo_ms=p.ttft_slo_ms, tpot_slo_ms=None, itl_slo_ms=p.itl_slo_ms)
    )
    every = [r for rs in per_phase for r in rs]
    return {
        "arm": name,
        "start": counts,
        "worker_seconds": float(sum(samples)),
        "wall_s": float(len(samples)),
        "events": events,
        "total": _summary(every, slo),
        "phases": [
            {"concurrency": c, "seconds": s, **_summary(rs, slo)}
            for (c, s), rs in zip(phases, per_phase, strict=True)
        ],
    }


def run(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """Both arms; 0, 1 when a request failed, 2 for bad options."""
    from pdserve.hardware import cpu_model
    from pdserve.models import resolve_model

    try:
        phases = [(int(c), float(s)) for c, s in (x.split(":") for x in args.phases)]
        p = cfg.planner
        fixed = (
            {"prefill": p.max_prefill, "decode": p.max_decode}
            if args.fixed is None
            else dict(
                zip(("prefill", "decode"), map(int, args.fixed.lower().split("x")), strict=True)
            )
        )
    except ValueError as exc:
        print(f"bench autoscale: --phases C:SECONDS, --fixed PxD: {exc}", file=sys.stderr)
        return 2
    model_path = resolve_model(
        str(cfg.model.path) if cfg.model.path else None, cache_dir=cfg.model.cache_dir
    )
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-autoscale-"))
    print(
        f"bench autoscale: {model_path.name} on {cpu_model()}; phases {args.phases}; "
        f"{args.input_len}+{args.output_len} tokens; SLO TTFT {p.ttft_slo_ms:g} ms, ITL p90 "
        f"{p.itl_slo_ms:g} ms; planner {p.min_prefill}..{p.max_prefill}P "
        f"{p.min_decode}..{p.max_decode}D, profile {p.profile}; logs {logs}",
        flush=True,
    )
    arms = []
    for name in args.arms:
        auto = name == "autoscale"
        start = {"prefill": p.min_prefill, "decode": p.min_decode} if auto else fixed
        print(f"{name}: starting {start['prefill']}P+{start['decode']}D", flush=True)
        arms.append(_arm(name, cfg, model_path, start, args, phases, logs, auto))
    print("\n" + format_table(arms))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_model(), "phases": args.phases, "arms": arms}, indent=1) + "\n"
        )
        print(f"wrote {args.json}")
    return 1 if any(a["total"]["failed"] for a in arms) else 0


def format_table(arms: list[dict[str, Any]]) -> str:
    """Markdown: one row per arm and phase, then the arm's total and worker-seconds."""
    lines = [
        "| arm | phase | requests | failed | goodput % | TTFT p50 / p90 ms | "
        "ITL p50 / p90 ms | worker-s |",
        "|" + "---|" * 8,
    ]

    def row(arm: str, what: str, s: dict[str, Any], ws: str) -> str:
        frac = s["goodput_fraction"]
        t, i = s["ttft_ms"], s["itl_ms"]
        return (
            f"| {arm} | {what} | {s['requests']} | {s['failed']} | "
            f"{'-' if frac is None else f'{100 * frac:.0f}'} | "
            f"{t['p50'] or 0:.0f} / {t['p90'] or 0:.0f} | {i['p50'] or 0:.1f} / "
            f"{i['p90'] or 0:.1f} | {ws} |"
        )

    for a in arms:
        for ph in a["phases"]:
            lines.append(row(a["arm"], f"c={ph['concurrency']} {ph['seconds']:g} s", ph, ""))
        lines.append(row(a["arm"], "**all**", a["total"], f"{a['worker_seconds']:.0f}"))
    return "\n".join(lines)
