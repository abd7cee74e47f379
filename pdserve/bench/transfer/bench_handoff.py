"""``pdserve bench handoff``: the streamed hand-off against the whole-request hand-off.

Two stacks of router + 1 prefill + 1 decode worker (:func:`pdserve.bench.bench.stack_settings`,
started by :func:`pdserve.bench.bench.bench_stack`, settings from ``--config`` and ``PDSERVE_*``
variables, the transfer backend from ``--backend``), one with the whole-request hand-off (router
``--kv-stream-min-tokens 0``), one with the streamed hand-off for every prompt
(``--kv-stream-min-tokens 1``); both routers send every prompt through the prefill worker
(``--local-prefill-max-tokens 0``). Both stacks are up together (an idle stack takes about 2%
of one core) and the requests alternate between them, one at a time, so that both modes are
measured in the same minutes and neither always runs second. (Restarting only the router with
other flags would keep one set of workers, but they would have to notice the new router and
register again, and the modes could not alternate.)

On each stack, after ``--warmup`` uncounted requests, for each ``--prompt-tokens`` length,
``--requests`` streamed greedy ``/v1/completions`` requests (``max_tokens`` ``--max-tokens``,
``ignore_eos``, ``logprobs`` 0 so each chunk says how many tokens it carries); the i-th request
of each mode run back to back, whole first for even i, streamed first for odd i. Every prompt is
fresh random token ids (one seeded generator for the whole run, so no two requests share a
first block): the prefix cache serves none of them, in neither mode (the usage's
``cached_tokens`` is recorded and printed when it is not 0).

Per request, client-side (``time.perf_counter``): TTFT (send -> the chunk carrying the first
token), TT2T (send -> the chunk carrying the second token), e2e (send -> end of stream). Per
stack: the streamed pulls the decode worker counted (``pdserve_kv_transfer_streamed_total``),
which must be 0 for the whole hand-off and one per request for the streamed one.

Why TTFT hardly moves: in both modes the first token is the prefill worker's, and the router
passes it on as soon as the prefill answers; the streamed hand-off changes what happens after
it. With the whole-request hand-off the decode worker starts its pull only then and its first
step (the second token) waits for the whole pull; with the streamed one it has pulled each
prefill chunk's blocks while the next chunks were computed, so the second token follows the
first by about one decode step. TT2T is where the overlap shows. Benchmark code only: the
router and the workers never import it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

    from pdserve.config.settings import PdserveConfig

DESCRIPTION = """\
The streamed hand-off against the whole-request hand-off (router --kv-stream-min-tokens): two
stacks of router + 1 prefill + 1 decode on the default model, up together, one handing every
prompt off whole (--kv-stream-min-tokens 0), the other streamed (1); every prompt goes through
the prefill worker. For each --prompt-tokens length, --requests streamed greedy
/v1/completions per mode (max_tokens 4, ignore_eos) of fresh random token ids (the prefix
cache serves none of them), one at a time, alternating between the two stacks, after a warm-up
request on each.

Reported per length (p50, ms): TTFT (send -> first token) and TT2T (send -> second token) of
each mode and streamed / whole, the gap between the two tokens, the decode worker's streamed
pulls, the CPU model and the transfer backend; then issue 25's targets, MET or MISSED: TTFT at
the largest prompt <= 0.9x whole, never worse for short prompts (<= 1.05x at the smallest).

Why TTFT hardly moves in this design: in both modes the first token is the prefill worker's,
passed on by the router as soon as the prefill answers. What the streamed hand-off shortens is
the wait for the SECOND token: the decode worker has pulled each prefill chunk's KV blocks
while the next chunks were computed, instead of starting its whole pull after the prefill. TT2T
is where the overlap shows. The stacks take their other settings from --config and PDSERVE_*
variables; progress goes to stderr (long prompts on CPU take many seconds each).
"""
"""The ``pdserve bench handoff --help`` text."""


MODES = ("whole", "streamed")
"""The two hand-offs, in the order they run."""
TTFT_TARGET = 0.9
"""Issue 25: streamed TTFT at the largest prompt at most this times the whole hand-off's."""
SHORT_TARGET = 1.05
"""... and never worse for short prompts: at most this times at the smallest prompt."""
STREAMED_METRIC = "pdserve_kv_transfer_streamed_total"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench handoff``."""
    p.add_argument(
        "--prompt-tokens",
        type=int,
        nargs="+",
        default=[512, 2048, 8000],
        metavar="N",
        help="prompt lengths in tokens (random token ids), one row each (default: 512 2048 "
        "8000; SmolLM2's window is 8192 tokens)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=3,
        help="sequential requests per prompt length and mode (default: 3)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=4,
        help="max_tokens of each request (ignore_eos; at least 2) (default: 4)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "nixl", "ucx", "tcp"),
        default=None,
        help="KV transfer backend of both stacks (default: transfer.backend of the settings)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="uncounted requests per stack first, at the smallest length (default: 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="local model folder (default: model.path of the settings, else the converted "
        "SmolLM2 in the cache)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="per-request timeout, seconds (default: 600)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


@dataclass
class Sample:
    """One request: seconds from sending it to the first and the second token and to the end
    of its stream; tokens received; the usage's prompt and cached tokens."""

    ttft_s: float
    tt2t_s: float
    e2e_s: float
    tokens: int
    prompt_tokens: int | None = None
    cached_tokens: int = 0


@dataclass
class ModeRun:
    """One stack's measurements: samples per prompt length, the decode worker's streamed
    pulls during the measured requests, the stack's start-up time and the transfer backend
    its prefill worker registered with."""

    mode: str
    samples: dict[int, list[Sample]] = field(default_factory=dict)
    streamed_pulls: float = 0.0
    start_s: float = 0.0
    backend: str = ""


@dataclass
class Arm:
    """A started stack of one mode: its run, the router's and the decode worker's URLs, the
    served model name, the client headers, the cluster token headers and the router's
    embedded registry URL (its internal listener)."""

    run: ModeRun
    url: str
    decode: str
    model: str
    headers: dict[str, str]
    cluster: dict[str, str]
    registry: str = ""


def model_window(model_path: Path) -> int | None:
    """The model's context window (``max_position_embeddings`` of its config.json), or None."""
    try:
        cfg = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get(
        "max_position_embeddings"
    )
    return int(value) if value else None


def vocab_size(model_path: Path) -> int:
    """The model's vocabulary size (config.json), 32000 when it says none."""
    try:
        return int(json.loads((model_path / "config.json").read_text()).get("vocab_size", 32000))
    except (OSError, ValueError, TypeError):
        return 32000


def prompt_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    """``length`` random token ids: ordinary tokens (100..10099) of a large vocabulary, every
    id but the last 8 of a small one (a byte-level tokenizer's specials)."""
    lo, hi = (100, min(vocab, 10100)) if vocab > 1000 else (0, max(1, vocab - 8))
    return [rng.randrange(lo, hi) for _ in range(length)]


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Sample:
    """POST one streamed completion and time its tokens (a chunk's ``logprobs.tokens`` says how
    many it carries). Raises RuntimeError when it fails or yields fewer than 2 tokens,
    httpx.HTTPError when the connection does."""
    from pdserve.bench.serving.bench_serve import sse_chunks

    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for chunk in sse_chunks(r):
            if chunk.get("error"):
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            usage = chunk.get("usage") or usage
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                tokens = (choice.get("logprobs") or {}).get("tokens")
                count = len(tokens) if tokens is not None else int(bool(choice.get("text")))
                stamps += [now] * count
    end = time.perf_counter()
    if len(stamps) < 2:
        raise RuntimeError(f"{len(stamps)} tokens received, 2 needed")
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        stamps[0] - t0,
        stamps[1] - t0,
        end - t0,
        len(stamps),
        usage.get("prompt_tokens"),
        int(details.get("cached_tokens") or 0),
    )


def _body(model: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def _backend(client: httpx.AsyncClient, arm: Arm, default: str) -> str:
    """The transfer backend the prefill worker registered with (the embedded registry's
    record), else ``default``."""
    import httpx

    try:
        r = await client.get(f"{arm.registry}/registry/workers", headers=arm.cluster)
        r.raise_for_status()
        for record in r.json()["workers"]:
            if record.get("role") == "prefill":
                return str(record["communicator"]["backend"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        _progress(f"  (the prefill worker's backend unread: {type(exc).__name__}: {exc})")
    return default


async def _drive(
    arms: list[Arm],
    prompts: dict[str, dict[int, list[list[int]]]],
    warm: dict[str, list[list[int]]],
    max_tokens: int,
    timeout_s: float,
    default_backend: str,
) -> None:
    """Warm up each stack, then per length the i-th request of each mode in turn, the order
    alternating (whole, streamed, streamed, whole, ...) so that neither mode always runs
    second; counts each decode worker's streamed pulls over the measured requests."""
    import httpx

    from pdserve.bench.scrape import scrape

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30)) as client:

        async def send(arm: Arm, ids: list[int]) -> Sample:
            url, body = f"{arm.url}/v1/completions", _body(arm.model, ids, max_tokens)
            return await one_request(client, url, body, arm.headers)

        before = {}
        for arm in arms:
            arm.run.backend = await _backend(client, arm, default_backend)
            for ids in warm[arm.run.mode]:
                await send(arm, ids)
            before[arm.run.mode] = (await scrape(client, arm.decode)).get(STREAMED_METRIC, 0.0)
        lengths = list(prompts[arms[0].run.mode])
        for n in lengths:
            count = len(prompts[arms[0].run.mode][n])
            for i in range(count):
                for arm in arms if i % 2 == 0 else arms[::-1]:
                    mode = arm.run.mode
                    _progress(f"  {n} tokens, {mode}, request {i + 1}/{count} ...")
                    smp = await send(arm, prompts[mode][n][i])
                    arm.run.samples.setdefault(n, []).append(smp)
                    _progress(
                        f"  {n} tokens, {mode}, request {i + 1}/{count}: TTFT "
                        f"{smp.ttft_s * 1e3:.0f} ms, TT2T {smp.tt2t_s * 1e3:.0f} ms, e2e "
                        f"{smp.e2e_s * 1e3:.0f} ms"
                    )
        for arm in arms:
            after = (await scrape(client, arm.decode)).get(STREAMED_METRIC, 0.0)
            arm.run.streamed_pulls = after - before[arm.run.mode]


def start_mode(settings: PdserveConfig, mode: str, log_dir: Path, stacks: ExitStack) -> Arm:
    """Start router + 1 prefill + 1 decode of ``settings`` with the ``mode`` hand-off (its
    router's ``--kv-stream-min-tokens`` 0 or 1, ``--local-prefill-max-tokens`` 0), logs in
    ``log_dir``, stopped when ``stacks`` closes; wait until it is ready. Raises
    ProcessExitedError or ReadyTimeoutError when it does not start."""
    from pdserve.bench.bench import READY_TIMEOUT_S, bench_stack
    from pdserve.config.hosts import free_port

    least = "1" if mode == "streamed" else "0"
    dport = free_port()
    args = {
        "router": ["--local-prefill-max-tokens", "0", "--kv-stream-min-tokens", least],
        "decode-0": ["--port", str(dport)],
    }
    _progress(
        f"{mode} hand-off: starting router (--kv-stream-min-tokens {least}) + 1 prefill "
        f"+ 1 decode, transfer backend {settings.transfer.backend}"
    )
    t0 = time.perf_counter()
    stack = stacks.enter_context(bench_stack(settings, log_dir, args=args))
    stack.start()
    stack.wait_ready(READY_TIMEOUT_S, what=f"the {mode} hand-off stack")
    run = ModeRun(mode, start_s=time.perf_counter() - t0)
    _progress(f"{mode} hand-off: stack up in {run.start_s:.0f} s")
    return Arm(
        run,
        stack.url,
        f"http://127.0.0.1:{dport}",
        str(stack.settings.model.served_name),
        stack.api_headers(),
        stack.cluster_key.http_headers(),
        stack.registry_url,
    )


def measure(
    cfg: PdserveConfig,
    model_path: Path,
    sizes: Sequence[int],
    requests: int,
    *,
    max_tokens: int = 4,
    backend: str | None = None,
    warmup: int = 1,
    seed: int = 0,
    log_dir: Path | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Both hand-offs on ``model_path`` with the other settings of ``cfg`` (``backend``
    replacing ``transfer.backend`` when given; ``model.max_model_len`` raised to admit the
    largest prompt plus ``max_tokens``): one stack per mode, both up together (an idle stack
    takes about 2% of a core), ``requests`` fresh random prompts per length of ``sizes`` per
    mode, sent one at a time, alternating between the stacks (:func:`_drive`). Returns
    ``{"backend", "runs": {mode: ModeRun}, "rows": [...], "logs"}``, a row per length: p50
    TTFT, TT2T, gap and e2e (seconds) of each mode and the streamed/whole ratios. Raises
    ValueError when a prompt does not fit the model's window, ProcessExitedError or
    ReadyTimeoutError when a stack does not start, RuntimeError or httpx.HTTPError when a
    request fails."""
    from pdserve.bench.bench import stack_settings

    need = max(sizes) + max_tokens
    window = model_window(model_path)
    if window is not None and need > window:
        raise ValueError(
            f"{max(sizes)} + {max_tokens} tokens exceed the model's {window}-token "
            "window: pass shorter --prompt-tokens"
        )
    update: dict[str, Any] = {}
    if backend:
        update["transfer"] = cfg.transfer.model_copy(update={"backend": backend})
    if cfg.model.max_model_len is not None and cfg.model.max_model_len < need:
        update["model"] = cfg.model.model_copy(update={"max_model_len": need})
    settings = stack_settings(
        cfg.model_copy(update=update), model_path, {"prefill": 1, "decode": 1}
    )
    logs = log_dir or Path(tempfile.mkdtemp(prefix="pdserve-bench-handoff-"))
    rng = random.Random(seed)
    vocab = vocab_size(model_path)
    # Fresh ids for every request of both modes: no prompt shares a cached prefix.
    warm = {m: [prompt_ids(rng, min(sizes), vocab) for _ in range(warmup)] for m in MODES}
    prompts = {
        m: {n: [prompt_ids(rng, n, vocab) for _ in range(requests)] for n in sizes} for m in MODES
    }
    with ExitStack() as stacks:
        arms = [start_mode(settings, mode, logs / mode, stacks) for mode in MODES]
        asyncio.run(_drive(arms, prompts, warm, max_tokens, timeout_s, settings.transfer.backend))
    runs = {arm.run.mode: arm.run for arm in arms}
    rows = [_row(n, runs) for n in sizes]
    used = ", ".join(sorted({r.backend for r in runs.values()}))
    return {
        "backend": settings.transfer.backend,
        "backend_used": used,
        "runs": runs,
        "rows": rows,
        "logs": str(logs),
    }


def _p50(values: Sequence[float]) -> float:
    return statistics.median(values)


def _row(n: int, runs: dict[str, ModeRun]) -> dict[str, Any]:
    row: dict[str, Any] = {"prompt_tokens": n}
    for mode in MODES:
        s = runs[mode].samples[n]
        row[mode] = {
            "ttft_s": _p50([x.ttft_s for x in s]),
            "tt2t_s": _p50([x.tt2t_s for x in s]),
            "gap_s": _p50([x.tt2t_s - x.ttft_s for x in s]),
            "e2e_s": _p50([x.e2e_s for x in s]),
            "cached_tokens": sum(x.cached_tokens for x in s),
        }
    for key in ("ttft_s", "tt2t_s", "gap_s", "e2e_s"):
        whole = row["whole"][key]
        row[f"{key[:-2]}_ratio"] = row["streamed"][key] / whole if whole > 0 else float("nan")
    return row


def format_table(result: dict[str, Any]) -> str:
    """The table (ms, p50 of each mode's requests) and the two target lines."""
    head = (
        f"{'prompt tokens':>13} | {'whole TTFT':>10} | {'streamed TTFT':>13} | {'ratio':>5} | "
        f"{'whole TT2T':>10} | {'streamed TT2T':>13} | {'ratio':>5} | "
        f"{'gap whole':>9} | {'gap streamed':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        w, s = r["whole"], r["streamed"]
        lines.append(
            f"{r['prompt_tokens']:>13} | {w['ttft_s'] * 1e3:>10.0f} | {s['ttft_s'] * 1e3:>13.0f} | "
            f"{r['ttft_ratio']:>5.2f} | {w['tt2t_s'] * 1e3:>10.0f} | {s['tt2t_s'] * 1e3:>13.0f} | "
            f"{r['tt2t_ratio']:>5.2f} | {w['gap_s'] * 1e3:>9.0f} | {s['gap_s'] * 1e3:>12.0f}"
        )
    lines.append("(ms, p50; gap: second token - first token; ratio: streamed / whole)")
    for mode, run in result["runs"].items():
        n = sum(len(v) for v in run.samples.values())
        lines.append(
            f"{mode}: stack up in {run.start_s:.0f} s, {run.streamed_pulls:.0f} "
            f"streamed pulls on the decode worker for {n} requests"
        )
    cached = {
        r["prompt_tokens"]: (r["whole"]["cached_tokens"], r["streamed"]["cached_tokens"])
        for r in result["rows"]
        if r["whole"]["cached_tokens"] or r["streamed"]["cached_tokens"]
    }
    if cached:
        lines.append(f"WARNING: the prefix cache served prompt tokens (whole, streamed): {cached}")
    lines += [line for line, _ in targets(result["rows"])]
    return "\n".join(lines)


def targets(rows: Sequence[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The issue's two targets on TTFT, each as (line, met)."""
    big = max(rows, key=lambda r: r["prompt_tokens"])
    small = min(rows, key=lambda r: r["prompt_tokens"])
    out = []
    for label, row, bound in (
        (
            f"TTFT at the largest prompt ({big['prompt_tokens']} tokens) <= {TTFT_TARGET}x whole",
            big,
            TTFT_TARGET,
        ),
        (
            f"never worse for short prompts (<= {SHORT_TARGET}x at the smallest, "
            f"{small['prompt_tokens']} tokens)",
            small,
            SHORT_TARGET,
        ),
    ):
        ok = row["ttft_ratio"] <= bound
        out.append(
            (
                f"{label}: {'MET' if ok else 'MISSED'} (streamed "
                f"{row['streamed']['ttft_s'] * 1e3:.0f} ms / whole "
                f"{row['whole']['ttft_s'] * 1e3:.0f} ms = {row['ttft_ratio']:.2f}x; TT2T "
                f"{row['tt2t_ratio']:.2f}x)",
                ok,
            )
        )
    return out


def main(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """``pdserve bench handoff``: measure both hand-offs, print the table and the targets.
    0 when every request succeeded, 1 when one failed, 2 for bad options."""
    import httpx

    from pdserve.bench.serving.bench_serve import write_json
    from pdserve.hardware import cpu_model
    from pdserve.launch.supervisor import ReadyTimeoutError
    from pdserve.models import resolve_model

    if args.max_tokens < 2 or args.requests < 1 or min(args.prompt_tokens) < 1:
        print(
            "bench handoff: --max-tokens >= 2, --requests >= 1 and positive --prompt-tokens needed",
            file=sys.stderr,
        )
        return 2
    path = args.model or (str(cfg.model.path) if cfg.model.path is not None else None)
    model_path = resolve_model(path, cache_dir=cfg.model.cache_dir)
    sizes = list(dict.fromkeys(args.prompt_tokens))
    _progress(
        f"bench handoff: prompts {sizes} tokens, {args.requests} requests each, "
        f"max_tokens {args.max_tokens}, model {model_path}"
    )
    try:
        result = measure(
            cfg,
            model_path,
            sizes,
            args.requests,
            max_tokens=args.max_tokens,
            backend=args.backend,
            warmup=args.warmup,
            seed=args.seed,
            timeout_s=args.request_timeout_s,
        )
    except ValueError as exc:
        print(f"bench handoff: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, httpx.HTTPError, ReadyTimeoutError) as exc:  # ProcessExitedError too
        print(f"bench handoff: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    used, setting = result["backend_used"], result["backend"]
    backend = used if used == setting else f"{used} (transfer.backend {setting})"
    print(
        f"streamed vs whole-request hand-off: {model_path.name}, router + 1 prefill + 1 "
        f"decode, transfer backend {backend}, {cpu_model()} ({os.cpu_count()} CPUs), "
        f"{args.requests} requests per row, max_tokens {args.max_tokens}"
    )
    print(format_table(result))
    if args.json:
        runs = {m: asdict(r) for m, r in result["runs"].items()}
        write_json(
            Path(args.json),
            {
                "tool": "pdserve bench handoff",
                "argv": sys.argv[1:],
                "cpu": cpu_model(),
                "cpus": os.cpu_count(),
                "model": str(model_path),
                "backend": setting,
                "backend_used": used,
                "rows": result["rows"],
                "runs": runs,
                "targets": [{"line": line, "met": ok} for line, ok in targets(result["rows"])],
            },
        )
        print(f"wrote {args.json}")
    print(f"logs: {result['logs']}")
    return 0
