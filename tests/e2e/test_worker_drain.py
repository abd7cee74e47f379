"""SIGTERM drains a worker: it deregisters at once (the router stops routing to it), then
either hands its running streams to another decode worker at once (``migrate_on_drain``, the
default: the router migrates each, and the client's stream goes on) or keeps serving them
until they finish (``--no-migrate-on-drain``), then exits. Orchestrators (compose stop,
Kubernetes rolling updates) rely on this to lose no request."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.servers import wait_until_sync
from tests.support.stack import start_stack


def test_sigterm_deregisters_first_and_lets_the_stream_in_flight_finish(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    stack = start_stack(
        tiny_model_dir, "tiny-llama", tmp_path,
        extra_worker_args=("--no-migrate-on-drain",),
        extra_router_args=("--worker-wait-s", "0"),  # the 503 below at once, not held
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
        first_chunk = threading.Event()
        result: dict[str, object] = {}

        def stream() -> None:
            try:
                chunks = client.completions.create(
                    model="tiny-llama", prompt=list(range(40, 60)), max_tokens=400,
                    temperature=0, stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                texts, finish = [], None
                for c in chunks:
                    first_chunk.set()
                    if c.choices:
                        texts.append(c.choices[0].text)
                        finish = c.choices[0].finish_reason or finish
                result.update(text="".join(texts), finish=finish)
            except Exception as exc:  # the assertion below names it
                result["error"] = exc

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(30), "the stream never started"
        decode = stack.procs["decode-0"]
        decode.popen.send_signal(signal.SIGTERM)

        # Deregistered at once: the router no longer sees a decode worker ...
        wait_until_sync(
            lambda: httpx.get(f"{stack.url}/ready", timeout=2).status_code == 503,
            5,
            what="the router to see no decode worker",
        )
        r = httpx.get(f"{stack.url}/ready", timeout=2)
        assert r.status_code == 503 and r.json()["decode"] == [], r.text
        assert not result, "deregistration must come before the in-flight stream ends"
        # ... so a new request is refused with an explicit 503, not sent to the draining worker,
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=4)
        assert info.value.status_code == 503
        # ... while the request it already had runs to its end.
        reader.join(60)
        assert "error" not in result, result.get("error")
        assert result["finish"] == "length", result
        assert decode.popen.wait(30) is not None
        assert "drained" in decode.log()
    finally:
        stack.stop()


def test_sigterm_migrates_the_stream_in_flight_to_the_other_decode_worker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two decode workers: the one serving a 400-token stream gets SIGTERM. It exits long
    before the stream could have finished there; the client reads one uninterrupted stream,
    identical to the greedy output of an undisturbed run."""
    stack = start_stack(tiny_model_dir, "tiny-llama", tmp_path, decode=2)
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
        kw: dict[str, object] = dict(
            model="tiny-llama", prompt=list(range(40, 60)), max_tokens=400, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        expected = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
        texts: list[str] = []
        finish = None
        chunks = client.completions.create(stream=True, **kw)  # type: ignore[call-overload]
        for chunk in chunks:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if len(texts) == 20:  # mid-stream: stop the decode worker serving it
                urls = {w["worker_id"]: w["http_url"] for w in stack.registry_workers()}
                serving = [name for name in stack.procs if name.startswith("decode")
                           and _running(urls[name]) > 0]  # fmt: skip
                assert len(serving) == 1, serving
                decode = stack.procs[serving[0]]
                decode.popen.send_signal(signal.SIGTERM)
        assert finish == "length" and "".join(texts) == expected
        assert decode.popen.wait(30) is not None
        log = decode.log()
        assert "drained" in log and "migrating 1 running request" in log, log[-2000:]
        metrics = httpx.get(f"{stack.url}/metrics", timeout=5).text
        assert 'pdserve_router_migrations_total{leg="decode",reason="draining"} 1.0' in metrics
    finally:
        stack.stop()


def _running(worker_url: str) -> int:
    """Sequences running on a worker (its /load)."""
    load = httpx.get(f"{worker_url}/load", timeout=5).json()
    return int(load["running"])
