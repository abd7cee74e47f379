"""``pdserve bench fairness``: one tenant floods, another sends one request at a time; what the
second one's TTFT is with the router's fair queue and without it.

Two stacks in turn, each router + 1 prefill + 1 decode worker on the served model (settings
from ``--config`` and ``PDSERVE_*``, resolved like ``pdserve up``), with two API keys naming
tenants ``a`` and ``b`` (weight 1 each):

- **fair**: the fair queue on (``--max-requests-per-worker N``, router/admission.py): the
  router lets a request in only while the decode worker runs fewer than N, the others wait in
  the router, tenants served by deficit round robin;
- **fifo**: ``--max-requests-per-worker 0``: every request goes straight to the workers,
  whose queues are first come, first served.

On each: tenant b alone (``--probe-requests`` streamed chat completions, one at a time, prompts
of ``--probe-prompt-tokens`` tokens: by default past the router's local prefill bound, so they
need the prefill worker as a's do) for its baseline TTFT; then tenant a floods (``--flood-concurrency`` streams in flight
at all times, prompts of ``--flood-prompt-tokens`` tokens) while b sends the same probes again.
Reported: b's TTFT p50/p90 alone and under the flood, their ratio (target: p90 within 1.5x of
alone, with the fair queue), and a's output tokens/s during the flood (what a still gets).
Requests are greedy with ``max_tokens`` ``--max-tokens`` (a's: ``ignore_eos``, so each stream
has its full length). Benchmark code only: nothing in the serving path imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

    from pdserve.bench.serving.bench_serve import RequestResult
    from pdserve.config.settings import PdserveConfig

DESCRIPTION = """\
The router's fair queue against none: two stacks of router + 1 prefill + 1 decode on the
default model, with API keys naming two tenants, a and b. On each, b sends --probe-requests
streamed requests (--probe-prompt-tokens-token prompts) one at a time, alone, then while a
keeps --flood-concurrency streams of --flood-prompt-tokens-token prompts in flight. Prints b's
TTFT p50/p90 alone and under the flood, their ratio (target: p90 within 1.5x with the fair
queue) and a's output tokens/s."""

KEYS = {"a": "sk-bench-tenant-a", "b": "sk-bench-tenant-b"}
TARGET_P90_RATIO = 1.5
"""Target: b's TTFT p90 under a's flood within this many times b's alone (fair queue on)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench fairness``."""
    p.add_argument("--flood-concurrency", type=int, default=16, help="a's streams (default 16)")
    p.add_argument(
        "--flood-prompt-tokens", type=int, default=1024, help="a's prompt length (default 1024)"
    )
    p.add_argument(
        "--probe-requests", type=int, default=20, help="b's requests per phase (default 20)"
    )
    p.add_argument(
        "--probe-prompt-tokens",
        type=int,
        default=512,
        help="b's prompt length (default 512: past the router's local prefill bound of 256, so "
        "b's requests need the prefill worker too; 0: a one-line question the decode worker "
        "prefills itself)",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens (default 32)")
    p.add_argument(
        "--max-requests-per-worker",
        type=int,
        default=32,
        help="the fair arm's router.max_requests_per_worker (default 32, as with tenants)",
    )
    p.add_argument("--model", default=None, metavar="DIR", help="local model folder")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results")


def _words(n: int, salt: int) -> str:
    """About ``n`` tokens of plain words, distinct per ``salt`` (no shared prefix to cache)."""
    vocab = ("river", "stone", "garden", "copper", "window", "silver", "market", "candle")
    return f"Request {salt}: " + " ".join(vocab[(i * 7 + salt) % len(vocab)] for i in range(n))


def _client(key: str, n: int, timeout_s: float) -> httpx.AsyncClient:
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30),
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
        headers={"Authorization": f"Bearer {key}"},
        trust_env=False,
    )


_PHASES = iter(range(1 << 30))
"""Numbers each phase, so no phase's prompts are cached from an earlier one."""


async def _phase(url: str, model: str, args: argparse.Namespace, flood: bool) -> dict[str, Any]:
    """b's probes, alone or under a's flood (module docstring); the phase's figures."""
    from pdserve.bench.serving.bench_serve import chat_body, percentile
    from pdserve.bench.serving.bench_serve import stream_openai as send

    phase = next(_PHASES)
    stop = asyncio.Event()
    flooded: list[RequestResult] = []
    n = args.flood_concurrency if flood else 0
    async with _client(KEYS["a"], n + 2, 600) as a, _client(KEYS["b"], 2, 600) as b:

        async def lane(k: int) -> None:
            i = 0
            while not stop.is_set():
                prompt = _words(args.flood_prompt_tokens, phase * 10_000_000 + k * 10_000 + i)
                flooded.append(await send(a, url, chat_body(model, prompt, args.max_tokens, True)))
                i += 1

        lanes = [asyncio.create_task(lane(k)) for k in range(n)]
        while flood and sum(1 for r in flooded if r.ok) < n // 2:  # a fills the workers first
            if any(not r.ok for r in flooded):
                raise RuntimeError(f"tenant a's request failed: {flooded[-1].error}")
            await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        before = len(flooded)
        probes = []
        for i in range(args.probe_requests):
            question = f"Say one word about the number {i}."
            if args.probe_prompt_tokens:
                salt = phase * 10_000_000 + 1_000_000 + i
                question = _words(args.probe_prompt_tokens, salt) + " " + question
            body = chat_body(model, question, args.max_tokens, False)
            probes.append(await send(b, url, body))
        wall = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*lanes)
    ttft = [r.ttft_s * 1e3 for r in probes if r.ok and r.ttft_s is not None]
    during = flooded[before:]
    return {
        "b_ok": len(ttft),
        "b_errors": sum(1 for r in probes if not r.ok),
        "b_first_error": next((r.error for r in probes if not r.ok), None),
        "b_ttft_p50_ms": percentile(ttft, 50),
        "b_ttft_p90_ms": percentile(ttft, 90),
        "a_requests": len(during),
        "a_errors": sum(1 for r in during if not r.ok),
        "a_tokens_per_s": sum(r.output_tokens for r in during if r.ok) / wall if flood else None,
    }


def run_arm(
    args: argparse.Namespace, cfg: PdserveConfig, model_path: Path, limit: int, logs: Path
) -> dict[str, Any]:
    """One stack with the router's ``max_requests_per_worker`` at ``limit``: b alone, then
    under a's flood."""
    from pydantic import SecretStr

    from pdserve.bench.bench import READY_TIMEOUT_S, bench_stack, stack_settings

    tag = f"limit-{limit}"
    settings = stack_settings(cfg, model_path, {"prefill": 1, "decode": 1})
    keys = [SecretStr(f"{KEYS[t]} tenant={t}") for t in KEYS]
    security = settings.security.model_copy(update={"api_keys": keys})
    settings = settings.model_copy(update={"security": security})
    router_args = {"router": ["--max-requests-per-worker", str(limit)]}
    with bench_stack(settings, logs / tag, args=router_args) as stack:
        stack.start()
        stack.wait_ready(READY_TIMEOUT_S, what=f"the {tag} stack")
        url = f"{stack.url}/v1/chat/completions"
        model = str(stack.settings.model.served_name)
        asyncio.run(_phase(url, model, args, flood=False))  # warm-up, not counted
        alone = asyncio.run(_phase(url, model, args, flood=False))
        flooded = asyncio.run(_phase(url, model, args, flood=True))
    p90_alone, p90_flood = alone["b_ttft_p90_ms"], flooded["b_ttft_p90_ms"]
    ratio = p90_flood / p90_alone if p90_alone and p90_flood else None
    return {"max_requests_per_worker": limit, "alone": alone, "flood": flooded,
            "b_p90_ratio": ratio}  # fmt: skip


def main(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """Run both arms and print the table; 0, or 1 when a probe failed."""
    from pdserve.bench.serving.bench_serve import write_json
    from pdserve.hardware import cpu_model
    from pdserve.models import resolve_model

    path = args.model or (str(cfg.model.path) if cfg.model.path is not None else None)
    model_path = resolve_model(path, cache_dir=cfg.model.cache_dir)
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-fairness-"))
    print(
        f"bench fairness on {cpu_model()} ({os.cpu_count()} CPUs): tenant a floods with "
        f"{args.flood_concurrency} streams of {args.flood_prompt_tokens}-token prompts, tenant "
        f"b sends {args.probe_requests} requests of {args.probe_prompt_tokens}-token prompts one "
        f"at a time; max_tokens "
        f"{args.max_tokens}; logs in {logs}",
        flush=True,
    )
    arms = [run_arm(args, cfg, model_path, limit, logs)
            for limit in (args.max_requests_per_worker, 0)]  # fmt: skip
    print(f"{'router queue':<22}{'b p50 alone':>12}{'b p90 alone':>12}{'b p50 flood':>12}"
          f"{'b p90 flood':>12}{'p90 ratio':>10}{'a tok/s':>9}   (TTFT ms)")  # fmt: skip
    for arm in arms:
        limit = arm["max_requests_per_worker"]
        name = f"fair, {limit} per worker" if limit else "fifo (off)"
        al, fl, r = arm["alone"], arm["flood"], arm["b_p90_ratio"]
        print(f"{name:<22}{_ms(al['b_ttft_p50_ms'])}{_ms(al['b_ttft_p90_ms'])}"
              f"{_ms(fl['b_ttft_p50_ms'])}{_ms(fl['b_ttft_p90_ms'])}"
              f"{'-' if r is None else f'{r:.2f}x':>10}{fl['a_tokens_per_s'] or 0:>9.1f}")  # fmt: skip
    fair = arms[0]["b_p90_ratio"]
    if fair is not None:
        verdict = "met" if fair <= TARGET_P90_RATIO else "missed"
        print(f"b's TTFT p90 under the flood / alone, fair queue: {fair:.2f}x "
              f"(target <= {TARGET_P90_RATIO}x: {verdict})")  # fmt: skip
    if args.json:
        write_json(Path(args.json), {"tool": "pdserve bench fairness", "cpu": cpu_model(),
                                     "args": vars(args), "arms": arms})  # fmt: skip
    failed = any(arm[p]["b_errors"] for arm in arms for p in ("alone", "flood"))
    return 1 if failed else 0


def _ms(v: float | None) -> str:
    return f"{'-':>12}" if v is None else f"{v:>12.1f}"
