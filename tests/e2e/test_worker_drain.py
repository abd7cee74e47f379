"""SIGTERM drains a worker: it deregisters at once (the router stops routing to it), keeps
serving what it already has until that finishes, then exits. Orchestrators (compose stop,
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
    stack = start_stack(tiny_model_dir, "tiny-llama", tmp_path)
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
