"""Peer prefix pull with real processes on the tiny model: router + two colocated workers,
embedded discovery, least-loaded routing (``--router-kv-overlap-weight 0``), so a follow-up
turn can land on the worker that did not compute its prefix.

One worker computes a long prompt. While it streams another long answer (so it is the more
loaded one), the prompt's follow-up goes to the other worker: the router's KV index shows the
first holding the prefix, it lends it, and the other pulls the blocks over the transfer plane
instead of computing them: the answer reports them as cached and equals the answer computed
from a worker's own cache. A lend whose lease is
forged costs a recompute, never the request.

A second stack (router + 1 prefill + 2 decode) kills the decode worker streaming a long
prompt's answer: the migrated stream's new decode worker pulls the prompt's blocks from the
prefill worker's cache (which still holds them) instead of recomputing them, and the answer
equals an undisturbed run.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.bench.serving.bench_multiturn import parse_metrics
from pdserve.block_hash import BlockHasher
from pdserve.kv_lend import LendRequest, LendResponse
from pdserve.protocol import GenerationRequest, SamplingParams, TransferHandle
from tests.support.servers import wait_until_sync
from tests.support.stack import Stack, start_stack

MODEL = "tiny-peer"
TPB = 16
PREFIX = [(13 * i) % 200 + 25 for i in range(20 * TPB)]  # 20 blocks, computed by one worker
FOLLOW_UP = PREFIX + [40, 41, 42, 43, 44, 45, 46, 47]
BUSY = [7, 8, 9, 10, 11, 12, 13, 14]  # keeps the holder of PREFIX streaming meanwhile
CACHED_BLOCKS = 'pdserve_prefix_cache_blocks{state="cached"}'


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        tiny_model_dir,
        MODEL,
        tmp_path_factory.mktemp("peer"),
        prefill=0,
        decode=0,
        colocated=2,
        extra_router_args=("--router-kv-overlap-weight", "0"),
    )
    yield s
    s.stop()


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def _complete(stack: Stack, prompt: list[int], max_tokens: int = 6) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    resp = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _workers(stack: Stack) -> dict[str, str]:
    return {w["worker_id"]: w["http_url"] for w in stack.registry_workers()}


class Busy:
    """A long stream through the router, on whichever worker the router picks."""

    def __init__(self, stack: Stack) -> None:
        self.streaming = threading.Event()
        self.done = threading.Event()
        body = {"model": MODEL, "prompt": BUSY, "max_tokens": 480, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip

        def run() -> None:
            with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    self.streaming.set()
                    if self.done.is_set():
                        break

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.streaming.wait(30), "the busy stream never started"

    def stop(self) -> None:
        self.done.set()
        self.thread.join(30)


def _running(url: str) -> int:
    return int(httpx.get(f"{url}/load", timeout=5).json()["running"])


def test_a_follow_up_on_the_other_worker_pulls_its_prefix(stack: Stack) -> None:
    urls = _workers(stack)
    first = _complete(stack, PREFIX)
    assert _cached(first) == 0
    # The router's index knows the worker that computed it holds the prefix (KV events).
    wait_until_sync(
        lambda: _metrics(stack.url).get("pdserve_router_kv_index_blocks", 0) >= 19,
        timeout_s=15,
        what="the router's KV index to list the prefix's blocks",
    )
    cached = {n: _metrics(u).get(CACHED_BLOCKS, 0) for n, u in urls.items()}
    holder = max(cached, key=lambda n: cached[n])
    other = next(n for n in urls if n != holder)
    busy = [Busy(stack)]  # keep the holder the more loaded worker
    try:
        if _running(urls[holder]) == 0:  # the router put it on the other worker: one more
            busy.append(Busy(stack))  # goes to the holder, then the first one ends
            wait_until_sync(lambda: _running(urls[holder]) > 0, 15, what="the holder to stream")
            busy.pop(0).stop()
            wait_until_sync(lambda: _running(urls[other]) == 0, 15, what="the other to idle")
        before = _metrics(urls[other])
        pulled = _complete(stack, FOLLOW_UP)
    finally:
        for b in busy:
            b.stop()
    after = _metrics(urls[other])
    blocks = after.get("pdserve_kv_peer_prefix_blocks_total", 0) - before.get(
        "pdserve_kv_peer_prefix_blocks_total", 0
    )
    assert blocks >= 19, f"{other} pulled {blocks} blocks"
    assert _cached(pulled) >= 0.8 * len(PREFIX), pulled["usage"]
    lends = _metrics(stack.url).get('pdserve_router_peer_prefix_lends_total{outcome="lent"}', 0)
    assert lends >= 1
    # Either worker (both idle, both caching the prefix now) answers the same from its cache.
    again = _complete(stack, FOLLOW_UP)
    assert again["choices"][0]["text"] == pulled["choices"][0]["text"]


def _generate(
    url: str,
    headers: dict[str, str],
    request_id: str,
    prompt: list[int],
    prefix: TransferHandle | None = None,
) -> dict[str, Any]:
    """One request straight to a worker's ``/internal/generate``; its last chunk."""
    req = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=4, temperature=0),
        deadline=time.time() + 30,
        prefix=prefix,
    )
    with httpx.stream("POST", f"{url}/internal/generate", content=req.model_dump_json(),
                      headers=headers, timeout=30) as r:  # fmt: skip
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    return dict(json.loads(lines[-1]))


def test_a_forged_lease_costs_a_recompute_not_the_request(stack: Stack) -> None:
    urls = _workers(stack)
    headers = {**stack.cluster_key.http_headers(), "content-type": "application/json"}
    prompt = [(17 * i) % 200 + 31 for i in range(12 * TPB)]
    _generate(urls["colocated-0"], headers, "seed-2", prompt)  # colocated-0 holds it now
    record = next(w for w in stack.registry_workers() if w["worker_id"] == "colocated-0")
    hasher = BlockHasher(record["layout"]["model"], record["layout"]["dtype"], TPB)
    lend = LendRequest(
        request_id="forged",
        block_hashes=tuple(hasher.hash_tokens(prompt[: 11 * TPB])),
        deadline=time.time() + 30,
    )
    resp = httpx.post(f"{urls['colocated-0']}/internal/kv/lend", content=lend.model_dump_json(),
                      headers=headers, timeout=10)  # fmt: skip
    handle = LendResponse.model_validate_json(resp.content).handle
    assert handle is not None and len(handle.block_ids) == 11
    forged = handle.model_copy(update={"lease_id": "not-the-lease"})
    before = _metrics(urls["colocated-1"])
    last = _generate(urls["colocated-1"], headers, "forged-1", prompt + [50, 51], forged)
    assert last["finish_reason"] == "length" and last["error"] is None, last
    after = _metrics(urls["colocated-1"])
    key = 'pdserve_kv_peer_prefix_pulls_total{outcome="failed"}'
    assert after.get(key, 0) == before.get(key, 0) + 1


@pytest.fixture(scope="module")
def split(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, MODEL, tmp_path_factory.mktemp("peer-split"), decode=2)
    yield s
    s.stop()


def test_a_migrated_stream_pulls_its_prompt_from_the_prefill_worker(split: Stack) -> None:
    urls = _workers(split)
    prompt = [(19 * i) % 200 + 33 for i in range(12 * TPB)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    killed: list[str] = []
    text = ""
    with httpx.stream("POST", f"{split.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            if len(text) >= 8 and not killed:  # kill the decode worker streaming it
                for name in ("decode-0", "decode-1"):
                    if httpx.get(f"{urls[name]}/load", timeout=5).json()["running"]:
                        split.procs[name].kill(signal.SIGKILL)
                        killed.append(name)
                        break
    assert killed, "no decode worker showed the stream"
    survivor = next(n for n in ("decode-0", "decode-1") if n not in killed)
    pulled = _metrics(urls[survivor]).get("pdserve_kv_peer_prefix_blocks_total", 0)
    assert pulled >= 11, f"{survivor} pulled {pulled} blocks"
    again = _complete(split, prompt, max_tokens=200)
    assert text == again["choices"][0]["text"]
