"""The streamed hand-off serves the greedy tokens of the whole-request hand-off, on every
transfer backend: real stacks (router + prefill + decode processes, tiny model).

The prefill workers compute 16 tokens per step (``--max-num-batched-tokens 16``), so a prompt
of 50 tokens is prefilled in four chunks and the decode worker pulls its blocks chunk by chunk
while the prefill runs. The reference is a stack with the streamed hand-off off
(``kv_stream_min_tokens`` 0, the default); the streamed stacks hand off every prompt of at
least 20 tokens that way, shorter ones whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.servers import wait_until_sync
from tests.support.stack import Stack, start_stack
from tests.support.transfer import BACKENDS

PROMPTS = [
    list(range(40, 90)),  # 50 tokens: 4 prefill chunks; streamed
    [1, *range(100, 132)],  # 33 tokens: streamed, the last block holds one token
    [1, 72, 101, 108, 108, 111],  # 6 tokens: below the threshold, handed off whole
]
CHUNKED = ("--max-num-batched-tokens", "16")


def _completions(stack: Stack) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "logprobs": 0}  # fmt: skip
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append(choice["logprobs"]["tokens"])
    return out


@pytest.fixture(scope="module")
def whole(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The reference: every prompt handed off whole (tcp)."""
    stack = start_stack(
        tiny_model_dir,
        "tiny-llama",
        tmp_path_factory.mktemp("whole"),
        backend="tcp",
        extra_worker_args=CHUNKED,
    )
    try:
        return _completions(stack)
    finally:
        stack.stop()


@pytest.fixture(params=BACKENDS)
def streamed_stack(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack = start_stack(
        tiny_model_dir,
        "tiny-llama",
        tmp_path_factory.mktemp(f"streamed-{request.param}"),
        backend=request.param,
        extra_worker_args=CHUNKED,
        extra_router_args=("--kv-stream-min-tokens", "20"),
    )
    yield stack
    stack.stop()


def _metric(stack: Stack, role: str, name: str) -> float:
    (worker,) = [w for w in stack.registry_workers() if w["role"] == role]
    text = httpx.get(f"{worker['http_url']}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_streamed_hand_off_serves_the_whole_hand_offs_greedy_tokens(
    streamed_stack: Stack, whole: list[list[int]]
) -> None:
    assert _completions(streamed_stack) == whole
    assert _metric(streamed_stack, "decode", "pdserve_kv_transfer_streamed_total") == 2
    (prefill,) = [w for w in streamed_stack.registry_workers() if w["role"] == "prefill"]
    wait_until_sync(
        lambda: httpx.get(f"{prefill['http_url']}/load", timeout=5).json()["parked"] == 0,
        10,
        what="the decode worker's Release of every park",
    )
