"""Benchmarks that print numbers: ``pdserve bench serve`` and ``pdserve bench transfer``.

``serve`` measures TTFT and TPOT of (a) the disaggregated stack (router -> prefill worker -> KV
transfer -> decode worker) and (b) the same model colocated in one worker process (prefill and
decode in one engine, requests sent straight to its ``/internal/generate``), at each concurrency
level, on the same prompts, in one run. Both get the same CPU budget: the disaggregated stack
runs each worker on half the cores, the colocated worker on all of them.

TTFT = time from sending the request to the first token arriving at the client.
TPOT = (time of last token - time of first token) / (tokens - 1), per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.config import DEFAULT_MODEL


@dataclass
class Sample:
    ttft_s: float
    tpot_s: float | None
    tokens: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "--log-level", "warning", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a benchmark process exited while starting")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready in {timeout_s} s")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


async def _one_openai(client: httpx.AsyncClient, url: str, name: str, ids: list[int],
                      max_tokens: int) -> Sample:  # fmt: skip
    body = {"model": name, "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    raise RuntimeError(chunk["error"])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
    return _sample(t0, stamps)


async def _one_colocated(client: httpx.AsyncClient, url: str, ids: list[int],
                         max_tokens: int) -> Sample:  # fmt: skip
    body = {
        "request_id": uuid.uuid4().hex,
        "prompt_token_ids": ids,
        "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "deadline": time.time() + 600,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/internal/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line:
                chunk = json.loads(line)
                if chunk.get("error"):
                    raise RuntimeError(chunk["error"])
                stamps.extend(time.perf_counter() for _ in chunk["token_ids"])
    return _sample(t0, stamps)


def _sample(t0: float, stamps: list[float]) -> Sample:
    if not stamps:
        raise RuntimeError("no tokens received")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return Sample(stamps[0] - t0, tpot, len(stamps))


async def _load(one, prompts: list[list[int]], concurrency: int) -> list[Sample]:  # type: ignore[no-untyped-def]
    sem = asyncio.Semaphore(concurrency)

    async def run(ids: list[int]) -> Sample:
        async with sem:
            return await one(ids)

    return await asyncio.gather(*(run(p) for p in prompts))


def _summary(samples: list[Sample]) -> dict[str, float]:
    ttft = [s.ttft_s * 1e3 for s in samples]
    tpot = [s.tpot_s * 1e3 for s in samples if s.tpot_s is not None]
    return {
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_mean_ms": statistics.fmean(ttft),
        "tpot_p50_ms": statistics.median(tpot),
        "tpot_mean_ms": statistics.fmean(tpot),
    }


def _prompts(n: int, length: int) -> list[list[int]]:
    # Distinct token-id prompts (ids 100..10099 are ordinary tokens in SmolLM2's vocabulary).
    return [[100 + ((i * 7919 + j * 31) % 10000) for j in range(length)] for i in range(n)]


def serve_main(args: argparse.Namespace, model_path: Path) -> int:
    """Run both configurations and print a table; returns 0."""
    import tempfile

    name = args.served_model_name or DEFAULT_MODEL
    cores = os.cpu_count() or 2
    half = str(max(1, cores // 2))
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    common = ["--model", str(model_path), "--served-model-name", name]
    results: dict[tuple[str, int], dict[str, float]] = {}
    prompts = _prompts(args.requests, args.prompt_tokens)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [_spawn(["router", *common, "--port", str(port)], logs / "router.log")]
    for role in ("prefill", "decode"):
        procs.append(_spawn([role, *common, "--discovery", url, "--threads", half,
                             "--transfer-backend", args.transfer_backend, "--ucx-devices", "lo"],
                            logs / f"{role}.log"))  # fmt: skip
    try:
        _wait(url, procs)
        for c in args.concurrency:
            results[("disaggregated", c)] = _run_level(
                lambda client, ids: _one_openai(client, url, name, ids, args.max_tokens), prompts, c
            )
    finally:
        _stop(procs)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    reg = _free_port()
    procs = [
        _spawn(["router", *common, "--port", str(reg)], logs / "router2.log"),
        _spawn(["colocated", *common, "--port", str(port), "--discovery",
                f"http://127.0.0.1:{reg}", "--threads", str(cores)], logs / "colocated.log"),
    ]  # fmt: skip
    try:
        _wait(url, procs)
        for c in args.concurrency:
            results[("colocated", c)] = _run_level(
                lambda client, ids: _one_colocated(client, url, ids, args.max_tokens), prompts, c
            )
    finally:
        _stop(procs)

    print(f"\nmodel {name}, {args.prompt_tokens}-token prompts, {args.max_tokens} output tokens, "
          f"{args.requests} requests per level, {cores} cores")  # fmt: skip
    print(f"{'setup':<14} {'conc':>4} {'TTFT p50 ms':>12} {'TTFT mean':>10} "
          f"{'TPOT p50 ms':>12} {'TPOT mean':>10}")  # fmt: skip
    for (setup, c), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{setup:<14} {c:>4} {r['ttft_p50_ms']:>12.1f} {r['ttft_mean_ms']:>10.1f} "
              f"{r['tpot_p50_ms']:>12.1f} {r['tpot_mean_ms']:>10.1f}")  # fmt: skip
    for c in args.concurrency:
        d, o = results[("disaggregated", c)], results[("colocated", c)]
        print(f"concurrency {c}: disaggregated/colocated TTFT x{d['ttft_p50_ms'] / o['ttft_p50_ms']:.2f}, "
              f"TPOT x{d['tpot_p50_ms'] / o['tpot_p50_ms']:.2f}")  # fmt: skip
    print(f"logs: {logs}")
    return 0


def _run_level(one, prompts: list[list[int]], concurrency: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    async def main() -> list[Sample]:
        async with httpx.AsyncClient(timeout=600) as client:
            await one(client, prompts[0][:16])  # warm-up
            return await _load(lambda ids: one(client, ids), prompts, concurrency)

    return _summary(asyncio.run(main()))


def transfer_main(args: argparse.Namespace) -> int:
    """KV transfer per backend beside raw-socket and memcpy references, with fits and the
    issue's targets (:mod:`pdserve.transfer.bench`, :mod:`pdserve.transfer.bench_report`)."""
    from pdserve.transfer.bench_report import run_from_args

    return run_from_args(args)
