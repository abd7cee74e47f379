"""KV-aware routing with real processes on the tiny model: router + two prefill workers + one
decode worker, embedded discovery, every prompt handed off (``--local-prefill-max-tokens 0``).

A long prompt is first computed on ``prefill-1`` alone (a context request sent straight to it,
as another router would), so its blocks sit in that worker's prefix cache and its KV events
reach the router's index. The same prompt, extended by a few tokens, then sent through the
router goes to ``prefill-1``, which finds the prefix cached, although least-loaded routing
would pick ``prefill-0`` (idle too, and first by id). A new prompt goes to ``prefill-0`` (no
worker holds it: the tie-break) and its repeat stays there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.bench.serving.bench_multiturn import parse_metrics
from pdserve.protocol import ContextRequest, ContextResponse, ReleaseRequest, SamplingParams
from tests.support.servers import wait_until_sync
from tests.support.stack import Stack, start_stack

MODEL = "tiny-llama"
TPB = 16
SEEDED = [(7 * i) % 200 + 20 for i in range(6 * TPB)]  # 6 blocks, prefill-1 computes it first
FRESH = [(11 * i) % 200 + 30 for i in range(5 * TPB)]  # 5 blocks no worker holds


def _samples(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def _complete(stack: Stack, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    return str(out.choices[0].text)


def _hits(url: str) -> tuple[float, float]:
    """(admissions that looked up a prefix, tokens found cached) on one worker."""
    s = _samples(url)
    return s["pdserve_prefix_cache_queries_total"], s["pdserve_prefix_cache_hit_tokens_total"]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tiny_model_dir, MODEL, tmp_path_factory.mktemp("kvroute"), prefill=2)
    yield s
    s.stop()


def test_a_prompt_goes_to_the_prefill_worker_that_holds_its_prefix(stack: Stack) -> None:
    urls = {w["worker_id"]: w["http_url"] for w in stack.registry_workers()}
    headers = stack.cluster_key.http_headers()
    # prefill-1 computes SEEDED on its own (a context request straight to it), then lets go.
    req = ContextRequest(
        request_id="seed",
        prompt_token_ids=tuple(SEEDED),
        sampling=SamplingParams(max_tokens=2, temperature=0),
        deadline=time.time() + 30,
    )
    resp = httpx.post(
        f"{urls['prefill-1']}/internal/context",
        content=req.model_dump_json(),
        headers={**headers, "content-type": "application/json"},
        timeout=30,
    )
    resp.raise_for_status()
    handle = ContextResponse.model_validate_json(resp.content).handle
    if handle is not None:
        release = ReleaseRequest(request_id="seed", epoch=handle.epoch, lease_id=handle.lease_id)
        httpx.post(
            f"{urls['prefill-1']}/internal/release",
            content=release.model_dump_json(),
            headers={**headers, "content-type": "application/json"},
            timeout=10,
        ).raise_for_status()
    # The router learns it from prefill-1's KV events (every 100 ms).
    wait_until_sync(
        lambda: _samples(stack.url).get("pdserve_router_kv_index_blocks", 0) >= 6,
        10,
        what="the router's KV index to hold prefill-1's blocks",
    )
    published = _samples(urls["prefill-1"])
    assert published['pdserve_kv_events_total{result="sent"}'] >= 2  # the snapshot, the blocks
    assert published["pdserve_kv_events_snapshots_total"] >= 1
    before = {w: _hits(urls[w]) for w in ("prefill-0", "prefill-1")}
    assert _complete(stack, SEEDED + [65, 66, 67])
    after = {w: _hits(urls[w]) for w in ("prefill-0", "prefill-1")}
    assert after["prefill-0"] == before["prefill-0"], "prefill-0 admitted the request"
    assert after["prefill-1"][0] == before["prefill-1"][0] + 1
    assert after["prefill-1"][1] - before["prefill-1"][1] == 6 * TPB, "prefix not reused"
    router = _samples(stack.url)
    overlap = 'pdserve_router_kv_overlap_tokens_sum{path="disaggregated",role="prefill"}'
    assert router[overlap] == 6 * TPB

    # A prompt no worker holds: the least-loaded tie-break (prefill-0); its repeat stays there.
    assert _complete(stack, FRESH)
    # FRESH's blocks were indexed on prefill-0 before it answered; the router has them once
    # prefill-0 completed a KV event POST that started after that (the registry applies an
    # event before acknowledging it; a periodic snapshot carries them too if the changes went
    # out already). Counting the router's index blocks would also count the decode worker's.
    sent = 'pdserve_kv_events_total{result="sent"}'
    published = _samples(urls["prefill-0"])[sent]
    wait_until_sync(
        lambda: _samples(urls["prefill-0"])[sent] > published,
        20,
        what="prefill-0 to publish a KV event after FRESH was prefilled",
    )
    mid = _hits(urls["prefill-0"])
    assert mid[0] == after["prefill-0"][0] + 1
    assert _complete(stack, FRESH + [70])
    end = {w: _hits(urls[w]) for w in ("prefill-0", "prefill-1")}
    assert end["prefill-1"] == after["prefill-1"]
    assert end["prefill-0"][1] - mid[1] == 5 * TPB
