"""Restart benchmark of the KV cache connector's disk tier.

``python -m pdserve.tools.bench_kv_restart`` starts the stack ``pdserve bench serve`` starts
(router + 1 prefill worker + 1 decode worker, the SmolLM2 default model, the children's config
written by :func:`pdserve.tools.bench._stack_config`) with ``--kv-disk-cache-dir`` pointing at
a fresh temporary directory, sends one long prompt (about 4,000 tokens by the model's
tokenizer: :func:`pdserve.tools.bench_multiturn.system_prompt`) and times its TTFT: the cold
run, nothing cached anywhere. It waits until the prefill worker's disk tier has written every
queued block (``pdserve_kv_tier_pending_saves`` 0), stops the whole stack (router and every
worker, SIGTERM), starts it again on the same directory and sends the same prompt: the warm
run, the first request after the restart. Before each measured request a short warm-up
request that shares no prefix with it goes through the stack and is not counted.

Reported: TTFT (send -> first content delta, :func:`pdserve.tools.bench_serve.stream_openai`)
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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.settings import PdserveConfig

TARGET_RATIO = 0.5
"""Target: TTFT of the first request after the restart, at most this times cold."""


async def _send(args: argparse.Namespace, router: str, prefill: str, model: str,
                headers: dict[str, str], text: str) -> dict[str, Any]:  # fmt: skip
    """Warm up, send ``text`` once, then wait for the prefill worker's disk writes; returns
    the TTFT (s), prompt tokens and the prefill worker's metrics after the request."""
    import httpx

    from pdserve.tools.bench_multiturn import chat_request, scrape
    from pdserve.tools.bench_serve import stream_openai

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
        while metrics.get("pdserve_kv_tier_pending_saves", 0.0) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            metrics = await scrape(client, prefill)
    return {"ttft_s": res.ttft_s, "prompt_tokens": res.prompt_tokens, "prefill": metrics}


def run_stack(args: argparse.Namespace, cfg: PdserveConfig, model_path: Path, label: str,
              text: str, logs: Path) -> dict[str, Any]:  # fmt: skip
    """Start router + 1 prefill + 1 decode with ``cfg`` (its disk tier set), send ``text``
    (:func:`_send`), stop the stack; returns that run's numbers. Secrets live in a private
    temporary folder."""
    from pdserve.launcher import child_env
    from pdserve.security import load_api_keys
    from pdserve.supervisor import ProcessSupervisor
    from pdserve.tools.bench import _GRACE_S, _READY_TIMEOUT_S, _free_port, _spec, _stack_config

    with tempfile.TemporaryDirectory(prefix="pdserve-bench-secrets-") as secrets:
        file = logs / f"stack-{label}.yaml"
        child = _stack_config(cfg, model_path, {"prefill": 1, "decode": 1}, file, Path(secrets))
        keys = load_api_keys(child.security)
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        env = child_env()
        port, pport, dport = _free_port(), _free_port(), _free_port()
        router, prefill = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{pport}"
        config = ["--config", str(file)]
        print(f"{label}: router + 1 prefill + 1 decode, disk tier {cfg.kv_cache.disk_cache_dir}",
              flush=True)  # fmt: skip
        started = time.perf_counter()
        with ProcessSupervisor(grace_s=max(_GRACE_S, 30.0)) as stack:
            stack.spawn(_spec("router", ["router", *config, "--port", str(port)],
                              logs / f"router-{label}.log", 0, env))  # fmt: skip
            for role, p in (("prefill", pport), ("decode", dport)):
                argv = [role, *config, "--discovery", router, "--port", str(p)]
                stack.spawn(_spec(role, argv, logs / f"{role}-{label}.log", 1, env))
            stack.wait_ready(
                router,
                timeout_s=_READY_TIMEOUT_S,
                what=f"the {label} stack",
                accept=lambda r: bool(r.json()["prefill"]) and bool(r.json()["decode"]),
            )
            start_s = time.perf_counter() - started
            out = asyncio.run(
                _send(args, router, prefill, str(child.model.served_name), headers, text)
            )
    m = out.pop("prefill")
    out.update(
        label=label,
        start_s=start_s,
        disk_hit_tokens=m.get('pdserve_kv_tier_hit_tokens_total{tier="disk"}', 0.0),
        disk_stored_blocks=m.get('pdserve_kv_tier_stored_blocks_total{tier="disk"}', 0.0),
        corrupt_blocks=m.get("pdserve_kv_tier_corrupt_blocks_total", 0.0),
    )
    print(f"{label}: TTFT {out['ttft_s'] * 1e3:.0f} ms, {out['prompt_tokens']} prompt tokens, "
          f"{out['disk_hit_tokens']:.0f} loaded from the disk tier (stack up in "
          f"{start_s:.0f} s)", flush=True)  # fmt: skip
    return out


def dir_usage(folder: Path) -> tuple[int, int]:
    """(block files, bytes) in the disk tier's ``folder``."""
    files = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    return len(files), sum(p.stat().st_size for p in files)


def format_result(cold: dict[str, Any], warm: dict[str, Any], files: int, size: int) -> str:
    """The two TTFTs, their ratio against the target, and what the disk tier held."""
    ratio = warm["ttft_s"] / cold["ttft_s"]
    verdict = "met" if ratio <= TARGET_RATIO else f"missed by {ratio / TARGET_RATIO - 1:.0%}"
    return "\n".join([
        f"{'run':<28} {'TTFT ms':>9} {'prompt tok':>10} {'from disk tier':>14}",
        *(f"{r['label']:<28} {r['ttft_s'] * 1e3:>9.0f} {r['prompt_tokens'] or 0:>10} "
          f"{r['disk_hit_tokens']:>14.0f}" for r in (cold, warm)),
        f"disk tier: {files} block files, {size / 2**20:.1f} MiB",
        f"TTFT after restart / cold: {ratio:.3f}x (target <= {TARGET_RATIO}x: {verdict})",
    ])  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m pdserve.tools.bench_kv_restart``."""
    p = argparse.ArgumentParser(
        prog="python -m pdserve.tools.bench_kv_restart",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=4000,
        help="tokens of the long prompt's text by the model's tokenizer (default: 4000)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens (default: 8)")
    p.add_argument(
        "--model", default=None,
        help="local model folder the stacks serve (default: the converted SmolLM2 in the cache)",
    )  # fmt: skip
    p.add_argument(
        "--disk-dir", default=None,
        help="the disk tier's directory; must be empty or absent (default: a fresh temporary "
        "directory, removed at the end)",
    )  # fmt: skip
    p.add_argument(
        "--request-timeout-s", type=float, default=600.0, help="per-request timeout, seconds"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Cold run, restart, warm run; print the comparison. 0, or 1 when the target is missed
    or the warm run loaded nothing from the disk tier; 2 when ``--disk-dir`` is not empty."""
    from pdserve.config import load_config
    from pdserve.models import resolve_model
    from pdserve.tools.bench_multiturn import _counter, system_prompt
    from pdserve.tools.bench_serve import write_json

    args = build_parser().parse_args(argv)
    cfg, _ = load_config(None)
    model_path = resolve_model(args.model, cache_dir=cfg.model.cache_dir)
    text = system_prompt(args.prompt_tokens, _counter(model_path))
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-kv-restart-"))
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-disk-") as tmp:
        disk = Path(args.disk_dir) if args.disk_dir else Path(tmp)
        if disk.is_dir() and any(disk.iterdir()):
            print(f"{disk} is not empty: the cold run needs an empty disk tier", file=sys.stderr)
            return 2
        tiered = cfg.model_copy(
            update={"kv_cache": cfg.kv_cache.model_copy(update={"disk_cache_dir": disk})}
        )
        print(f"bench kv_restart: one {args.prompt_tokens}-token prompt, max_tokens "
              f"{args.max_tokens}, {os.cpu_count()} cores, model {model_path}", flush=True)  # fmt: skip
        cold = run_stack(args, tiered, model_path, "cold (empty disk tier)", text, logs)
        warm = run_stack(args, tiered, model_path, "after restart (disk tier)", text, logs)
        files, size = dir_usage(disk)
    print(format_result(cold, warm, files, size))
    ratio = warm["ttft_s"] / cold["ttft_s"]
    if args.json:
        write_json(Path(args.json), {
            "tool": "python -m pdserve.tools.bench_kv_restart",
            "argv": sys.argv[1:] if argv is None else list(argv),
            "host": {"cpus": os.cpu_count()},
            "model": str(model_path),
            "runs": [cold, warm],
            "disk_tier": {"files": files, "bytes": size},
            "ttft_ratio": ratio,
            "target_ratio": TARGET_RATIO,
        })  # fmt: skip
        print(f"wrote {args.json}")
    print(f"logs: {logs}")
    return 0 if ratio <= TARGET_RATIO and warm["disk_hit_tokens"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
