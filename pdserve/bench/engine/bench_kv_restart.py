"""Restart benchmark of the KV cache connector's disk tier.

``pdserve bench kv-restart`` starts the stack ``pdserve bench serve`` starts (router + 1
prefill worker + 1 decode worker, the SmolLM2 default model, settings from ``--config`` and
``PDSERVE_*`` variables resolved by :func:`pdserve.bench.bench.stack_settings`, started by
:func:`pdserve.bench.bench.bench_stack`) with ``kv_cache.disk_cache_dir`` pointing at
a fresh temporary directory, sends one long prompt (about 4,000 tokens by the model's
tokenizer: :func:`pdserve.bench.serving.bench_multiturn.system_prompt`) and times its TTFT: the cold
run, nothing cached anywhere. It waits until the prefill worker's disk tier has written every
queued block (``pdserve_kv_tier_pending_saves`` 0 on its ``/metrics``,
:mod:`pdserve.bench.scrape`), stops the whole stack (router and every
worker, SIGTERM), starts it again on the same directory and sends the same prompt: the warm
run, the first request after the restart. Before each measured request a short warm-up
request that shares no prefix with it goes through the stack and is not counted.

Reported: TTFT (send -> first content delta, :func:`pdserve.bench.serving.bench_serve.stream_openai`)
of both runs, warm / cold against the issue's target (at most 0.5x), the prompt's tokens, the
tokens the restarted prefill worker loaded from the disk tier instead of computing
(``pdserve_kv_tier_hit_tokens_total{tier="disk"}``) and the directory's files and bytes.
The files stay in the operating system's page cache between the runs (a restart, not a
reboot). Benchmark code only: the router and the workers never import it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig

TARGET_RATIO = 0.5
"""Target: TTFT of the first request after the restart, at most this times cold."""


async def _send(
    args: argparse.Namespace,
    router: str,
    prefill: str,
    model: str,
    headers: dict[str, str],
    text: str,
) -> dict[str, Any]:
    """Warm up, send ``text`` once, then wait for the prefill worker's disk writes; returns
    the TTFT (s), prompt tokens and the prefill worker's metrics after the request."""
    import httpx

    from pdserve.bench.scrape import scrape
    from pdserve.bench.serving.bench_multiturn import chat_request
    from pdserve.bench.serving.bench_serve import stream_openai

    url = f"{router}/v1/chat/completions"
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(args.request_timeout_s, connect=30), headers=headers
    ) as client:
        for warm in ("Say hello in five words.", "Name three rivers of Europe, briefly."):
            body = chat_request(model, [{"role": "user", "content": warm}], args.max_tokens)
            w = await stream_openai(client, url, body)
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        body = chat_request(model, [{"role": "user", "content": text}], args.max_tokens)
        res = await stream_openai(client, url, body)
        if not res.ok:
            raise RuntimeError(f"the long request failed: {res.error}")
        deadline = time.monotonic() + 120.0
        metrics = await scrape(client, prefill)
        while (
            metrics.get('pdserve_kv_tier_pending_saves{tier="disk"}', 0.0)
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.2)
            metrics = await scrape(client, prefill)
    return {"ttft_s": res.ttft_s, "prompt_tokens": res.prompt_tokens, "prefill": metrics}


def run_stack(
    args: argparse.Namespace,
    cfg: PdserveConfig,
    model_path: Path,
    label: str,
    text: str,
    log_dir: Path,
) -> dict[str, Any]:
    """Start router + 1 prefill + 1 decode with ``cfg`` (its disk tier set; the prefill worker
    on a port of its own for its metrics), send ``text`` (:func:`_send`), stop the stack (30 s
    grace at least: the disk tier finishes its writes); returns that run's numbers. Logs go to
    ``log_dir``. Raises ProcessExitedError or ReadyTimeoutError when the stack does not start,
    RuntimeError when a request fails."""
    from pdserve.bench.bench import GRACE_S, READY_TIMEOUT_S, bench_stack, stack_settings
    from pdserve.config.hosts import free_port

    settings = stack_settings(cfg, model_path, {"prefill": 1, "decode": 1})
    pport = free_port()
    prefill = f"http://127.0.0.1:{pport}"
    print(
        f"{label}: router + 1 prefill + 1 decode, disk tier {cfg.kv_cache.disk_cache_dir}",
        flush=True,
    )
    started = time.perf_counter()
    with bench_stack(
        settings, log_dir, args={"prefill-0": ["--port", str(pport)]}, grace_s=max(GRACE_S, 30.0)
    ) as stack:
        stack.start()
        stack.wait_ready(READY_TIMEOUT_S, what=f"the {label} stack")
        start_s = time.perf_counter() - started
        model = str(stack.settings.model.served_name)
        out = asyncio.run(_send(args, stack.url, prefill, model, stack.api_headers(), text))
    m = out.pop("prefill")
    out.update(
        label=label,
        start_s=start_s,
        disk_hit_tokens=m.get('pdserve_kv_tier_hit_tokens_total{tier="disk"}', 0.0),
        disk_stored_blocks=m.get('pdserve_kv_tier_stored_blocks_total{tier="disk"}', 0.0),
        corrupt_blocks=m.get('pdserve_kv_tier_corrupt_blocks_total{tier="disk"}', 0.0),
    )
    print(
        f"{label}: TTFT {out['ttft_s'] * 1e3:.0f} ms, {out['prompt_tokens']} prompt tokens, "
        f"{out['disk_hit_tokens']:.0f} loaded from the disk tier (stack up in "
        f"{start_s:.0f} s)",
        flush=True,
    )
    return out


def dir_usage(folder: Path) -> tuple[int, int]:
    """(block files, bytes) in the disk tier's ``folder``."""
    files = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    return len(files), sum(p.stat().st_size for p in files)


def format_result(cold: dict[str, Any], warm: dict[str, Any], files: int, size: int) -> str:
    """The two TTFTs, their ratio against the target, and what the disk tier held."""
    ratio = warm["ttft_s"] / cold["ttft_s"]
    verdict = "met" if ratio <= TARGET_RATIO else f"missed by {ratio / TARGET_RATIO - 1:.0%}"
    return "\n".join(
        [
            f"{'run':<28} {'TTFT ms':>9} {'prompt tok':>10} {'from disk tier':>14}",
            *(
                f"{r['label']:<28} {r['ttft_s'] * 1e3:>9.0f} {r['prompt_tokens'] or 0:>10} "
                f"{r['disk_hit_tokens']:>14.0f}"
                for r in (cold, warm)
            ),
            f"disk tier: {files} block files, {size / 2**20:.1f} MiB",
            f"TTFT after restart / cold: {ratio:.3f}x (target <= {TARGET_RATIO}x: {verdict})",
        ]
    )


def run(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """``pdserve bench kv-restart`` (options: :mod:`pdserve.bench.bench_commands`): cold run,
    restart, warm run on ``cfg`` (the resolved settings, its disk tier replaced); print the
    comparison. 0, or 1 when the target is missed or the warm run loaded nothing from the disk
    tier; 2 when ``--disk-dir`` is not empty. Raises as :func:`run_stack` does."""
    from pdserve.bench.serving.bench_multiturn import token_counter
    from pdserve.bench.serving.bench_multiturn_workload import system_prompt
    from pdserve.bench.serving.bench_serve import write_json
    from pdserve.models import resolve_model

    path = args.model or (str(cfg.model.path) if cfg.model.path is not None else None)
    model_path = resolve_model(path, cache_dir=cfg.model.cache_dir)
    text = system_prompt(args.prompt_tokens, token_counter(model_path))
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-kv-restart-"))
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-disk-") as tmp:
        disk = Path(args.disk_dir) if args.disk_dir else Path(tmp)
        if disk.is_dir() and any(disk.iterdir()):
            print(f"{disk} is not empty: the cold run needs an empty disk tier", file=sys.stderr)
            return 2
        tiered = cfg.model_copy(
            update={"kv_cache": cfg.kv_cache.model_copy(update={"disk_cache_dir": disk})}
        )
        print(
            f"bench kv-restart: one {args.prompt_tokens}-token prompt, max_tokens "
            f"{args.max_tokens}, {os.cpu_count()} cores, model {model_path}",
            flush=True,
        )
        cold = run_stack(args, tiered, model_path, "cold (empty disk tier)", text, logs / "cold")
        warm = run_stack(args, tiered, model_path, "after restart (disk tier)", text, logs / "warm")
        files, size = dir_usage(disk)
    print(format_result(cold, warm, files, size))
    ratio = warm["ttft_s"] / cold["ttft_s"]
    if args.json:
        write_json(
            Path(args.json),
            {
                "tool": "pdserve bench kv-restart",
                "argv": sys.argv[1:],
                "host": {"cpus": os.cpu_count()},
                "model": str(model_path),
                "runs": [cold, warm],
                "disk_tier": {"files": files, "bytes": size},
                "ttft_ratio": ratio,
                "target_ratio": TARGET_RATIO,
            },
        )
        print(f"wrote {args.json}")
    print(f"logs: {logs}")
    return 0 if ratio <= TARGET_RATIO and warm["disk_hit_tokens"] > 0 else 1
