"""The KV cache connector's disk tier in a real stack, on each control plane (embedded, etcd,
NATS): router + prefill + decode processes share one ``--kv-disk-cache-dir``; after every
process is restarted, the same prompt is loaded from the directory instead of recomputed (the
new prefill worker's ``pdserve_kv_tier_hit_tokens_total{tier="disk"}``), the greedy text
equals the cold run's, usage's ``cached_tokens`` counts the loaded tokens, and the router's KV
index holds the directory's blocks before the first request (the new prefill worker's first
KV cache event snapshot names its disk tier's files, medium ``disk``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.bench.serving.bench_multiturn import parse_metrics
from tests.support.servers import free_port, wait_until_sync
from tests.support.stack import Stack

PROMPT = "Every worker of this host shares one directory of KV blocks. " * 4  # byte tokens
DISK_HITS = 'pdserve_kv_tier_hit_tokens_total{tier="disk"}'


@pytest.fixture
def control_plane(request: pytest.FixtureRequest) -> Iterator[str]:
    kind: str = request.param
    yield "embedded" if kind == "embedded" else request.getfixturevalue(f"{kind}_server").url


def run_once(
    model_dir: Path, log_dir: Path, discovery: str, disk: Path
) -> tuple[str, int, float, int]:
    """Start a stack on ``disk``, wait until the router's KV index holds every block file
    there, send PROMPT greedily, stop it: (text, prompt tokens, the prefill worker's disk tier
    hit tokens, usage's cached tokens)."""
    port = free_port()
    stack = Stack(
        model_dir=model_dir, served_model_name="tiny-llama", log_dir=log_dir, discovery=discovery,
        extra_worker_args=("--kv-disk-cache-dir", str(disk), "--no-compile"),
    )  # fmt: skip
    try:
        stack.start_router()
        stack.start_worker("prefill", args=("--port", str(port)))
        stack.start_worker("decode")
        stack.wait_ready(2)
        files = len(list(disk.glob("*.safetensors"))) if disk.is_dir() else 0

        def indexed() -> float:
            router = parse_metrics(httpx.get(f"{stack.url}/metrics", timeout=10).text)
            return router.get("pdserve_router_kv_index_blocks", 0.0)

        wait_until_sync(lambda: indexed() >= files, 30.0, what=f"{files} disk blocks indexed")
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
        resp = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0
        )
        metrics = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    finally:
        stack.stop()
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    cached = resp.usage.prompt_tokens_details.cached_tokens or 0
    return resp.choices[0].text, resp.usage.prompt_tokens, metrics.get(DISK_HITS, 0.0), cached


@pytest.mark.parametrize("control_plane", ["embedded", "etcd", "nats"], indirect=True)
def test_a_restarted_stack_loads_the_prompt_from_the_shared_disk_tier(
    control_plane: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    cold = run_once(tiny_model_dir, tmp_path / "cold", control_plane, disk)
    cold_text, tokens, cold_hits, cold_cached = cold
    assert cold_hits == 0 and cold_cached == 0
    assert len(list(disk.glob("*.safetensors"))) >= tokens // 16, "the cold run wrote its blocks"
    warm_text, _, warm_hits, warm_cached = run_once(
        tiny_model_dir, tmp_path / "warm", control_plane, disk
    )
    assert warm_text == cold_text
    assert warm_hits == (tokens - 1) // 16 * 16, "every full block below the last token loaded"
    assert warm_cached == warm_hits, "usage's cached_tokens counts the tier's tokens"
