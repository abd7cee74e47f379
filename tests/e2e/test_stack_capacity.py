"""Capacity through the whole stack (real processes, tiny model): a decode pool too small for
every running sequence preempts and still serves every request with its solo output; a full
waiting queue answers 429 with Retry-After and the stack keeps serving."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.servers import wait_until_sync
from tests.support.stack import Stack

# 8 prompts of 40-47 tokens, 300 tokens each: ~2,700 tokens of K/V together; the decode pool of
# 1 MiB holds 2,048 (tiny model: 512 bytes per token).
PROMPTS = [[1, *range(40 + i, 80 + 2 * i)] for i in range(8)]
MAX_TOKENS = 300


def _stack(
    model_dir: Path, log_dir: Path, prefill: tuple[str, ...], decode: tuple[str, ...]
) -> Stack:
    stack = Stack(model_dir, "tiny-llama", log_dir)
    try:
        stack.start_router()
        stack.start_worker("prefill", args=prefill)
        stack.start_worker("decode", args=decode)
        stack.wait_ready(2)
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="module")
def small_decode_pool(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack = _stack(tiny_model_dir, tmp_path_factory.mktemp("capacity"), (), ("--kv-cache-mb", "1"))
    yield stack
    stack.stop()


def _complete(stack: Stack, prompt: list[int]) -> httpx.Response:
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)


def _worker(stack: Stack, role: str) -> dict:
    workers = stack.registry_workers()
    return next(w for w in workers if w["role"] == role)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}/metrics")


def test_a_decode_pool_too_small_preempts_and_every_output_equals_its_solo_run(
    small_decode_pool: Stack,
) -> None:
    stack = small_decode_pool
    solo = [_complete(stack, p).json()["choices"][0]["text"] for p in PROMPTS]
    decode_url = _worker(stack, "decode")["http_url"]
    assert _metric(decode_url, "pdserve_num_preemptions_total") == 0
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: _complete(stack, p), PROMPTS))
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["text"] for r in responses] == solo
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in responses)
    assert _metric(decode_url, "pdserve_num_preemptions_total") > 0
    wait_until_sync(
        lambda: _metric(decode_url, 'pdserve_kv_blocks{state="used"}') == 0,
        5,
        interval_s=0.1,
        what="the decode worker to free every block",
    )


@pytest.fixture(scope="module")
def short_queue(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A prefill worker that runs one sequence at a time, 4 tokens per step (a 400-token prompt
    takes 100 steps), and queues at most one more."""
    prefill = ("--max-num-seqs", "1", "--max-num-batched-tokens", "4", "--max-queued-requests", "1")
    stack = _stack(tiny_model_dir, tmp_path_factory.mktemp("queue"), prefill, ())
    yield stack
    stack.stop()


def test_beyond_the_queue_bound_requests_get_429_with_retry_after(short_queue: Stack) -> None:
    prompt = [1, *(40 + i % 200 for i in range(400))]
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(
            pool.map(
                lambda _: httpx.post(f"{short_queue.url}/v1/completions", json=body, timeout=120),
                range(12),
            )
        )
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429}, [r.text for r in responses if r.status_code not in (200, 429)]
    assert codes.count(200) >= 2 and 429 in codes
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and "max_queued_requests" in error["message"]
    assert "prefill-0" not in error["message"] and "decode-0" not in error["message"]
    again = httpx.post(f"{short_queue.url}/v1/completions", json=body, timeout=120)
    assert again.status_code == 200  # the server keeps serving
