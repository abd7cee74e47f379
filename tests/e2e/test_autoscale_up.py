"""``pdserve up --autoscale`` really scales: under a load its profile says one decode worker
cannot serve within the SLOs it starts a second one, and when the load drops it drains that one
again, while requests keep streaming through both changes and none of them fails.

The profile is made up (a decode step of 50 ms + 20 ms per sequence, whatever the tiny model
really takes), so the decisions follow the request rate the test sends, not this machine's
speed: with a 200 ms ITL target one worker serves about 2.3 requests/s of 16 tokens; the test
sends about 3.3/s, then 0.5/s."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import yaml

from pdserve.planner.profile import EngineProfile, Profile
from tests.support.servers import free_port, wait_until_sync

MODEL = "tiny-llama"
TOKENS = 16


def _profile(path: Path) -> None:
    Profile(
        "tiny-made-up",
        [EngineProfile(1, [(16, 0.002), (512, 0.02)], [(1, 64, 0.07), (8, 64, 0.21)])],  # fmt: skip
        handoff=[(0, 0.001), (10**6, 0.002)],
        kv_bytes_per_token=1024,
    ).save(path)


class Load:
    """Streams completions one after another from ``threads`` threads, ``gap_s`` apart per
    thread; counts the ones that finished with every token and keeps the failures."""

    def __init__(self, url: str, gap_s: float, threads: int) -> None:
        self.url, self.gap_s = url, gap_s
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for t in self.threads:
            t.start()

    def _one(self, client: httpx.Client, k: int) -> None:
        body = {"model": MODEL, "prompt": [40 + k % 50, 41, 42, 43], "max_tokens": TOKENS,
                "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
        pieces, done = 0, False
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise RuntimeError(f"in-band error: {chunk['error']}")
                pieces += sum(1 for c in chunk.get("choices", []) if c.get("text") is not None)
        if not done or pieces < TOKENS:
            raise RuntimeError(f"stream ended early: {pieces} pieces, done {done}")

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            k = i
            while not self.stop.is_set():
                try:
                    self._one(client, k)
                    with self.lock:
                        self.ok += 1
                except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                    with self.lock:
                        self.failures.append(f"{type(exc).__name__}: {exc}")
                k += 1
                self.stop.wait(self.gap_s)

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def _decode_workers(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    m = re.search(r'^pdserve_workers\{role="decode"\} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else -1


def test_up_autoscale_adds_and_drains_a_decode_worker_without_failing_a_request(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    profile = tmp_path / "profile.json"
    _profile(profile)
    port, planner_port = free_port(), free_port()
    config = {
        "kv_cache": {"budget_mb": 16},
        "decode": {"replicas": 1},
        "prefill": {"replicas": 0},
        "planner": {"autoscale": True, "profile": str(profile), "min_prefill": 0,
                    "max_prefill": 0, "min_decode": 1, "max_decode": 2, "ttft_slo_ms": 60000,
                    "itl_slo_ms": 200, "interval_s": 2, "scale_down_intervals": 2, "cooldown_s": 4,
                    "port": planner_port},
    }  # fmt: skip
    (tmp_path / "up.yaml").write_text(yaml.safe_dump(config))
    log = tmp_path / "up.log"
    argv = [sys.executable, "-m", "pdserve.cli", "--log-level", "info", "up", "--config",
            str(tmp_path / "up.yaml"), "--model", str(tiny_model_dir), "--served-model-name",
            MODEL, "--port", str(port), "--no-compile"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip

    def text() -> str:
        return log.read_text(errors="replace")

    def seen(fragment: str) -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"pdserve up exited {proc.returncode}:\n{text()[-4000:]}")
        return fragment in text()

    load = None
    try:
        wait_until_sync(lambda: seen("pdserve: ready."), 180, interval_s=0.2,
                        what=lambda: f"up ready:\n{text()[-3000:]}")  # fmt: skip
        # printed once the planner runs, just after the ready line
        wait_until_sync(lambda: seen("autoscale: 0..0 prefill, 1..2 decode workers"), 30,
                        interval_s=0.1, what=lambda: f"the planner:\n{text()[-3000:]}")  # fmt: skip
        load = Load(url, gap_s=0.9, threads=3)  # about 3.3 requests/s
        wait_until_sync(lambda: seen("autoscale: started decode-1"), 60, interval_s=0.2,
                        what=lambda: f"a scale-up:\n{text()[-3000:]}")  # fmt: skip
        assert re.search(r"planner: scale 0P\+1D -> 0P\+2D: model: ", text())
        wait_until_sync(lambda: _decode_workers(url) == 2, 120, interval_s=0.5,
                        what=lambda: f"two decode workers registered:\n{text()[-3000:]}")  # fmt: skip
        high = load
        high.end()
        load = Load(url, gap_s=2.0, threads=1)  # about 0.5 requests/s, streaming on
        wait_until_sync(lambda: seen("autoscale: draining decode-1"), 60, interval_s=0.2,
                        what=lambda: f"a scale-down:\n{text()[-3000:]}")  # fmt: skip
        wait_until_sync(lambda: _decode_workers(url) == 1, 60, interval_s=0.5,
                        what=lambda: f"decode-1 gone:\n{text()[-3000:]}")  # fmt: skip
        desired = httpx.get(f"http://127.0.0.1:{planner_port}/metrics", timeout=5).text
        assert 'pdserve_planner_desired_workers{role="decode"} 1.0' in desired
        assert 'pdserve_planner_decisions_total{direction="down",role="decode"} 1.0' in desired
        ok_before = load.ok
        wait_until_sync(lambda: load is not None and load.ok >= ok_before + 2, 60,
                        what="requests served after the drain")  # fmt: skip
        load.end()
        assert high.ok > 0 and high.failures == [] and load.failures == [], (
            high.failures + load.failures
        )
        # the drain came after two decisions in a row asked for fewer (the first at debug)
        assert re.search(r"planner: scale 0P\+2D -> 0P\+1D: .*fewer asked for 2 intervals in a "
                         r"row: draining one decode worker", text())  # fmt: skip
        assert "pdserve: decode-1 exited" not in text()  # retired, not crashed and restarted
    finally:
        if load is not None:
            load.end()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
