"""Stopping the control plane (etcd or NATS) for 10 s while requests flow.

Issue 3: requests already admitted complete; the router keeps routing from its last view; the
workers re-register when the server returns. Workers run with a 3 s registration TTL, far
shorter than the outage: they report not ready (RETRYING) while the server is away, NATS lets
their records expire, and only the router's kept view carries the traffic.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pdserve.protocol import WorkerRecord
from tests.support.servers import EtcdServer, NatsServer, wait_until
from tests.support.stack import Stack, start_stack

OUTAGE_S = 10.0
TTL_S = 3
PROMPT = [1, 72, 101, 108, 108, 111]


@dataclass
class Traffic:
    """Short completions sent back to back from a thread; every outcome is recorded as
    ``(monotonic start, monotonic end, error or None)``."""

    url: str
    outcomes: list[tuple[float, float, str | None]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def ok_between(self, t0: float, t1: float = float("inf")) -> int:
        return sum(1 for s, e, err in self.outcomes if err is None and s >= t0 and e <= t1)

    @property
    def errors(self) -> list[str]:
        return [err for _, _, err in self.outcomes if err is not None]

    def _run(self) -> None:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        with httpx.Client(base_url=self.url, timeout=30.0, trust_env=False) as client:
            while not self._stop.is_set():
                start, error = time.monotonic(), None
                try:
                    resp = client.post("/v1/completions", json=body)
                    if resp.status_code != 200:
                        error = f"{resp.status_code}: {resp.text[:300]}"
                    elif resp.json()["usage"]["completion_tokens"] < 1:
                        error = f"no tokens: {resp.text[:300]}"
                except httpx.HTTPError as exc:
                    error = repr(exc)
                self.outcomes.append((start, time.monotonic(), error))
                time.sleep(0.05)  # the traffic's pace (a request every 50 ms), not a wait


class LongStream:
    """One streamed completion, in flight while the control plane goes away."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.first_chunk = threading.Event()
        self.chunks: list[str] = []
        self.error: str | None = None
        self.finished_at = float("inf")
        self._thread = threading.Thread(target=self._run, name="long-stream", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        body = {
            "model": "tiny-llama",
            "prompt": PROMPT,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json=body, timeout=60.0, trust_env=False
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.chunks.append(line.removeprefix("data: "))
                        self.first_chunk.set()
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        self.finished_at = time.monotonic()
        self.first_chunk.set()


async def records_in(kind: str, server: EtcdServer | NatsServer) -> dict[str, WorkerRecord]:
    """The live worker records in the control plane's store, read with a fresh client."""
    if kind == "etcd":
        import aetcd

        from pdserve.discovery.etcd import PREFIX

        assert isinstance(server, EtcdServer)
        async with aetcd.Client(port=server.client_port, timeout=2.0) as client:
            listing = await client.get_prefix(PREFIX.encode())
            values = [kv.value for kv in listing]
    else:
        import nats
        import nats.js.errors

        from pdserve.discovery.nats import BUCKET

        nc = await nats.connect(server.url, connect_timeout=2, max_reconnect_attempts=0)
        try:
            kv = await nc.jetstream(timeout=2.0).key_value(BUCKET)
            try:
                keys = await kv.keys()
            except nats.js.errors.NoKeysError:
                keys = []
            values = [(await kv.get(key)).value or b"" for key in keys]
        finally:
            await nc.close()
    records = [WorkerRecord.model_validate_json(v) for v in values if v]
    return {r.worker_id: r for r in records}


async def wait_for_records(
    kind: str, server: EtcdServer | NatsServer, epochs: dict[str, int], timeout_s: float
) -> None:
    """Wait until the store holds exactly these workers with these epochs."""
    found: dict[str, int] = {}

    async def holds() -> bool:
        nonlocal found
        try:
            found = {w: r.epoch for w, r in (await records_in(kind, server)).items()}
        except Exception:  # the server may still be recovering its store
            found = {}
        return found == epochs

    await wait_until(
        holds, timeout_s, interval_s=0.3, what=lambda: f"{kind} to hold {epochs}, not {found}"
    )


def worker_ready(record: WorkerRecord) -> bool:
    try:
        return httpx.get(f"{record.http_url}/ready", timeout=2.0, trust_env=False).is_success
    except httpx.HTTPError:
        return False


@pytest.fixture
def control_plane(request: pytest.FixtureRequest) -> Iterator[tuple[str, EtcdServer | NatsServer]]:
    kind: str = request.param
    yield kind, request.getfixturevalue(f"{kind}_server")


@pytest.mark.parametrize("control_plane", ["etcd", "nats"], indirect=True)
async def test_requests_flow_through_a_control_plane_outage(
    control_plane: tuple[str, EtcdServer | NatsServer], tiny_model_dir: Path, tmp_path: Path
) -> None:
    kind, server = control_plane
    stack: Stack = start_stack(
        tiny_model_dir,
        "tiny-llama",
        tmp_path,
        discovery=server.url,
        extra_worker_args=("--registration-ttl-s", str(TTL_S)),
    )
    traffic = Traffic(stack.url)
    try:
        before = await records_in(kind, server)
        assert set(before) == {"prefill-0", "decode-0"}
        assert before["prefill-0"].communicator, "the communicator handle travels in the record"
        traffic.start()
        await wait_until(lambda: traffic.ok_between(0) >= 2, 20.0, what="traffic to flow")
        admitted = LongStream(stack.url, max_tokens=400)
        assert admitted.first_chunk.wait(20.0), "the long stream never started"

        down = time.monotonic()
        server.stop()
        router_ready: list[int] = []
        decode_ready: list[bool] = []
        while time.monotonic() - down < OUTAGE_S:  # the outage lasts OUTAGE_S: sampled, no wait
            router_ready.append(httpx.get(f"{stack.url}/ready", timeout=5.0).status_code)
            decode_ready.append(worker_ready(before["decode-0"]))
            await asyncio.sleep(0.5)  # the sampling pace during the outage
        up = time.monotonic()
        server.start()

        # The same incarnations register again and report ready.
        await wait_for_records(kind, server, {w: r.epoch for w, r in before.items()}, 15.0)
        await wait_until(lambda: all(worker_ready(r) for r in before.values()), 10.0)
        back = time.monotonic()
        await wait_until(lambda: traffic.ok_between(back) >= 2, 20.0, what="traffic after")
        traffic.stop()
        admitted.join(30.0)

        router_log = stack.procs["router"].log()
        assert traffic.errors == [], traffic.errors[:3]
        assert traffic.ok_between(down, up) >= 3, "no request completed during the outage"
        assert set(router_ready) == {200}, router_ready
        assert not decode_ready[-1], "the decode worker never noticed the outage"
        assert admitted.error is None and admitted.chunks[-1] == "[DONE]", admitted.error
        events = [json.loads(c) for c in admitted.chunks[:-1]]
        assert not any("error" in e for e in events), events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert admitted.finished_at > down, "the long stream was not in flight at the stop"
        assert "worker prefill-0 removed" not in router_log
        assert "worker decode-0 removed" not in router_log
    finally:
        traffic.stop()
        stack.stop()
