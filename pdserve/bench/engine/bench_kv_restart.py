"""Restart benchmark of the KV cache connector's disk tier or remote tier.

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
reboot).

``--tier remote`` does the same with ``kv_cache.remote_cache`` instead (the Redis store at
``--remote-cache URL``, or a redis-server from ``PATH`` started on a free loopback port for
the run): both runs start with empty local caches, the warm one reads the blocks the cold one
stored. Then, on the warm stack, the store is stopped (``SHUTDOWN NOSAVE``, or SIGKILL of the
server it started) and ``--outage-requests`` more requests go through (the long prompt again
and short ones): every one must succeed; their TTFTs and failures are reported. Target: warm /
cold at most 0.2x. Benchmark code only: the router and the workers never import it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig

TARGET_RATIO = 0.5
"""Target: TTFT of the first request after the restart, at most this times cold (disk tier)."""
TARGET_RATIO_REMOTE = 0.2
"""The same with the remote tier (every local cache empty after the restart)."""


def start_redis() -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server from PATH on a free loopback port without persistence, answering PING;
    returns (process, URL). Raises FileNotFoundError without the binary, RuntimeError when it
    does not answer within 10 s."""
    import redis

    from pdserve.config.hosts import free_port

    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not on PATH (Debian: apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10.0
    with redis.Redis(port=port, socket_timeout=1.0) as client:
        while time.monotonic() < deadline:
            try:
                client.ping()
                return proc, f"redis://127.0.0.1:{port}/0"
            except redis.RedisError:
                time.sleep(0.05)  # the poll interval while the server starts
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not answer PING in 10 s")


def stop_store(url: str, proc: subprocess.Popen[bytes] | None) -> None:
    """Stop the store: SIGKILL of the server this run started, else ``SHUTDOWN NOSAVE``."""
    import redis

    if proc is not None:
        proc.kill()
        proc.wait()
        return
    with contextlib.suppress(redis.ConnectionError):  # the server closes the connection
        redis.Redis.from_url(url, socket_timeout=5.0).shutdown(nosave=True)


async def _send(
    args: argparse.Namespace,
    router: str,
    prefill: str,
    model: str,
    headers: dict[str, str],
    text: str,
    outage: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Warm up, send ``text`` once, then wait for the prefill worker's tier writes; returns
    the TTFT (s), prompt tokens and the prefill worker's metrics after the request. With
    ``outage``: call it (the store stops), then send ``args.outage_requests`` more (every
    other one ``text`` again) and add their TTFTs and failures."""
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
        pending = f'pdserve_kv_tier_pending_saves{{tier="{args.tier}"}}'
        metrics = await scrape(client, prefill)
        while metrics.get(pending, 0.0) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            metrics = await scrape(client, prefill)
        out: dict[str, Any] = {"ttft_s": res.ttft_s, "prompt_tokens": res.prompt_tokens}
        if outage is not None:
            outage()
            ttfts, failed = [], []
            for i in range(args.outage_requests):
                # the long prompt again (now in the pool), or a new one the worker must look up
                fresh = f"Outage request {i}: a prompt no worker has seen, so the tier is asked. "
                again = text if i % 2 == 0 else fresh * 24
                body = chat_request(model, [{"role": "user", "content": again}], args.max_tokens)
                r = await stream_openai(client, url, body)
                ttfts.append(r.ttft_s)
                if not r.ok:
                    failed.append(r.error)
            out.update(outage_ttft_s=ttfts, outage_failed=failed)
            metrics = await scrape(client, prefill)
    out["prefill"] = metrics
    return out


def run_stack(
    args: argparse.Namespace,
    cfg: PdserveConfig,
    model_path: Path,
    label: str,
    text: str,
    log_dir: Path,
    outage: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Start router + 1 prefill + 1 decode with ``cfg`` (its tier set; the prefill worker
    on a port of its own for its metrics), send ``text`` (:func:`_send`, with ``outage``),
    stop the stack (30 s grace at least: the tier finishes its writes); returns that run's
    numbers. Logs go to ``log_dir``. Raises ProcessExitedError or ReadyTimeoutError when the
    stack does not start, RuntimeError when a request before the outage fails."""
    from pdserve.bench.bench import GRACE_S, READY_TIMEOUT_S, bench_stack, stack_settings
    from pdserve.config.hosts import free_port

    settings = stack_settings(cfg, model_path, {"prefill": 1, "decode": 1})
    pport = free_port()
    prefill = f"http://127.0.0.1:{pport}"
    tier = cfg.kv_cache.disk_cache_dir if args.tier == "disk" else cfg.kv_cache.remote_cache
    print(f"{label}: router + 1 prefill + 1 decode, {args.tier} tier {tier}", flush=True)
    started = time.perf_counter()
    with bench_stack(
        settings, log_dir, args={"prefill-0": ["--port", str(pport)]}, grace_s=max(GRACE_S, 30.0)
    ) as stack:
        stack.start()
        stack.wait_ready(READY_TIMEOUT_S, what=f"the {label} stack")
        start_s = time.perf_counter() - started
        model = str(stack.settings.model.served_name)
        headers = stack.api_headers()
        out = asyncio.run(_send(args, stack.url, prefill, model, headers, text, outage))
    m = out.pop("prefill")
    t = args.tier
    out.update(
        label=label,
        start_s=start_s,
        hit_tokens=m.get(f'pdserve_kv_tier_hit_tokens_total{{tier="{t}"}}', 0.0),
        stored_blocks=m.get(f'pdserve_kv_tier_stored_blocks_total{{tier="{t}"}}', 0.0),
        corrupt_blocks=m.get(f'pdserve_kv_tier_corrupt_blocks_total{{tier="{t}"}}', 0.0),
        tier_errors=m.get(f'pdserve_kv_tier_errors_total{{tier="{t}"}}', 0.0),
    )
    print(
        f"{label}: TTFT {out['ttft_s'] * 1e3:.0f} ms, {out['prompt_tokens']} prompt tokens, "
        f"{out['hit_tokens']:.0f} loaded from the {t} tier (stack up in {start_s:.0f} s)",
        flush=True,
    )
    return out


def dir_usage(folder: Path) -> tuple[int, int]:
    """(block files, bytes) in the disk tier's ``folder``."""
    files = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    return len(files), sum(p.stat().st_size for p in files)


def store_usage(url: str) -> tuple[int, int]:
    """(pdserve block keys, bytes of their values) in the store at ``url``."""
    import redis

    from pdserve.workers.kv.remote import KEY_PREFIX

    with redis.Redis.from_url(url, socket_timeout=10.0) as client:
        keys = list(client.scan_iter(match=f"{KEY_PREFIX}*", count=1000))
        return len(keys), sum(int(client.strlen(k)) for k in keys)


def format_result(
    cold: dict[str, Any], warm: dict[str, Any], tier: str, held: str, target: float
) -> str:
    """The two TTFTs, their ratio against ``target``, what the tier held (``held``, a line)
    and, for the remote tier, the requests sent while the store was down."""
    ratio = warm["ttft_s"] / cold["ttft_s"]
    verdict = "met" if ratio <= target else f"missed by {ratio / target - 1:.0%}"
    lines = [
        f"{'run':<28} {'TTFT ms':>9} {'prompt tok':>10} {'from ' + tier + ' tier':>16}",
        *(
            f"{r['label']:<28} {r['ttft_s'] * 1e3:>9.0f} {r['prompt_tokens'] or 0:>10} "
            f"{r['hit_tokens']:>16.0f}"
            for r in (cold, warm)
        ),
        held,
        f"TTFT after restart / cold: {ratio:.3f}x (target <= {target}x: {verdict})",
    ]
    if "outage_ttft_s" in warm:
        ms = ", ".join(f"{t * 1e3:.0f}" for t in warm["outage_ttft_s"] if t is not None)
        lines.append(
            f"store stopped, then {len(warm['outage_ttft_s'])} requests: "
            f"{len(warm['outage_failed'])} failed; TTFT ms {ms}; tier errors "
            f"{warm['tier_errors']:.0f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace, cfg: PdserveConfig) -> int:
    """``pdserve bench kv-restart`` (options: :mod:`pdserve.bench.bench_commands`): cold run,
    restart, warm run on ``cfg`` (the resolved settings, its disk or remote tier replaced);
    print the comparison. 0, or 1 when the target is missed, the warm run loaded nothing from
    the tier or a request failed while the store was down; 2 when ``--disk-dir`` is not empty
    or the store at ``--remote-cache`` already holds blocks. Raises as :func:`run_stack` does,
    and FileNotFoundError for ``--tier remote`` without ``--remote-cache`` or redis-server."""
    from pdserve.bench.serving.bench_multiturn import token_counter
    from pdserve.bench.serving.bench_multiturn_workload import system_prompt
    from pdserve.bench.serving.bench_serve import write_json
    from pdserve.models import resolve_model

    path = args.model or (str(cfg.model.path) if cfg.model.path is not None else None)
    model_path = resolve_model(path, cache_dir=cfg.model.cache_dir)
    text = system_prompt(args.prompt_tokens, token_counter(model_path))
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-kv-restart-"))
    target = TARGET_RATIO if args.tier == "disk" else TARGET_RATIO_REMOTE
    print(
        f"bench kv-restart: {args.tier} tier, one {args.prompt_tokens}-token prompt, max_tokens "
        f"{args.max_tokens}, {os.cpu_count()} cores, model {model_path}",
        flush=True,
    )
    with contextlib.ExitStack() as cleanup:
        if args.tier == "disk":
            tmp = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-kv-disk-"))
            disk = Path(args.disk_dir) if args.disk_dir else Path(tmp)
            if disk.is_dir() and any(disk.iterdir()):
                print(
                    f"{disk} is not empty: the cold run needs an empty disk tier", file=sys.stderr
                )
                return 2
            update: dict[str, object] = {"disk_cache_dir": disk}
        else:
            proc = None
            url = args.remote_cache
            if url is None:
                proc, url = start_redis()
                cleanup.callback(proc.kill)
            if store_usage(url)[0]:
                print(f"{url} holds blocks: the cold run needs an empty store", file=sys.stderr)
                return 2
            update = {"remote_cache": url}
        tiered = cfg.model_copy(update={"kv_cache": cfg.kv_cache.model_copy(update=update)})
        label = f"{args.tier} tier"
        cold = run_stack(args, tiered, model_path, f"cold (empty {label})", text, logs / "cold")
        if args.tier == "disk":
            files, size = dir_usage(disk)
            warm = run_stack(
                args, tiered, model_path, f"after restart ({label})", text, logs / "warm"
            )
            held = f"disk tier: {files} block files, {size / 2**20:.1f} MiB"
        else:
            files, size = store_usage(url)
            held = f"remote tier: {files} keys, {size / 2**20:.1f} MiB of values"
            warm = run_stack(
                args, tiered, model_path, f"after restart ({label})", text, logs / "warm",
                outage=lambda: stop_store(url, proc),
            )  # fmt: skip
    print(format_result(cold, warm, args.tier, held, target))
    ratio = warm["ttft_s"] / cold["ttft_s"]
    if args.json:
        write_json(
            Path(args.json),
            {
                "tool": "pdserve bench kv-restart",
                "argv": sys.argv[1:],
                "host": {"cpus": os.cpu_count()},
                "model": str(model_path),
                "tier": args.tier,
                "runs": [cold, warm],
                "tier_usage": {"entries": files, "bytes": size},
                "ttft_ratio": ratio,
                "target_ratio": target,
            },
        )
        print(f"wrote {args.json}")
    print(f"logs: {logs}")
    ok = ratio <= target and warm["hit_tokens"] > 0 and not warm.get("outage_failed")
    return 0 if ok else 1
