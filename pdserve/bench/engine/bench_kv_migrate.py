"""Migration benchmark: what a stream whose decode worker is killed mid-stream waits, with the
KV cache connector's remote tier, with the peer prefix pull, and with neither.

``pdserve bench kv-migrate`` starts router + 1 prefill + 2 decode workers (the SmolLM2 default
model, settings from ``--config`` and ``PDSERVE_*`` variables, :func:`pdserve.bench.bench.
stack_settings`) three times in one sitting: with ``kv_cache.remote_cache`` on a Redis store
(``--remote-cache URL``, or a redis-server from ``PATH`` started on a free loopback port and
flushed first) and the peer prefix pull off; with the peer prefix pull
(``router.peer_pull_min_tokens`` as configured, 64 by default: the new worker pulls the
prompt's blocks from the prefill worker's cache) and no tier; with neither (the baseline: the
new worker recomputes).
In each arm it sends a short warm-up request, then a long prompt (about ``--prompt-tokens``
tokens by the model's tokenizer, :func:`pdserve.bench.serving.bench_multiturn_workload.
system_prompt`) streamed with ``max_tokens`` ``--max-tokens``, greedy: its TTFT is the *cold
prefill* (nothing cached anywhere). Then a second long prompt (the same text behind a new
first line, so no block is shared) is streamed; after ``--kill-after`` content deltas the
decode worker serving it (the one whose ``/load`` shows a running sequence) is killed with
SIGKILL, and the router migrates the stream to the other decode worker, which prefills prompt
+ the tokens already sent (:mod:`pdserve.workers.engine.resume`).

Reported per arm: the cold prefill's TTFT, the migrated stream's *stall* (the longest gap
between content deltas, the one around the kill) and its *added latency* (the stall minus
that stream's median inter-token latency), added latency / cold prefill against the issue's
target (at most 0.3x with the tier and with the pull), the tokens the new worker loaded from
the tier (``pdserve_kv_tier_hit_tokens_total{tier="remote"}`` on its ``/metrics``) and the
blocks it pulled from a peer (``pdserve_kv_peer_prefix_blocks_total``). The stream must end
without an error and with every token (the greedy text equals an undisturbed run of the same
prompt, sent once more afterwards). Benchmark code only: the router and the workers never
import it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig

DESCRIPTION = """\
A stream whose decode worker is killed mid-stream, with the KV cache's remote tier, with the peer
prefix pull, and with neither: three stacks of router + 1 prefill + 2 decode on the default
model, one with kv_cache.remote_cache on a Redis store (--remote-cache, or a redis-server from
PATH started for the run) and the pull off, one with the pull
(router.peer_pull_min_tokens) and no tier, one with neither. Each times a long prompt's TTFT (the cold prefill), then streams a second long prompt
greedily and kills (SIGKILL) the decode worker serving it after --kill-after tokens; the router
migrates the stream to the other decode worker, which prefills prompt + the tokens sent (from
the tier when it holds them, or pulled from the prefill worker's cache).

Reported per arm: the cold prefill, the stream's stall around the kill and its added latency
(the stall minus the stream's median inter-token gap), added latency / cold prefill against
the target (at most 0.3x with the tier and with the pull), the tokens the new worker loaded
from the tier and the blocks it pulled, and whether the migrated text equals an undisturbed
run. Exit 1 when a target is missed, nothing was loaded or pulled, or a text differs. The stacks take their other settings from --config and
PDSERVE_* variables.
"""

TARGET_RATIO = 0.3
"""Target: the migrated leg's added latency, at most this times the prompt's cold prefill."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``pdserve bench kv-migrate``'s own options (the model, timeout and JSON ones are the
    bench commands' shared ones)."""
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=2000,
        help="tokens of the long prompt's text by the model's tokenizer (default: 2000)",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens (default: 48)")
    p.add_argument(
        "--kill-after",
        type=int,
        default=8,
        help="content deltas of the stream before its decode worker is killed (default: 8)",
    )
    p.add_argument(
        "--remote-cache",
        default=None,
        metavar="URL",
        help="the remote tier's Redis store, flushed first (default: a redis-server from PATH "
        "on a free loopback port, started for the run)",
    )


async def stream(
    client: Any, url: str, body: dict[str, Any], on_delta: Any = None
) -> tuple[list[float], str, str | None]:
    """Stream one chat completion: (each content delta's arrival time, perf_counter seconds;
    the text; the error, None when the stream ended with a finish reason). ``on_delta(n)`` is
    called after the n-th delta (1-based)."""
    stamps: list[float] = []
    text, error, finished = "", None, False
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return stamps, text, f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = str(chunk["error"].get("message", chunk["error"]))
                break
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    stamps.append(time.perf_counter())
                    text += delta
                    if on_delta is not None:
                        on_delta(len(stamps))
                finished = finished or choice.get("finish_reason") is not None
    if error is None and not finished:
        error = "the stream ended without a finish reason"
    return stamps, text, error


def run_arm(
    args: argparse.Namespace,
    cfg: PdserveConfig,
    model_path: Path,
    label: str,
    text: str,
    log_dir: Path,
) -> dict[str, Any]:
    """One arm (see the module docstring) on ``cfg``; returns its numbers. Raises RuntimeError
    when a request fails or no decode worker shows the stream."""
    import httpx

    from pdserve.bench.bench import READY_TIMEOUT_S, bench_stack, stack_settings
    from pdserve.bench.scrape import scrape
    from pdserve.bench.serving.bench_multiturn import chat_request
    from pdserve.config.hosts import free_port

    settings = stack_settings(cfg, model_path, {"prefill": 1, "decode": 2})
    ports = {name: free_port() for name in ("decode-0", "decode-1")}
    print(f"{label}: router + 1 prefill + 2 decode", flush=True)
    with bench_stack(
        settings, log_dir, args={n: ["--port", str(p)] for n, p in ports.items()}
    ) as stack:
        stack.start()
        stack.wait_ready(READY_TIMEOUT_S, what=f"the {label} stack")
        model = str(stack.settings.model.served_name)
        url = f"{stack.url}/v1/chat/completions"
        killed: list[str] = []

        def body(content: str) -> dict[str, Any]:
            out = chat_request(model, [{"role": "user", "content": content}], args.max_tokens)
            return {**out, "temperature": 0.0, "ignore_eos": True}

        def kill_serving(n: int) -> None:
            if n != args.kill_after or killed:
                return
            for name, port in ports.items():
                load = httpx.get(f"http://127.0.0.1:{port}/load", timeout=5.0).json()
                if load.get("running", 0):
                    stack.procs[name].kill(signal.SIGKILL)
                    killed.append(name)
                    return

        async def main() -> dict[str, Any]:
            timeout = httpx.Timeout(args.request_timeout_s, connect=30)
            async with httpx.AsyncClient(timeout=timeout, headers=stack.api_headers()) as client:
                _, _, err = await stream(client, url, body("Say hello in five words."))
                if err:
                    raise RuntimeError(f"warm-up failed: {err}")
                t0 = time.perf_counter()
                stamps, _, err = await stream(client, url, body(text))
                if err or not stamps:
                    raise RuntimeError(f"the cold request failed: {err}")
                cold_ttft = stamps[0] - t0
                moved = f"Second document, read it as new.\n{text}"
                stamps, got, err = await stream(client, url, body(moved), kill_serving)
                if err:
                    raise RuntimeError(f"the migrated stream failed: {err}")
                if not killed:
                    raise RuntimeError("no decode worker showed the stream: nothing was killed")
                _, again, err = await stream(client, url, body(moved))
                if err:
                    raise RuntimeError(f"the undisturbed rerun failed: {err}")
                survivor = next(p for n, p in ports.items() if n not in killed)
                metrics = await scrape(client, f"http://127.0.0.1:{survivor}")
            gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            stall = max(gaps)
            return {
                "label": label,
                "cold_ttft_s": cold_ttft,
                "stall_s": stall,
                "added_s": stall - statistics.median(gaps),
                "tokens": len(stamps),
                "exact": got == again,
                "loaded_tokens": metrics.get(
                    'pdserve_kv_tier_hit_tokens_total{tier="remote"}', 0.0
                ),
                "pulled_blocks": metrics.get("pdserve_kv_peer_prefix_blocks_total", 0.0),
                "killed": killed[0],
            }

        out = asyncio.run(main())
    ratio = out["added_s"] / out["cold_ttft_s"]
    out["ratio"] = ratio
    print(
        f"{label}: cold prefill {out['cold_ttft_s'] * 1e3:.0f} ms; killed {out['killed']} after "
        f"{args.kill_after} tokens; stall {out['stall_s'] * 1e3:.0f} ms, added "
        f"{out['added_s'] * 1e3:.0f} ms = {ratio:.3f}x cold; {out['loaded_tokens']:.0f} tokens "
        f"loaded from the tier, {out['pulled_blocks']:.0f} blocks pulled from a peer; text equal to an undisturbed run: {out['exact']}",
        flush=True,
    )
    return out


def run(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """``pdserve bench kv-migrate`` (options: :mod:`pdserve.bench.bench_commands`): the three
    arms, then the comparison. 0, or 1 when a target is missed, the tier loaded or the pull
    moved nothing, or a migrated stream's text differs from an undisturbed run. Raises as :func:`run_arm` does, and
    FileNotFoundError without ``--remote-cache`` or redis-server."""
    import redis

    from pdserve.bench.engine.bench_kv_restart import start_redis
    from pdserve.bench.serving.bench_multiturn import token_counter
    from pdserve.bench.serving.bench_multiturn_workload import system_prompt
    from pdserve.bench.serving.bench_serve import write_json
    from pdserve.models import resolve_model

    path = args.model or (str(cfg.model.path) if cfg.model.path is not None else None)
    model_path = resolve_model(path, cache_dir=cfg.model.cache_dir)
    text = system_prompt(args.prompt_tokens, token_counter(model_path))
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-kv-migrate-"))
    print(
        f"bench kv-migrate: one {args.prompt_tokens}-token prompt, max_tokens {args.max_tokens}, "
        f"kill after {args.kill_after} tokens, {os.cpu_count()} cores, model {model_path}",
        flush=True,
    )
    proc, url = (None, args.remote_cache) if args.remote_cache else start_redis()
    try:
        redis.Redis.from_url(url).flushdb()
        pull = cfg.router.peer_pull_min_tokens or 64
        no_pull = cfg.model_copy(
            update={"router": cfg.router.model_copy(update={"peer_pull_min_tokens": 0})}
        )
        tiered = no_pull.model_copy(
            update={"kv_cache": cfg.kv_cache.model_copy(update={"remote_cache": url})}
        )
        pulling = cfg.model_copy(
            update={"router": cfg.router.model_copy(update={"peer_pull_min_tokens": pull})}
        )
        arms = [
            run_arm(args, tiered, model_path, "remote tier", text, logs / "remote"),
            run_arm(args, pulling, model_path, "peer pull", text, logs / "pull"),
            run_arm(args, no_pull, model_path, "neither (recompute)", text, logs / "none"),
        ]
    finally:
        if proc is not None:
            proc.kill()
    tier, peer, none = arms

    def verdict(arm: dict[str, Any]) -> str:
        r = arm["ratio"]
        return "met" if r <= TARGET_RATIO else f"missed by {r / TARGET_RATIO - 1:.0%}"

    print(
        f"added latency of the migrated leg / cold prefill: {tier['ratio']:.3f}x with the remote "
        f"tier ({verdict(tier)}), {peer['ratio']:.3f}x with the peer pull ({verdict(peer)}), "
        f"{none['ratio']:.3f}x with neither (target <= {TARGET_RATIO}x)"
    )
    if args.json:
        write_json(
            Path(args.json),
            {
                "tool": "pdserve bench kv-migrate",
                "argv": sys.argv[1:],
                "host": {"cpus": os.cpu_count()},
                "model": str(model_path),
                "arms": arms,
                "target_ratio": TARGET_RATIO,
            },
        )
        print(f"wrote {args.json}")
    print(f"logs: {logs}")
    ok = tier["ratio"] <= TARGET_RATIO and tier["loaded_tokens"] > 0
    ok = ok and peer["ratio"] <= TARGET_RATIO and peer["pulled_blocks"] > 0
    return 0 if ok and all(a["exact"] for a in arms) else 1
