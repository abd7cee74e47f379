"""Multi-turn chat benchmark: the prefix cache on against off (:data:`TARGET_RATIO`).

``pdserve bench multiturn`` starts two stacks in turn, each the one ``pdserve bench serve``
starts (router + 1 prefill worker + 1 decode worker, the SmolLM2 default model, settings from
``--config`` and ``PDSERVE_*`` variables resolved by :func:`pdserve.bench.bench.stack_settings`,
started by :func:`pdserve.bench.bench.bench_stack`), the first with
``--prefix-caching``, the second with ``--no-prefix-caching``, and runs the same workload on
each. The router runs with ``--local-prefill-max-tokens 0``: every turn goes through the prefill
worker and the KV hand-off, so the prefill worker's prefix cache sees every prompt.

Workload (fixed seed, :func:`make_workload`): C conversations of T turns. Every conversation
starts with the same system prompt of about S tokens (fixed sentences, cut at S tokens by the
model's tokenizer); each turn appends a user message (a few dozen tokens, drawn with the seed)
and, once answered, the assistant's reply, so each turn's prompt extends the previous one.
Requests are streamed chat completions, greedy, ``max_tokens`` small; K conversations run at
once, the turns of one conversation in order. Two warm-up requests (a short one, and a long one
that shares no prefix with the workload) go first and are not counted.

Reported per arm: TTFT (send -> first content delta, :func:`pdserve.bench.serving.bench_serve.
stream_openai`) p50/p90 on turn 1 and on turns 2+; prompt tokens (the responses' ``usage``);
tokens the prefill worker computed (``pdserve_prefix_cache_query_tokens_total`` minus
``pdserve_prefix_cache_hit_tokens_total`` on its ``/metrics``, :mod:`pdserve.bench.scrape`, the
workload's delta; with the
cache off there are no lookups and every prompt token is computed) and the hit rate; then
cache-on / cache-off TTFT p50 on turns 2+ against the issue's target (at most 0.3x).

``--compare sessions`` (session affinity, router/sessions.py) runs it on two stacks of router
+ 1 prefill worker + ``--decode-workers`` (default 2) decode workers, KV-aware routing and
local prefill of short prompts on (the router's defaults): one sends each conversation's turns
with an ``x-session-id`` header, the other without; reported: TTFT and the mean cached prompt
tokens per turn on turns 2+ (the responses' ``usage.prompt_tokens_details.cached_tokens``: what
the worker that prefilled the turn held), and the router's session decisions.

``--compare routing`` (KV-aware routing) runs the same workload on two stacks
of router + ``--prefill-workers`` (default 2) prefill workers + 1 decode worker, both with the
prefix cache on: KV-aware routing (``--router-kv-overlap-weight 1``) against least-loaded
routing (``--router-kv-overlap-weight 0``), and reports the prefill workers' hit rate (summed
over them) and TTFT of each, with the KV-aware / least-loaded ratios against the targets (hit
rate at least 2x, TTFT p50 lower). ``--distinct-system-prompts`` gives every conversation a
system prompt of its own (rotated rules: no prefix shared between conversations), the case in
which where a conversation's turns land decides what is cached.

Benchmark code only: the router and the workers never import it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The metrics reading the benchmarks share, importable from here too (stack tests use it).
from pdserve.bench.scrape import parse_metrics as parse_metrics
from pdserve.bench.serving.bench_multiturn_workload import (
    SYSTEM_SENTENCES,
    Workload,
    approx_tokens,
    make_workload,
    system_prompt,
    turn_messages,
)

if TYPE_CHECKING:
    import httpx

    from pdserve.bench.serving.bench_serve import RequestResult
    from pdserve.config.settings import PdserveConfig

TARGET_RATIO = 0.3
"""Target: TTFT p50 on turns 2+ with the cache on, at most this times the cache-off run."""
TARGET_HIT_RATIO = 2.0
"""Target: prefill hit rate with KV-aware routing, at least this times least-loaded."""


@dataclass(frozen=True)
class Arm:
    """One stack to measure: router + ``prefill_workers`` prefill + 1 decode worker, the prefix
    cache on or off, extra router flags."""

    label: str
    tag: str
    prefix_caching: bool = True
    prefill_workers: int = 1
    router_args: tuple[str, ...] = ()
    decode_workers: int = 1
    sessions: bool = False
    """Send each conversation's turns with an ``x-session-id`` header."""
    local_prefill: bool = False
    """Keep the router's local prefill of short prompts (else ``--local-prefill-max-tokens 0``)."""


CACHE_ARMS = (Arm("cache on", "on"), Arm("cache off", "off", prefix_caching=False))


def routing_arms(prefill_workers: int) -> tuple[Arm, Arm]:
    """KV-aware against least-loaded routing, ``prefill_workers`` prefill workers each."""
    weight = "--router-kv-overlap-weight"
    return (
        Arm("kv-aware", "kv", prefill_workers=prefill_workers, router_args=(weight, "1")),
        Arm("least-load", "ll", prefill_workers=prefill_workers, router_args=(weight, "0")),
    )


def session_arms(decode_workers: int) -> tuple[Arm, Arm]:
    """With session ids against without, ``decode_workers`` decode workers, local prefill on."""
    return (
        Arm("sessions", "ses", decode_workers=decode_workers, sessions=True, local_prefill=True),
        Arm("no session", "nos", decode_workers=decode_workers, local_prefill=True),
    )


def chat_request(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streaming greedy chat completion of ``messages``, usage in the last chunk."""
    from pdserve.bench.serving.bench_serve import chat_body

    body = chat_body(model, "", max_tokens, ignore_eos=False)
    body["messages"] = messages
    return body


# --- running the workload -------------------------------------------------------------------------


@dataclass
class Turn:
    """One measured request: conversation index, turn index (0-based) and its result."""

    conversation: int
    turn: int
    result: RequestResult


async def run_workload(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    wl: Workload,
    concurrency: int,
    max_tokens: int,
    sessions: bool = False,
) -> tuple[list[Turn], float]:
    """Run every conversation of ``wl`` against ``url`` (``.../chat/completions``),
    ``concurrency`` conversations at once, turns in order; a failed turn ends its conversation.
    ``sessions``: each conversation's requests carry ``x-session-id: conversation-<c>``.
    Returns the turns (in completion order) and the wall time in seconds."""
    from pdserve.bench.serving.bench_serve import stream_openai

    todo = iter(range(len(wl.users)))
    out: list[Turn] = []

    async def worker() -> None:
        for c in todo:
            replies: list[str] = []
            for t in range(len(wl.users[c])):
                body = chat_request(
                    model, turn_messages(wl.system_of(c), wl.users[c], replies), max_tokens
                )
                session = {"x-session-id": f"conversation-{c}"} if sessions else None
                res = await stream_openai(client, url, body, headers=session)
                out.append(Turn(c, t, res))
                if not res.ok:
                    break
                replies.append(res.text)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(wl.users))))))
    return out, time.perf_counter() - t0


def _pcts(values_s: Sequence[float]) -> dict[str, float | None]:
    from pdserve.bench.serving.bench_serve import percentile

    ms = [v * 1e3 for v in values_s]
    return {"p50": percentile(ms, 50), "p90": percentile(ms, 90), "n": float(len(ms))}


def _mean(values: Sequence[int]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_arm(
    label: str,
    turns: Sequence[Turn],
    wall_s: float,
    prefill: dict[str, float],
    router: dict[str, float],
) -> dict[str, Any]:
    """One arm's numbers (JSON-ready). ``prefill`` and ``router``: the workload's deltas of the
    prefill worker's and the router's metrics."""
    ok = [t for t in turns if t.result.ok]
    errors = [t.result for t in turns if not t.result.ok]
    prompt = sum(t.result.prompt_tokens or 0 for t in ok)
    queries = prefill.get("pdserve_prefix_cache_queries_total", 0.0)
    query = prefill.get("pdserve_prefix_cache_query_tokens_total", 0.0)
    hit = prefill.get("pdserve_prefix_cache_hit_tokens_total", 0.0)
    computed = query - hit if queries else float(prompt)
    return {
        "label": label,
        "requests": len(turns),
        "completed": len(ok),
        "errors": len(errors),
        "first_error": errors[0].error if errors else None,
        "wall_s": wall_s,
        "ttft_turn1_ms": _pcts([t.result.ttft_s or 0.0 for t in ok if t.turn == 0]),
        "ttft_later_ms": _pcts([t.result.ttft_s or 0.0 for t in ok if t.turn > 0]),
        "ttft_all_ms": _pcts([t.result.ttft_s or 0.0 for t in ok]),
        "prompt_tokens": prompt,
        "output_tokens": sum(t.result.output_tokens for t in ok),
        "prefix_cache_queries": queries,
        "query_tokens": query,
        "hit_tokens": hit,
        "prefill_computed_tokens": computed,
        "hit_rate": hit / query if query else 0.0,
        "router_decisions": {k: v for k, v in router.items() if "router_decisions_total" in k},
        "session_routes": {k: v for k, v in router.items() if "session_routes_total" in k},
        "cached_tokens_later_mean": _mean(
            [
                t.result.cached_tokens
                for t in ok
                if t.turn > 0 and t.result.cached_tokens is not None
            ]
        ),
        "prompt_tokens_later_mean": _mean(
            [
                t.result.prompt_tokens
                for t in ok
                if t.turn > 0 and t.result.prompt_tokens is not None
            ]
        ),
    }


# --- the two stacks ---------------------------------------------------------------------------


_Measured = tuple[list[Turn], float, list[dict[str, float]]]


async def _measure(
    args: argparse.Namespace,
    router: str,
    workers: Sequence[str],
    model: str,
    headers: dict[str, str],
    wl: Workload,
    sessions: bool = False,
) -> _Measured:
    """Warm up, then run ``wl`` through ``router``: the turns, the wall time, and the
    workload's deltas of the metrics of ``router`` and each of ``workers``."""
    import httpx

    from pdserve.bench.scrape import delta, scrape
    from pdserve.bench.serving.bench_serve import stream_openai

    url = f"{router}/v1/chat/completions"
    n = args.concurrency + 4
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(args.request_timeout_s, connect=30),
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        headers=headers,
    ) as client:
        # Warm-up: a short prompt, then a long one that shares no prefix with the workload.
        long_warm = "Warm-up. " + system_prompt(args.system_tokens, start=len(SYSTEM_SENTENCES))
        for text in ("Say hello in five words.", long_warm):
            body = chat_request(model, [{"role": "user", "content": text}], args.max_tokens)
            w = await stream_openai(client, url, body)
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        urls = [router, *workers]
        before = [await scrape(client, u) for u in urls]
        turns, wall = await run_workload(
            client, url, model, wl, args.concurrency, args.max_tokens, sessions
        )
        after = [await scrape(client, u) for u in urls]
    return turns, wall, [delta(b, a) for b, a in zip(before, after, strict=True)]


def run_arm(
    args: argparse.Namespace,
    cfg: PdserveConfig,
    model_path: Path,
    wl: Workload,
    spec: Arm,
    logs: Path,
) -> dict[str, Any]:
    """Start router + ``spec.prefill_workers`` prefill + 1 decode (the prefix cache on or off,
    ``spec.router_args``; every worker on a port of its own for its metrics), run ``wl``, stop
    the stack; returns :func:`summarize_arm`'s dict (prefill metrics summed over the prefill
    workers). Logs go to ``logs/<spec.tag>/``. Raises ProcessExitedError or ReadyTimeoutError
    when the stack does not start, RuntimeError when the warm-up fails."""
    from pdserve.bench.bench import READY_TIMEOUT_S, bench_stack, stack_settings
    from pdserve.config.hosts import free_port

    label, tag, n, m = spec.label, spec.tag, spec.prefill_workers, spec.decode_workers
    caching = {"prefix_caching": spec.prefix_caching}
    arm_cfg = cfg.model_copy(update={"kv_cache": cfg.kv_cache.model_copy(update=caching)})
    settings = stack_settings(arm_cfg, model_path, {"prefill": n, "decode": m})
    ports = {f"prefill-{i}": free_port() for i in range(n)}
    ports |= {f"decode-{i}": free_port() for i in range(m)}
    stack_args = {name: ["--port", str(p)] for name, p in ports.items()}
    local = [] if spec.local_prefill else ["--local-prefill-max-tokens", "0"]
    stack_args["router"] = [*local, *spec.router_args]
    flag = "--prefix-caching" if spec.prefix_caching else "--no-prefix-caching"
    print(
        f"{label}: router {' '.join(stack_args['router'])} + {n} prefill + {m} decode, {flag}, "
        f"{'x-session-id per conversation, ' if spec.sessions else ''}"
        f"logs in {logs / tag}",
        flush=True,
    )
    with bench_stack(settings, logs / tag, args=stack_args) as stack:
        stack.start()
        stack.wait_ready(READY_TIMEOUT_S, what=f"the {label} stack")
        model = str(stack.settings.model.served_name)
        urls = [f"http://127.0.0.1:{p}" for p in ports.values()]  # prefill-0.., decode-0..
        turns, wall, (rdelta, *wdeltas) = asyncio.run(
            _measure(args, stack.url, urls, model, stack.api_headers(), wl, spec.sessions)
        )
    pdeltas, ddeltas = wdeltas[:n], wdeltas[n:]
    ddelta = {k: sum(d.get(k, 0.0) for d in ddeltas) for k in ddeltas[0]}
    pdelta = {k: sum(d.get(k, 0.0) for d in pdeltas) for k in pdeltas[0]}
    arm = summarize_arm(label, turns, wall, pdelta, rdelta)
    arm["prefill_workers"] = n
    arm["decode_workers"] = m
    arm["sessions"] = spec.sessions
    arm["router_args"] = list(spec.router_args)
    arm["queries_per_prefill_worker"] = [
        d.get("pdserve_prefix_cache_queries_total", 0.0) for d in pdeltas
    ]
    arm["hit_tokens_per_prefill_worker"] = [
        d.get("pdserve_prefix_cache_hit_tokens_total", 0.0) for d in pdeltas
    ]
    keep = ("pdserve_prefix_cache_", "pdserve_kv_transfer_bytes", "pdserve_kv_transfer_seconds_")
    arm["decode_metrics"] = {
        k: v
        for k, v in ddelta.items()
        if k.startswith(keep) and "_bucket" not in k and "_created" not in k
    }
    print(format_arm(arm), flush=True)
    return arm


def _ms(v: float | None) -> str:
    return f"{'-':>8}" if v is None else f"{v:>8.1f}"


def format_arm(arm: dict[str, Any]) -> str:
    """One line per arm as it ends: requests, errors, wall time."""
    line = (
        f"{arm['label']}: {arm['completed']}/{arm['requests']} turns ok, {arm['errors']} "
        f"errors, wall {arm['wall_s']:.1f} s"
    )
    return line + (f"; first error: {arm['first_error']}" if arm["first_error"] else "")


def format_table(arms: Sequence[dict[str, Any]], compare: str = "cache") -> str:
    """The comparison table (milliseconds, tokens) and the ratios against the targets: the
    turns-2+ TTFT p50 ratio (``compare`` "cache"), or the hit rate and TTFT ratios of
    KV-aware over least-loaded routing ("routing")."""
    head = (
        f"{'arm':<10} {'turn1 p50':>9} {'turn1 p90':>9} {'2+ p50':>8} {'2+ p90':>8} "
        f"{'all p50':>8} {'all p90':>8} {'prompt tok':>10} {'prefilled':>9} {'hit rate':>8}"
        "   (TTFT ms)"
    )
    lines = [head]
    for a in arms:
        t1, t2 = a["ttft_turn1_ms"], a["ttft_later_ms"]
        al = a.get("ttft_all_ms", {"p50": None, "p90": None})
        lines.append(
            f"{a['label']:<10} {_ms(t1['p50']):>9} {_ms(t1['p90']):>9} {_ms(t2['p50'])} "
            f"{_ms(t2['p90'])} {_ms(al['p50'])} {_ms(al['p90'])} "
            f"{a['prompt_tokens']:>10} "
            f"{a['prefill_computed_tokens']:>9.0f} {a['hit_rate']:>8.1%}"
        )
    if compare == "sessions":
        for a in arms:
            lines.append(
                f"{a['label']}: cached prompt tokens per turn, turns 2+: "
                f"{a['cached_tokens_later_mean'] or 0:.0f} of {a['prompt_tokens_later_mean'] or 0:.0f}"
                f"; session routes {a['session_routes'] or '-'}"
            )
        return "\n".join(lines)
    if compare == "routing":
        lines += [
            f"{k}: {v:.2f}x" if v is not None else f"{k}: -"
            for k, v in routing_ratios(arms).items()
        ]
        return "\n".join(lines)
    r = ratio(arms)
    if r is not None:
        verdict = "met" if r <= TARGET_RATIO else f"missed by {r / TARGET_RATIO - 1:.0%}"
        lines.append(
            f"TTFT p50 turns 2+, cache on / cache off: {r:.2f}x "
            f"(target <= {TARGET_RATIO}x: {verdict})"
        )
    return "\n".join(lines)


def ratio(arms: Sequence[dict[str, Any]]) -> float | None:
    """Cache-on / cache-off TTFT p50 on turns 2+ (arms in that order); None without data."""
    if len(arms) < 2:
        return None
    on, off = arms[0]["ttft_later_ms"]["p50"], arms[1]["ttft_later_ms"]["p50"]
    return float(on / off) if on and off else None


def routing_ratios(arms: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """KV-aware over least-loaded (arms in that order): prefill hit rate (target >= 2x) and
    TTFT p50 / p90 over all turns and on turns 2+ (target p50 < 1x); None without data."""
    if len(arms) < 2:
        return {}
    kv, ll = arms
    out: dict[str, float | None] = {
        f"hit rate kv-aware / least-load (target >= {TARGET_HIT_RATIO}x)": (
            kv["hit_rate"] / ll["hit_rate"] if ll["hit_rate"] else None
        )
    }
    for key, name in (("ttft_all_ms", "all turns"), ("ttft_later_ms", "turns 2+")):
        for q in ("p50", "p90"):
            a, b = kv[key][q], ll[key][q]
            target = " (target < 1x)" if q == "p50" and key == "ttft_all_ms" else ""
            out[f"TTFT {q} {name} kv-aware / least-load{target}"] = a / b if a and b else None
    return out


def token_counter(model_path: Path) -> Callable[[str], int]:
    """Token count by the model's tokenizer, or :func:`approx_tokens` when it has none."""
    from pdserve.bench.serving.bench_serve import load_tokenizer

    if not (model_path / "tokenizer_config.json").is_file():
        return approx_tokens
    tok = load_tokenizer(model_path)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def run(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """``pdserve bench multiturn`` (options: :mod:`pdserve.bench.bench_commands`): run both
    arms on ``cfg`` (the resolved settings) and print the table; 0, or 1 when an arm had failed
    turns. Raises as :func:`run_arm` does."""
    from pdserve.bench.serving.bench_serve import write_json
    from pdserve.models import resolve_model

    path = args.model or (str(cfg.model.path) if cfg.model.path is not None else None)
    model_path = resolve_model(path, cache_dir=cfg.model.cache_dir)
    wl = make_workload(
        args.conversations,
        args.turns,
        args.system_tokens,
        args.seed,
        token_counter(model_path),
        distinct=args.distinct_system_prompts,
    )
    specs = {
        "cache": CACHE_ARMS,
        "routing": routing_arms(args.prefill_workers),
        "sessions": session_arms(args.decode_workers),
    }[args.compare]
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-multiturn-"))
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(
        f"bench multiturn: {args.conversations} conversations x {args.turns} turns, "
        f"{args.system_tokens}-token system prompt, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, seed {args.seed}, {os.cpu_count()} cores; "
        f"{'' if args.compare == 'sessions' else 'router --local-prefill-max-tokens 0 (every turn through a prefill worker); '}"
        f"compare {args.compare}"
        f"{', distinct system prompts' if args.distinct_system_prompts else ''}",
        flush=True,
    )
    arms = [run_arm(args, cfg, model_path, wl, spec, logs) for spec in specs]
    print(format_table(arms, args.compare))
    if args.json:
        report = {
            "tool": "pdserve bench multiturn",
            "argv": sys.argv[1:],
            "started": started,
            "host": {"cpus": os.cpu_count()},
            "model": str(model_path),
            "workload": {
                k: getattr(args, k)
                for k in (
                    "conversations",
                    "turns",
                    "system_tokens",
                    "concurrency",
                    "max_tokens",
                    "seed",
                )
            },
            "local_prefill_max_tokens": "default" if args.compare == "sessions" else 0,
            "compare": args.compare,
            "distinct_system_prompts": args.distinct_system_prompts,
            "arms": arms,
        }
        if args.compare == "routing":
            report["ratios"] = routing_ratios(arms)
        else:
            report["ttft_p50_later_ratio"] = ratio(arms)
            report["target_ratio"] = TARGET_RATIO
        write_json(Path(args.json), report)
        print(f"wrote {args.json}")
    print(f"logs: {logs}")
    return 1 if any(a["errors"] for a in arms) else 0
