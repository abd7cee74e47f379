"""README's main job: ``pdserve up`` on the embedded defaults (SmolLM2), then Ctrl-C."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow


README = Path(__file__).resolve().parents[2] / "README.md"
README_PORT = 8000  # README's example talks to http://127.0.0.1:8000/v1


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def up_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("up") / "up.log"


@pytest.fixture(scope="module")
def up(smollm2_dir: Path, up_log: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """README's command as written, ``pdserve up`` (port 8000, no model flag: it must find the
    prepared SmolLM2 in the cache), so README's Python example runs against it unchanged."""
    port = README_PORT
    assert _port_is_free(port), f"port {port} is taken: README's example needs it"
    # README's example samples at temperature 1 without max_tokens: now and then SmolLM2 never
    # says EOS and decodes to the end of the window (8,192 tokens: minutes on 2 cores). A
    # 512-token window (set through the environment, so the command stays as written) keeps
    # that case near 25 s (1,024 took 58 s in a full run); it still runs to the window's end,
    # served, not refused.
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PDSERVE_CACHE_DIR=str(smollm2_dir.parent),
        PDSERVE_MODEL__MAX_MODEL_LEN="512",
    )
    log = up_log
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up"],
        stdout=subprocess.PIPE,
        stderr=open(log, "w"),  # noqa: SIM115
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 300
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            pytest.fail(f"pdserve up did not print its URL in time:\n{log.read_text()[-4000:]}")
        if "ready" in line:
            break
    assert f"http://127.0.0.1:{port}/v1" in line
    yield f"http://127.0.0.1:{port}", proc
    if proc.poll() is None:
        proc.kill()


def test_chat_says_capital_of_france_is_paris(up: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = up
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in resp.choices[0].message.content


def test_readme_python_example_runs_as_written(up: tuple[str, subprocess.Popen[str]]) -> None:
    """README's Python example (a chat request with no max_tokens) answers without error."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "README holds one Python example"
    done = subprocess.run(
        [sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the example printed no answer"


def test_kv_pools_are_sized_from_available_memory_and_logged(
    up: tuple[str, subprocess.Popen[str]], up_log: Path
) -> None:
    text = up_log.read_text()
    assert re.search(r"KV cache: 25% of [\d.]+ GiB available host memory, \d+ MiB for each", text)
    pools = re.findall(r"KV pool: (\d+) blocks .* holds ([\d.]+) requests at the full", text)
    assert len(pools) == 2, text[-3000:]  # one line per worker
    assert all(int(blocks) > 0 and float(full) > 0 for blocks, full in pools)


def test_greedy_tokens_equal_transformers_generate(
    up: tuple[str, subprocess.Popen[str]], smollm2_dir: Path
) -> None:
    url, _ = up
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    for text in ["The tallest mountain in the world is", "def fibonacci(n):"]:
        ids = tok(text).input_ids
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        expected = tok.decode(ref[0, len(ids) :], skip_special_tokens=True)
        got = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=16, temperature=0
        )
        assert got.choices[0].text == expected


def test_ctrl_c_stops_everything(up: tuple[str, subprocess.Popen[str]]) -> None:
    url, proc = up
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    import httpx

    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)
