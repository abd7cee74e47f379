"""``pdserve bench router``: what the router adds to a request, and how many it can route.

A child process serves, in one event loop, a scripted colocated worker (its request plane
answers every ``/internal/generate`` at once with ``--tokens`` NDJSON chunks, no model) and
a real router app (``pdserve.server.app.create_app``) whose discovery view holds that worker.
This process sends the same streamed requests two ways, at each ``--concurrency``: through
the router's ``/v1/completions`` (prompt as token ids) and straight to the worker's
``/internal/generate`` (what the router itself sends). The router's added latency is the
difference of the two p50s; its request rate is the router path's completed requests per
second; its CPU per request is the child's CPU time (user + system, from /proc) over the routed
requests less that over the direct ones, per request: unlike the latencies, it does not move
with what else the machine runs. Client, router and worker share the machine: on few cores the
latencies include their contention (the CPU model is printed). The router speaks and loops as
``pdserve router`` does (``--http``, ``--loop``, ``--worker-client``: the router's settings, same defaults); the
scripted worker speaks httptools, as workers do. ``--routers N`` starts N such child processes, their
routers on one port with SO_REUSEPORT (as ``pdserve up --routers N`` runs them), each routing to
its own scripted worker, so the request rate shows how router processes scale. Diagnostic
code: the scripted worker is the benchmark's own, never a serving path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.http.uvicorn_protocol import HttpImpl

SECRET_ENV = "PDSERVE_BENCH_ROUTER_SECRET"
_PREFIX = "BENCH-ROUTER "


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pdserve bench router``."""
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=200, help="requests per concurrency and path")
    p.add_argument("--tokens", type=int, default=16, help="tokens each stream carries")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (token ids)")
    p.add_argument(
        "--routers", type=int, default=1, help="router processes on one port (SO_REUSEPORT)"
    )
    p.add_argument(
        "--http", choices=("httptools", "h11"), default="httptools", help="the router's parser"
    )
    p.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the router's loop"
    )
    p.add_argument(
        "--client",
        choices=("wire", "httpx"),
        default="wire",
        help="the load generator's HTTP client (wire: pdserve's lean one, leaving the cores to "
        "the router; httpx: as in the sittings before 2026-12-08)",
    )
    p.add_argument(
        "--worker-client",
        choices=("wire", "httpx"),
        default="wire",
        help="the router's client of the worker request plane (router.worker_client)",
    )


def main(args: argparse.Namespace) -> int:
    """Start the child, measure both paths per concurrency, print the table; returns 0."""
    from pdserve.config.hosts import free_port
    from pdserve.hardware import cpu_model
    from pdserve.security import generate_secret

    env = {**os.environ, SECRET_ENV: generate_secret()}
    port = str(free_port())
    cmd = [sys.executable, "-m", "pdserve.bench.serving.bench_router", str(args.tokens), port]
    cmd += [args.http, args.loop, args.worker_client]
    children = []
    try:
        urls: dict[str, str] = {}
        for _ in range(args.routers):
            child = subprocess.Popen(
                cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            children.append(child)
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line.startswith(_PREFIX):
                raise RuntimeError(f"the benchmark's server did not start: {line!r}")
            urls = urls or json.loads(line[len(_PREFIX) :])
        rows = asyncio.run(_measure(args, urls, env[SECRET_ENV], [c.pid for c in children]))
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
        for child in children:
            child.wait(15)
    print(
        f"router overhead on {cpu_model()} ({os.cpu_count()} CPUs), {args.tokens}-token "
        f"streams, {args.prompt_tokens}-token prompts, {args.requests} requests per row, "
        f"{args.routers} router process(es), --http {args.http} --loop {args.loop} "
        f"--worker-client {args.worker_client}, load from --client {args.client}"
    )
    print(
        f"{'conc':>5}{'direct p50 ms':>15}{'router p50 ms':>15}{'added ms':>10}"
        f"{'router req/s':>14}{'router CPU us/req':>19}"
    )
    for c, direct, routed, rate, cpu_us in rows:
        cpu = "n/a" if cpu_us is None else f"{cpu_us:.0f}"
        print(f"{c:>5}{direct:>15.2f}{routed:>15.2f}{routed - direct:>10.2f}{rate:>14.1f}{cpu:>19}")
    return 0


def _cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds the processes ``pids`` have used (Linux's /proc); None where
    /proc is not there."""
    total = 0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    except OSError:
        return None
    return total / os.sysconf("SC_CLK_TCK")


async def _measure(
    args: argparse.Namespace, urls: dict[str, str], secret: str, pids: list[int]
) -> list[tuple[int, float, float, float, float | None]]:
    """Per concurrency: (concurrency, direct p50 ms, routed p50 ms, routed req/s, the router's
    CPU us per request or None)."""
    import httpx

    from pdserve.http.plane_client import HttpxPlane, RequestPlane, WirePlane
    from pdserve.protocol import GenerationRequest, SamplingParams
    from pdserve.security import ClusterKey

    key = ClusterKey(secret.encode())
    prompt = [1000 + i % 5000 for i in range(args.prompt_tokens)]
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    rows = []
    json_type = {"content-type": "application/json"}
    worker_headers = {**key.http_headers(), **json_type}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    # Without TCP_NODELAY the client's request body waits for the ACK of its headers, which the
    # server delays by 40 ms (Nagle + delayed ACK): that would be the figure, not the router.
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=nodelay)
    async with httpx.AsyncClient(timeout=60, transport=transport, trust_env=False) as http:
        to_worker: RequestPlane
        to_router: RequestPlane
        if args.client == "wire":
            to_worker = WirePlane(worker_headers, keepalive_s=60)
            to_router = WirePlane(json_type, keepalive_s=60)
        else:
            to_worker, to_router = HttpxPlane(http, worker_headers), HttpxPlane(http, json_type)

        async def one(plane: RequestPlane, url: str, body: bytes) -> None:
            resp = await plane.post(url, body, timeout_s=60, connect_timeout_s=5)
            try:
                if resp.status_code != 200:
                    raise RuntimeError(f"{url} answered {resp.status_code}: {await resp.aread()!r}")
                async for _ in resp.aiter_bytes():
                    pass
            finally:
                await resp.aclose()

        async def direct(i: int) -> None:
            req = GenerationRequest(
                request_id=f"d{i}",
                prompt_token_ids=tuple(prompt),
                sampling=sampling,
                deadline=time.time() + 60,
            )
            body = req.model_dump_json().encode()
            await one(to_worker, f"{urls['worker']}/internal/generate", body)

        routed_body = json.dumps(
            {
                "model": urls["model"],
                "prompt": prompt,
                "max_tokens": args.tokens,
                "temperature": 0,
                "stream": True,
            }
        ).encode()

        async def routed(i: int) -> None:
            await one(to_router, f"{urls['router']}/v1/completions", routed_body)

        for c in args.concurrency:
            cpu0 = _cpu_seconds(pids)
            d, _ = await _run(direct, args.requests, c)
            cpu1 = _cpu_seconds(pids)
            r, seconds = await _run(routed, args.requests, c)
            cpu2 = _cpu_seconds(pids)
            cpu_us = None
            if cpu0 is not None and cpu1 is not None and cpu2 is not None:
                cpu_us = ((cpu2 - cpu1) - (cpu1 - cpu0)) / args.requests * 1e6
            rows.append((c, d, r, args.requests / seconds, cpu_us))
        await to_worker.aclose()
        await to_router.aclose()
    return rows


async def _run(one: Any, n: int, concurrency: int) -> tuple[float, float]:
    """Run ``one(i)`` for i < n, ``concurrency`` at a time; (p50 latency ms, wall seconds)."""
    times: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def timed(i: int) -> None:
        async with sem:
            start = time.perf_counter()
            await one(i)
            times.append(time.perf_counter() - start)

    await asyncio.gather(*(timed(i) for i in range(min(concurrency, n))))  # warm-up
    times.clear()
    start = time.perf_counter()
    await asyncio.gather(*(timed(i) for i in range(n)))
    return statistics.median(times) * 1e3, time.perf_counter() - start


async def _serve(tokens: int, router_port: int, http: HttpImpl, worker_client: str) -> None:
    """The child: the scripted worker and the router (on ``router_port``, shared with the other
    children by SO_REUSEPORT; speaking ``http``; calling the worker with ``worker_client``),
    until stdin closes."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from pdserve.config.hosts import listening_socket
    from pdserve.config.loading import RouterConfig
    from pdserve.config.settings import RouterSettings
    from pdserve.http.uvicorn_protocol import server_protocol
    from pdserve.models import resolve_model
    from pdserve.protocol import (
        FinishReason,
        GenerationChunk,
        GenerationRequest,
        KVLayout,
        Role,
        WorkerLoad,
        WorkerRecord,
    )
    from pdserve.security import ClusterKey
    from pdserve.server.app import create_app
    from pdserve.workers.roles.worker_app import bind_socket

    key = ClusterKey(os.environ[SECRET_ENV].encode())

    async def generate(request: Request) -> Response:
        if not key.check_http(request.headers.get("authorization")):
            return Response(status_code=401)
        req = GenerationRequest.model_validate_json(await request.body())

        async def stream() -> Any:
            for i in range(tokens):
                last = i == tokens - 1
                yield (
                    GenerationChunk(
                        request_id=req.request_id,
                        token_ids=(65 + i % 26,),
                        text=chr(65 + i % 26),
                        finish_reason=FinishReason.LENGTH if last else None,
                    )
                    .model_dump_json()
                    .encode()
                    + b"\n"
                )

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    worker = Starlette(routes=[Route("/internal/generate", generate, methods=["POST"])])

    socks = [  # the worker's listening socket (as workers bind it), the router's shared one
        bind_socket("127.0.0.1", 0),
        listening_socket("127.0.0.1", router_port, reuse_port=True),
    ]
    worker_url, router_url = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks)
    model_path = resolve_model(None)
    layout = KVLayout(
        model="bench",
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        tokens_per_block=16,
        dtype="float32",
    )
    record = key.sign_record(
        WorkerRecord(
            role=Role.COLOCATED,
            worker_id="bench-worker",
            epoch=1,
            model="bench",
            http_url=worker_url,
            layout=layout,
            load=WorkerLoad(free_blocks=1 << 20, total_blocks=1 << 20),
        )
    )

    class Watcher:
        def workers(self) -> dict[str, WorkerRecord]:
            return {record.worker_id: record}

        def subscribe(self, callback: Any) -> None:
            pass

    cfg = RouterConfig(
        model_path=model_path,
        served_model_name="bench",
        router=RouterSettings(worker_client=worker_client),
    )
    router = create_app(cfg, watcher=Watcher(), cluster_key=key)
    protocols = (
        server_protocol(),
        server_protocol(http),
    )  # the worker's (as workers), the router's
    servers = [
        uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, http=proto))
        for app, proto in zip((worker, router), protocols, strict=True)
    ]
    tasks = [asyncio.create_task(s.serve(sockets=[k])) for s, k in zip(servers, socks, strict=True)]
    while not all(s.started for s in servers):
        await asyncio.sleep(0.05)
    print(
        _PREFIX + json.dumps({"worker": worker_url, "router": router_url, "model": "bench"}),
        flush=True,
    )
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks)


if __name__ == "__main__":
    from pdserve.http.event_loop import run

    argv = sys.argv
    run(_serve(int(argv[1]), int(argv[2]), argv[3], argv[5]), argv[4])  # type: ignore[arg-type]
