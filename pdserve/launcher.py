"""``pdserve up``: a router and N prefill + M decode workers on one machine.

Lifecycle::

    1 START   spawn the router (embedded registry) and the workers as child processes, each in
              its own session so a terminal Ctrl-C reaches only this supervisor
    2 READY   poll the router until every worker is registered and /ready is 200; print the URL
    3 SERVE   watch the children; if one dies, say which and stop the rest
    4 STOP    on Ctrl-C / SIGTERM: SIGTERM workers first (they deregister and free parked
              blocks), then the router; SIGKILL whatever is left after the grace period
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

GRACE_S = 10.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]


def _cli(*args: str, log_level: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "--log-level", log_level, *args]


def worker_commands(
    args: argparse.Namespace, model_path: Path, router_url: str
) -> list[tuple[str, list[str]]]:
    """The (name, argv) of every worker child. Threads are split evenly across workers."""
    n_workers = args.prefill + args.decode
    threads = args.threads or max(1, (os.cpu_count() or 1) // n_workers)
    common = [
        "--model", str(model_path),
        "--served-model-name", args.served_model_name or _default_name(args, model_path),
        "--discovery", router_url,
        "--dtype", args.dtype,
        "--kv-cache-mb", str(args.kv_cache_mb),
        "--tokens-per-block", str(args.tokens_per_block),
        "--max-num-seqs", str(args.max_num_seqs),
        "--threads", str(threads),
        "--transfer-backend", args.transfer_backend,
        "--lease-s", str(args.lease_s),
        "--ucx-devices", "lo",
    ]  # fmt: skip
    if args.max_model_len:
        common += ["--max-model-len", str(args.max_model_len)]
    if args.kv_dtype:
        common += ["--kv-dtype", args.kv_dtype]
    if not args.kv_integrity:
        common += ["--no-kv-integrity"]
    cmds = []
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            name = f"{role}-{i}"
            cmds.append((name, _cli(role, *common, "--worker-id", name, log_level=args.log_level)))
    return cmds


def _default_name(args: argparse.Namespace, model_path: Path) -> str:
    from pdserve.config import DEFAULT_MODEL

    return DEFAULT_MODEL if args.model in (None, DEFAULT_MODEL) else model_path.name


def _wait_ready(
    url: str, expected: int, children: list[Child], timeout_s: float, stopping: Callable[[], bool]
) -> bool:
    """Poll until ready (True) or asked to stop (False); raises on a dead child or timeout."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if stopping():
                return False
            for c in children:
                if c.proc.poll() is not None:
                    raise RuntimeError(
                        f"{c.name} exited with code {c.proc.returncode} while starting"
                    )
            try:
                ready = client.get(f"{url}/ready").status_code == 200
                workers = client.get(f"{url}/registry/workers").json()["workers"]
                if ready and len(workers) >= expected:
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
    raise TimeoutError(f"the stack was not ready within {timeout_s:.0f} s")


def _stop_all(children: list[Child]) -> None:
    workers = [c for c in children if c.name != "router"]
    routers = [c for c in children if c.name == "router"]
    for group in (workers, routers):
        for c in group:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for c in group:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"pdserve: {c.name} did not stop in {GRACE_S:.0f} s; killing it",
                    file=sys.stderr,
                )
                c.proc.kill()
                c.proc.wait()


def run_up(args: argparse.Namespace, model_path: Path) -> int:
    """Run the whole stack until Ctrl-C; returns the exit code."""
    url_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{url_host}:{args.port}"
    name = args.served_model_name or _default_name(args, model_path)
    router_cmd = _cli(
        "router", "--model", str(model_path), "--served-model-name", name,
        "--host", args.host, "--port", str(args.port), "--discovery", "embedded",
        *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
        log_level=args.log_level,
    )  # fmt: skip
    children: list[Child] = []
    stopping = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        children.append(Child("router", subprocess.Popen(router_cmd, start_new_session=True)))
        for wname, cmd in worker_commands(args, model_path, url):
            children.append(Child(wname, subprocess.Popen(cmd, start_new_session=True)))
        print(
            f"pdserve: starting router + {args.prefill} prefill + {args.decode} decode "
            f"worker(s) for {name} ...",
            file=sys.stderr,
        )
        if _wait_ready(
            url, args.prefill + args.decode, children, args.ready_timeout_s, lambda: stopping
        ):
            print(
                f"pdserve: ready. OpenAI-compatible endpoint: {url}/v1  (model {name!r}; Ctrl-C stops)"
            )
        sys.stdout.flush()
        while not stopping:
            for c in children:
                if c.proc.poll() is not None:
                    print(
                        f"pdserve: {c.name} exited with code {c.proc.returncode}; stopping",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.5)
        print("pdserve: stopping ...", file=sys.stderr)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop_all(children)
