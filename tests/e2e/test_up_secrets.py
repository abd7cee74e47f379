"""``pdserve up --api-key K``: the key reaches the router, yet no child process of ``up`` (router,
worker, anything they start) carries it on its command line or in its environment; ``up``
warns that its own command line shows the key (issue 39: any local user reads ``ps``).

One ``up`` on the tiny model with one colocated worker (the workers' argv comes from the same
builder for every role), stopped as soon as the router answers; nothing waits for the model.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.procfs import cmdline, descendants
from tests.support.servers import free_port, wait_until_sync


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def test_up_keeps_the_api_key_off_its_children_command_lines(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    key = f"sk-argv-{secrets.token_hex(12)}"
    port = free_port()
    log = tmp_path / "up.log"
    argv = [
        sys.executable, "-m", "pdserve.cli", "up", "--model", str(tiny_model_dir),
        "--port", str(port), "--registry-port", str(free_port()), "--no-compile",
        "--prefill", "0", "--decode", "0", "--colocated", "1", "--api-key", key,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    with open(log, "wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:

        def serving() -> bool:
            assert up.poll() is None, log.read_text(errors="replace")[-3000:]
            names = [cmdline(pid) for pid in descendants(up.pid)]
            if not any("--worker-id" in a for a in names):
                return False
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                              headers={"Authorization": f"Bearer {key}"}, timeout=2.0)  # fmt: skip
            except httpx.HTTPError:
                return False
            return r.status_code == 200

        wait_until_sync(serving, 120.0, interval_s=0.2, what="the router to answer with the key")
        # the key reached the router through its 0600 file: without it, 401
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5.0).status_code == 401
        children = descendants(up.pid)
        assert len(children) >= 2  # the router and the worker at least
        for pid in children:
            assert key not in " ".join(cmdline(pid)), cmdline(pid)
            assert key.encode() not in _environ(pid), pid
        assert key in " ".join(cmdline(up.pid))  # up's own argv: what the warning is about
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
    text = log.read_text(errors="replace")
    assert "--api-key on the command line is visible to every local user" in text
    assert key not in text  # the warning names the flag, never the key
