"""``pdserve bench plan-check``: the planner's predictions against real runs on this machine.

For each ``--configs`` deployment (``PxD``: prefill and decode workers, started as ``pdserve up``
would on this host: threads and KV memory split between them), one stack, then each
``--workloads`` (``IN:OUT``: prompt and output tokens) through it as ``pdserve bench serve``
drives it (streamed /v1/completions of fresh random token ids, a closed loop of
``--concurrency``, ``--num-requests`` requests, after a warm-up); the same workload simulated
with ``--profile`` (:func:`pdserve.planner.simulate.simulate`, the host's cores shared as here).
With a prefill worker every prompt takes the hand-off (``router.local_prefill_max_tokens`` 0);
without one the decode worker prefills. Prints predicted and measured TTFT, ITL and TPOT p50,
output tokens/s and the error of each prediction; ``--json`` keeps every row.

Benchmark code only: the serving path never imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig

DESCRIPTION = """\
The planner's predictions (pdserve plan) against real runs here: for each --configs deployment
(PxD workers, sized as `pdserve up` sizes them on this host) one stack, each --workloads
(IN:OUT tokens) through it as a closed loop of --concurrency, and the same workload simulated
with --profile. Prints predicted and measured TTFT, ITL and TPOT p50, tokens/s and the errors.
"""
"""The ``pdserve bench plan-check --help`` text."""
HELP = "the planner's predicted TTFT/ITL against real runs of several P:D splits here"
"""The one line ``pdserve bench --help`` lists."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench plan-check``."""
    p.add_argument(
        "--profile",
        required=True,
        metavar="FILE",
        help="the `pdserve bench profile` file of this model on this machine",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=["0x1", "1x1", "1x2"],
        metavar="PxD",
        help="prefill x decode workers (default: 0x1 1x1 1x2)",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["128:64", "1536:16", "128:256"],
        metavar="IN:OUT",
        help="prompt:output tokens (default: short chat 128:64, "
        "long prompt 1536:16, long answer 128:256)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default: 4)")
    p.add_argument(
        "--num-requests", type=int, default=16, help="requests per workload (default: 16)"
    )
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    p.add_argument(
        "--measured",
        default=None,
        metavar="FILE",
        help="start nothing: predict again for the measured rows of an earlier --json "
        "(after a change to the profile or the simulation)",
    )


def _pairs(items: list[str], sep: str) -> list[tuple[int, int]]:
    out = []
    for item in items:
        a, _, b = item.lower().partition(sep)
        out.append((int(a), int(b)))
    return out


async def _measure(
    url: str,
    headers: dict[str, str],
    model: str,
    inp: int,
    out: int,
    args: argparse.Namespace,
    rng: random.Random,
) -> dict[str, Any]:
    import httpx

    from pdserve.bench.serving import bench_serve as bs

    def prompt() -> list[int]:
        return [rng.randrange(100, 10100) for _ in range(inp)]

    n = args.concurrency + 4
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(900, connect=30),
        headers=headers,
        limits=httpx.Limits(max_connections=n),
    ) as client:

        def one(ids: list[int]) -> Any:
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": out,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            return bs.stream_openai(client, f"{url}/v1/completions", body, kind="completions")

        warm = await one(prompt())
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        results, wall = await bs.run_level(
            one, [prompt() for _ in range(args.num_requests)], args.concurrency
        )
        return bs.summarize(results, wall, args.concurrency, expect_output=out)


def _err(pred: float | None, real: float | None) -> float | None:
    return None if pred is None or not real else (pred - real) / real


def run(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """Every config x workload; 0, 1 when a level failed, 2 for bad options."""
    from pdserve.bench.bench import READY_TIMEOUT_S, bench_stack, stack_settings
    from pdserve.hardware import cpu_model
    from pdserve.models import resolve_model
    from pdserve.planner.profile import Profile, ProfileError
    from pdserve.planner.simulate import Deployment

    try:
        profile = Profile.load(Path(args.profile))
        configs, workloads = _pairs(args.configs, "x"), _pairs(args.workloads, ":")
        earlier = json.loads(Path(args.measured).read_text()) if args.measured else None
    except (ProfileError, ValueError, OSError) as exc:
        print(f"bench plan-check: {exc}", file=sys.stderr)
        return 2
    if earlier is not None:
        return _predict_again(earlier, profile, args)
    model_path = resolve_model(
        str(cfg.model.path) if cfg.model.path else None, cache_dir=cfg.model.cache_dir
    )
    cores = os.cpu_count() or 1
    logs = Path(tempfile.mkdtemp(prefix="pdserve-plan-check-"))
    print(
        f"bench plan-check: {model_path.name} on {cpu_model()} ({cores} cores), profile "
        f"{args.profile}; concurrency {args.concurrency}, {args.num_requests} requests per "
        f"workload; logs in {logs}",
        flush=True,
    )
    rows, rc = [], 0
    rng = random.Random(args.seed)
    for p, d in configs:
        settings = stack_settings(cfg, model_path, {"prefill": p, "decode": d})
        local = 0 if p else 1 << 30
        router = {"router": ["--local-prefill-max-tokens", str(local)]}
        with bench_stack(settings, logs / f"{p}x{d}", args=router) as stack:
            stack.start()
            stack.wait_ready(READY_TIMEOUT_S, what=f"the {p}P+{d}D stack")
            model = str(stack.settings.model.served_name)
            for inp, out in workloads:
                real = asyncio.run(
                    _measure(stack.url, stack.api_headers(), model, inp, out, args, rng)
                )
                rc |= int(real["completed"] == 0)
                dep = Deployment(
                    p,
                    d,
                    settings.scheduler.max_num_batched_tokens,
                    settings.scheduler.max_num_seqs,
                    local,
                    cores,
                )
                row = {
                    "config": f"{p}P+{d}D",
                    "workload": f"{inp}:{out}",
                    "deployment": asdict(dep),
                    "concurrency": args.concurrency,
                    "num_requests": args.num_requests,
                    "predicted": _predict(
                        profile, dep, inp, out, args.concurrency, args.num_requests
                    ),
                    "measured": real,
                }
                rows.append(row)
                print(_line(row), flush=True)
    print("\n" + _table(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_model(), "cores": cores, "rows": rows}, indent=1) + "\n"
        )
        print(f"wrote {args.json}")
    return rc


def _predict(
    profile: Any, dep: Any, inp: int, out: int, concurrency: int, num_requests: int
) -> dict[str, Any]:
    from pdserve.planner.simulate import LengthDist, Workload, simulate

    wl = Workload(LengthDist(inp, inp), LengthDist(out, out), num_requests, concurrency=concurrency)
    return simulate(profile, dep, wl)


def _predict_again(earlier: dict[str, Any], profile: Any, args: argparse.Namespace) -> int:
    """``--measured``: the earlier rows with fresh predictions; the table, ``--json``."""
    from pdserve.planner.simulate import Deployment

    rows = []
    for row in earlier["rows"]:
        inp, out = (int(x) for x in row["workload"].split(":"))
        if "deployment" in row:
            dep = Deployment(**row["deployment"])
        else:  # a report from before rows kept their deployment: this command's defaults
            p, d = (int(x) for x in row["config"].rstrip("D").split("P+"))
            dep = Deployment(p, d, 512, 32, 0 if p else 1 << 30, int(earlier["cores"]))
        conc = int(row.get("concurrency", args.concurrency))
        n = int(row.get("num_requests", args.num_requests))
        rows.append(
            {
                **row,
                "deployment": asdict(dep),
                "concurrency": conc,
                "num_requests": n,
                "predicted": _predict(profile, dep, inp, out, conc, n),
            }
        )
    print(
        f"bench plan-check: predictions again for the measurements of {args.measured} "
        f"({earlier.get('cpu')}, {earlier.get('cores')} cores)"
    )
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({**earlier, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _vals(row: dict[str, Any]) -> list[tuple[str, float | None, float | None]]:
    p, m = row["predicted"], row["measured"]
    return [(k, p[f"{k}_ms"]["p50"], m[f"{k}_ms"]["p50"]) for k in ("ttft", "itl", "tpot")] + [
        ("tok/s", p["output_tokens_per_s"], m["output_tokens_per_s"])
    ]


def _line(row: dict[str, Any]) -> str:
    parts = [f"{k} {pv or 0:.1f}/{mv or 0:.1f}" for k, pv, mv in _vals(row)]
    return f"{row['config']} {row['workload']}: predicted/measured " + ", ".join(parts)


def _table(rows: list[dict[str, Any]]) -> str:
    """Markdown: predicted / measured and the error of each figure."""
    head = (
        "| config | workload | TTFT p50 ms pred / real | err | ITL p50 ms pred / real | err "
        "| TPOT p50 ms pred / real | err | tok/s pred / real | err |"
    )
    lines = [head, "|" + "---|" * 10]
    for row in rows:
        cells = [row["config"], row["workload"]]
        for _, pv, mv in _vals(row):
            e = _err(pv, mv)
            cells += [f"{pv or 0:.1f} / {mv or 0:.1f}", "-" if e is None else f"{100 * e:+.0f} %"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
