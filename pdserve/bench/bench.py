"""Benchmarks that print numbers: ``pdserve bench serve`` and ``pdserve bench transfer``.

``serve --url http://HOST:PORT/v1`` drives an already running OpenAI-compatible server (pdserve,
vLLM, ...) with a fixed-seed synthetic chat workload (:mod:`pdserve.bench.serving.bench_serve`).

``serve`` without ``--url`` starts pdserve itself and compares (a) the disaggregated stack
(router -> prefill worker -> KV transfer -> decode worker, requests through the router's
``/v1/completions``) with (b) the same model colocated in one worker process (prefill and decode
in one engine, requests sent straight to its ``/internal/generate``), at each concurrency level,
on the same token-id prompts, in one run. Both get the same CPU budget: the disaggregated stack
runs each worker on half the cores, the colocated worker on all of them.

Both modes report, per level, TTFT, ITL, TPOT and e2e latency (mean, p50, p90, p99 in ms),
output tokens/s and request errors; the definitions are in :mod:`pdserve.bench.serving.bench_serve`.
``--plot PATH.png`` draws the runs (:mod:`pdserve.bench.bench_plot`).
Importing this module is light (no httpx, no torch); the CLI builds the two commands' options
from :mod:`pdserve.bench.bench_options`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig
    from pdserve.launch.stack import Stack


def serve_main(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """``pdserve bench serve``: the ``--url`` mode, or start pdserve with ``cfg`` (the resolved
    settings: ``--config``, ``PDSERVE_*`` variables, setting flags) and compare. With
    ``--plot``, matplotlib and the ``--plot-with`` reports are checked first (exit 2), so that a
    picture that cannot be drawn costs no run."""
    from pdserve.bench.bench_plot import PlotError
    from pdserve.bench.serving.bench_serve import check_load_arguments

    if problem := check_load_arguments(args):
        print(f"bench serve: {problem}", file=sys.stderr)
        return 2
    try:
        earlier = _plot_inputs(args)
    except PlotError as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    if args.url:
        return url_main(args, earlier)
    if args.json_schema:
        print("bench serve: --json-schema needs --url (a running server)", file=sys.stderr)
        return 2
    from pdserve.models import resolve_model

    path = args.model or (str(cfg.model.path) if cfg.model.path is not None else None)
    return compare_main(args, cfg, resolve_model(path, cache_dir=cfg.model.cache_dir), earlier)


def _workload(args: argparse.Namespace, api: str) -> dict[str, Any]:
    from pdserve.bench.serving.bench_serve import slo_from_args

    return {
        "api": api,
        "stream": True,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "temperature": 0,
        "warmup": args.warmup,
        "concurrency": None if args.request_rate else list(args.concurrency),
        "request_rate": args.request_rate,
        "num_requests": args.num_requests,
        "slo": slo_from_args(args).as_ms(),
    }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _report(
    args: argparse.Namespace, api: str, runs: list[dict[str, Any]], started: str
) -> dict[str, Any]:
    return {
        "tool": "pdserve bench serve",
        "label": args.label,
        "started": started,
        "finished": _now(),
        "host": {"cpus": os.cpu_count()},
        "workload": _workload(args, api),
        "runs": runs,
    }


def _plot_inputs(args: argparse.Namespace) -> list[Any]:
    """The runs of the ``--plot-with`` reports (:class:`pdserve.bench.bench_plot.RunSamples`);
    raises PlotError when ``--plot`` cannot be drawn (no matplotlib, not a .png, a report that
    cannot be read or holds no samples)."""
    from pdserve.bench.bench_plot import PlotError, require_matplotlib, runs_from_report

    plot, extra = args.plot, args.plot_with
    if extra and not plot:
        raise PlotError("--plot-with needs --plot PATH.png")
    if not plot:
        return []
    if args.request_rate:
        raise PlotError("--plot draws concurrency levels; it does not take --request-rate")
    if Path(plot).suffix.lower() != ".png":
        raise PlotError(f"--plot {plot}: the picture is a PNG; give a path ending in .png")
    require_matplotlib()
    runs: list[Any] = []
    for name in extra:
        try:
            report = json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            raise PlotError(f"--plot-with {name}: {exc}") from exc
        runs += runs_from_report(report, name)
    return runs


def _write_plot(
    args: argparse.Namespace, earlier: Sequence[Any], runs: list[dict[str, Any]], what: str
) -> int:
    """Draw ``--plot`` (when given): the ``earlier`` runs (``--plot-with``'s), then ``runs`` (the
    report's); ``what`` heads the title. Returns 0, or 1 when the PNG cannot be written."""
    if not args.plot:
        return 0
    from pdserve.bench.bench_plot import PlotError, runs_from_report, write_plot
    from pdserve.hardware import cpu_model

    title = f"pdserve bench serve: {what}; {cpu_model()}, {os.cpu_count()} cores"
    try:
        ours = runs_from_report({"runs": runs})
        path = write_plot([*earlier, *ours], Path(args.plot), title)
    except (PlotError, OSError, ValueError) as exc:
        print(f"bench serve: --plot {args.plot}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def _counts(args: argparse.Namespace) -> list[int]:
    from pdserve.bench.serving.bench_serve import default_num_requests

    if args.request_rate:
        return [args.num_requests or max(16, math.ceil(10 * r)) for r in args.request_rate]
    return [args.num_requests or default_num_requests(c) for c in args.concurrency]


def _client(args: argparse.Namespace, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    import httpx

    # the open loop may have every request of a level in flight
    n = (max(_counts(args)) if args.request_rate else max(args.concurrency)) + 4
    return httpx.AsyncClient(
        timeout=httpx.Timeout(args.request_timeout_s, connect=30),
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        headers=headers,
    )


async def _levels(
    args: argparse.Namespace,
    one: Callable[[Any], Awaitable[Any]],
    warm: list[Any],
    prompts: list[list[Any]],
    label: str | None,
) -> dict[str, Any]:
    """Warm-up, then each concurrency level; prints each level as it ends. Returns a run's
    ``levels`` (summaries) and ``samples`` (raw TTFT and ITL seconds, for ``--plot``)."""
    from pdserve.bench.bench_plot import level_samples_json
    from pdserve.bench.serving import bench_serve as bs

    for item in warm:
        w = await one(item)
        if not w.ok:
            raise RuntimeError(f"warm-up request failed: {w.error}")
    out: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    expect = args.output_len if args.ignore_eos and args.output_len > 0 else None
    slo = bs.slo_from_args(args)
    if args.request_rate:
        for i, (rate, items) in enumerate(zip(args.request_rate, prompts, strict=True)):
            results, wall = await bs.run_rate(one, items, rate, seed=args.seed + i)
            out.append(bs.summarize(results, wall, None, expect, slo, request_rate=rate))
            print(bs.format_level(out[-1], label), flush=True)
        return {"levels": out, "samples": samples}
    for c, items in zip(args.concurrency, prompts, strict=True):
        results, wall = await bs.run_level(one, items, c)
        out.append(bs.summarize(results, wall, c, expect_output=expect, slo=slo))
        samples.append(level_samples_json(results, c))
        print(bs.format_level(out[-1], label), flush=True)
    return {"levels": out, "samples": samples}


def url_main(args: argparse.Namespace, earlier: Sequence[Any] = ()) -> int:
    """``--url`` mode: print each level, a summary table, write ``--json`` and ``--plot`` (with
    the ``earlier`` runs of ``--plot-with``). Returns 0, or 1 when the warm-up or every request
    of some level failed or the picture could not be written."""
    import httpx

    from pdserve.bench.serving import bench_serve as bs

    base = bs.base_url(args.url)
    tok_path = (
        Path(args.tokenizer).expanduser()
        if args.tokenizer
        else bs.default_tokenizer(args.model, getattr(args, "model.cache_dir", None))
    )
    if not (tok_path / "tokenizer_config.json").is_file():
        print(
            f"bench serve: no tokenizer in {tok_path}: pass --tokenizer PATH (a Hugging Face "
            "model folder) or run `pdserve model prepare`",
            file=sys.stderr,
        )
        return 2
    started = _now()
    if args.prompt_file:
        lines = [x.strip() for x in Path(args.prompt_file).read_text().splitlines() if x.strip()]
        if not lines:
            print(f"bench serve: {args.prompt_file} holds no prompt", file=sys.stderr)
            return 2
        pool = itertools.cycle(lines)
        warm = [next(pool) for _ in range(args.warmup)]
        prompts = [[next(pool) for _ in range(n)] for n in _counts(args)]
    else:
        maker = bs.PromptMaker(bs.load_tokenizer(tok_path), args.seed)
        warm = [maker.make(args.input_len) for _ in range(args.warmup)]
        prompts = [[maker.make(args.input_len) for _ in range(n)] for n in _counts(args)]
    print(
        f"bench serve{' ' + args.label if args.label else ''}: {base}, chat, "
        f"input {args.input_len} tokens, output {args.output_len} tokens, "
        f"ignore_eos {args.ignore_eos}, seed {args.seed}",
        flush=True,
    )

    async def main() -> tuple[str, dict[str, Any]]:
        async with _client(args) as client:
            model = args.model or await bs.served_model(client, base)
            url = f"{base}/chat/completions"

            def one(prompt: str) -> Awaitable[bs.RequestResult]:
                body = bs.chat_body(model, prompt, args.output_len, args.ignore_eos)
                if args.json_schema:  # the grammar's cost: output constrained, about as long
                    from pdserve.bench.serving.bench_structured import long_schema

                    schema = long_schema(max(8, 3 * args.output_len))
                    body["response_format"] = {
                        "type": "json_schema",
                        "json_schema": {"name": "story", "schema": schema},
                    }
                    body.pop("ignore_eos", None)  # the grammar ends the output
                    body["max_tokens"] = 2 * max(args.output_len, 1)
                return bs.stream_openai(client, url, body)

            return model, await _levels(args, one, warm, prompts, args.label)

    try:
        model, measured = asyncio.run(main())
    except (RuntimeError, httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"bench serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    levels = measured["levels"]
    print(bs.format_summary(levels, args.label))
    run = {"label": args.label, "url": base, "model": model, **measured}
    if args.json:
        bs.write_json(
            Path(args.json), {**_report(args, "chat", [run], started), "tokenizer": str(tok_path)}
        )
        print(f"wrote {args.json}")
    prompts_what = (
        f"prompts from {args.prompt_file}"
        if args.prompt_file
        else f"{args.input_len}-token prompts"
    )
    rc = _write_plot(
        args, earlier, [run], f"{model}, {prompts_what}, {args.output_len} output tokens"
    )
    return 1 if any(lv["completed"] == 0 for lv in levels) else rc


# --- without --url: start pdserve, disaggregated vs colocated ------------------------------------

GRACE_S = 15.0
"""Seconds a stopping benchmark process gets after SIGTERM before SIGKILL."""
READY_TIMEOUT_S = 300.0
"""Seconds a benchmark stack may take to become ready (model load and compile included)."""


def stack_settings(
    cfg: PdserveConfig, model_path: Path, workers: Mapping[str, int]
) -> PdserveConfig:
    """The settings of a benchmark stack on this machine: ``workers[role]`` workers of each role
    (a role left out: none), resolved as ``pdserve up`` resolves them
    (:func:`pdserve.launch.launcher.child_config`: threads and KV memory split between the workers,
    model pinned, UCX on loopback), the router and its registry on free ports (``router.port``
    0, no ``router.registry_port`` nor ``router.url``), every other setting from ``cfg``."""
    from pdserve.config.settings import ROLES
    from pdserve.launch.launcher import child_config
    from pdserve.launch.stack import with_replicas

    sized = with_replicas(cfg, {role: workers.get(role, 0) for role in ROLES})
    child = child_config(sized, model_path)
    router = child.router.model_copy(update={"port": 0, "registry_port": None, "url": None})
    return child.model_copy(update={"router": router})


def bench_stack(
    settings: PdserveConfig,
    log_dir: Path,
    *,
    args: Mapping[str, Sequence[str]] | None = None,
    grace_s: float = GRACE_S,
) -> Stack:
    """A benchmark's :class:`pdserve.launch.stack.Stack` of ``settings`` (:func:`stack_settings`):
    every child in its own session, logging at ``warning`` into ``log_dir/<name>.log``, its
    secrets in a private temporary folder removed at the end; ``args`` as the stack takes them
    (by role or process name)."""
    from pdserve.launch.stack import Stack, StackSpec

    spec = StackSpec(
        settings,
        log_dir=log_dir,
        log_level="warning",
        args=args or {},
        new_session=True,
        grace_s=grace_s,
    )
    return Stack(spec)


async def _one_colocated(client, url: str, ids: list[int], args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """One request to a colocated worker's NDJSON ``/internal/generate``; a stamp per chunk."""
    import httpx

    from pdserve.bench.serving.bench_serve import failed, from_stamps

    body = {
        "request_id": uuid.uuid4().hex,
        "prompt_token_ids": ids,
        "sampling": {
            "max_tokens": args.output_len,
            "temperature": 0,
            "ignore_eos": args.ignore_eos,
        },
        "deadline": time.time() + args.request_timeout_s,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/internal/generate", json=body) as r:
            if r.status_code != 200:
                return failed(t0, f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line:
                    chunk = json.loads(line)
                    if chunk.get("error"):
                        return failed(t0, str(chunk["error"]))
                    if chunk.get("token_ids"):
                        stamps.append(time.perf_counter())
                        tokens += len(chunk["token_ids"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return failed(t0, f"{type(exc).__name__}: {exc}")
    return from_stamps(t0, stamps, time.perf_counter(), tokens, len(ids))


def _token_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    # Random token-id prompts (ids 100..10099 are ordinary tokens in SmolLM2's vocabulary).
    return [[rng.randrange(100, 10100) for _ in range(length)] for _ in range(n)]


def compare_main(
    args: argparse.Namespace, cfg: PdserveConfig, model_path: Path, earlier: Sequence[Any] = ()
) -> int:
    """Start the disaggregated stack, then a colocated worker (each on its share of this
    machine, every other setting from ``cfg``); the same prompts through both; ``--json`` and
    ``--plot`` (with the ``earlier`` runs of ``--plot-with``) at the end. Each stack's
    secrets and config file live in a private temporary folder, deleted when it stops; the
    logs stay in a temporary folder printed at the end. Raises ConfigError (an unreadable API key file),
    ProcessExitedError or ReadyTimeoutError when a stack does not start."""
    from pdserve.bench.serving import bench_serve as bs
    from pdserve.config.hosts import free_port

    cores = os.cpu_count() or 2
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    rng = random.Random(args.seed)
    warm = _token_prompts(rng, args.warmup, args.input_len)
    prompts = [_token_prompts(rng, n, args.input_len) for n in _counts(args)]
    runs: list[dict[str, Any]] = []
    started = _now()
    name = ""

    def measure(label: str, url: str, one_fn, headers: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
        async def main() -> dict[str, Any]:
            async with _client(args, headers) as client:
                return await _levels(args, lambda ids: one_fn(client, ids), warm, prompts, label)

        runs.append({"label": label, "url": url, "model": name, **asyncio.run(main())})

    def openai_one(client, ids: list[int]):  # type: ignore[no-untyped-def]
        body = {
            "model": name,
            "prompt": ids,
            "max_tokens": args.output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": args.ignore_eos,
        }
        return bs.stream_openai(client, f"{url}/v1/completions", body, kind="completions")

    # local prefill off: every request of this arm takes the prefill -> decode hand-off
    disagg = stack_settings(cfg, model_path, {"prefill": 1, "decode": 1})
    router = {"router": ["--local-prefill-max-tokens", "0"]}
    with bench_stack(disagg, logs / "disaggregated", args=router) as stack:
        stack.start()
        stack.wait_ready(READY_TIMEOUT_S, what="the disaggregated stack")
        name, url = str(stack.settings.model.served_name), stack.url
        # Requests to the router carry a client API key when any is set.
        measure("disaggregated", url, openai_one, stack.api_headers())

    # Requests to the colocated worker's /internal/generate: the cluster secret's token.
    port = free_port()
    coloc = f"http://127.0.0.1:{port}"
    coloc_cfg = stack_settings(cfg, model_path, {"colocated": 1})
    with bench_stack(
        coloc_cfg, logs / "colocated", args={"colocated": ["--port", str(port)]}
    ) as stack:
        stack.start()
        stack.wait_ready(READY_TIMEOUT_S, what="the colocated worker")
        measure(
            "colocated",
            coloc,
            lambda client, ids: _one_colocated(client, coloc, ids, args),
            stack.cluster_key.http_headers(),
        )

    print(
        f"\nmodel {name}, {args.input_len}-token prompts, {args.output_len} output tokens, "
        f"{cores} cores"
    )
    for i, run in enumerate(runs):
        print(bs.format_summary(run["levels"], run["label"], header=i == 0))
    for d, o in zip(runs[0]["levels"], runs[1]["levels"], strict=True):
        t = [
            d[k]["p50"] / o[k]["p50"] if d[k]["p50"] and o[k]["p50"] else float("nan")
            for k in ("ttft_ms", "tpot_ms")
        ]
        print(
            f"{bs.level_name(d)}: disaggregated/colocated TTFT p50 x{t[0]:.2f}, "
            f"TPOT p50 x{t[1]:.2f}"
        )
    if args.json:
        bs.write_json(Path(args.json), _report(args, "completions token ids", runs, started))
        print(f"wrote {args.json}")
    print(f"logs: {logs}")
    what = (
        f"{name}, disaggregated vs colocated, {args.input_len}-token prompts, "
        f"{args.output_len} output tokens"
    )
    return _write_plot(args, earlier, runs, what)


def transfer_main(args: argparse.Namespace) -> int:
    """KV transfer per backend beside raw-socket and memcpy references, with fits and the
    the targets (:mod:`pdserve.bench.transfer.bench_transfer`,
    :mod:`pdserve.bench.transfer.bench_transfer_report`)."""
    from pdserve.bench.transfer.bench_transfer_report import run_from_args

    return run_from_args(args)
