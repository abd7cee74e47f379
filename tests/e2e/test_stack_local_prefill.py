"""Conditional disaggregation and aggregated mode with real processes on the tiny model.

- Two stacks of router + one prefill + one decode worker: one with local prefill off (every
  request is handed off), one with ``--local-prefill-max-tokens 64``. On the second, a short
  prompt is served by the decode worker alone (the prefill worker's and the transfer's counters
  do not move), with the greedy text of the first.
- A colocated worker alone behind a router serves chat and completions, streamed and not, with
  the greedy text of the disaggregated path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.bench.serving.bench_multiturn import parse_metrics
from tests.support.stack import Stack, start_stack

MODEL = "tiny-llama"
SHORT = [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110]
LONG = list(range(40, 130))  # above the threshold: handed off by both routers


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(url: str, prompt: list[int], *, stream: bool = False, max_tokens: int = 24) -> str:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    if stream:
        chunks = _client(url).completions.create(stream=True, **kw)  # type: ignore[call-overload]
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return str(_client(url).completions.create(**kw).choices[0].text)  # type: ignore[call-overload]


def _samples(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


@pytest.fixture(scope="module")
def pd_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Stack]]:
    """Two stacks of router + 1 prefill + 1 decode: local prefill off, and up to 64 tokens."""
    off = start_stack(tiny_model_dir, MODEL, tmp_path_factory.mktemp("handoff"))
    try:
        on = start_stack(
            tiny_model_dir, MODEL, tmp_path_factory.mktemp("local"), local_prefill_max_tokens=64
        )
        try:
            yield off, on
        finally:
            on.stop()
    finally:
        off.stop()


@pytest.fixture(scope="module")
def colocated_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Router + 1 colocated worker, nothing else."""
    stack = start_stack(
        tiny_model_dir,
        MODEL,
        tmp_path_factory.mktemp("colocated"),
        prefill=0,
        decode=0,
        colocated=1,
    )
    yield stack
    stack.stop()


def test_short_prompt_is_served_by_the_decode_worker_alone_with_the_same_greedy_text(
    pd_stack: tuple[Stack, Stack],
) -> None:
    stack, local = pd_stack
    local_url = local.url
    urls = {w["role"]: w["http_url"] for w in local.registry_workers()}
    p0, d0 = _samples(urls["prefill"]), _samples(urls["decode"])

    text = _complete(local_url, SHORT)
    p1, d1 = _samples(urls["prefill"]), _samples(urls["decode"])
    for name in ("pdserve_prefix_cache_queries_total", "pdserve_prefix_cache_query_tokens_total"):
        assert p1[name] == p0[name], f"the prefill worker admitted a request: {name}"
    assert d1["pdserve_kv_transfer_seconds_count"] == d0["pdserve_kv_transfer_seconds_count"]
    assert d1["pdserve_prefix_cache_queries_total"] > d0["pdserve_prefix_cache_queries_total"]
    router = _samples(local_url)
    assert router['pdserve_router_decisions_total{path="local_prefill"}'] == 1
    assert router['pdserve_router_decisions_total{path="disaggregated"}'] == 0

    handed_off = _complete(stack.url, SHORT)
    assert _samples(stack.url)['pdserve_router_decisions_total{path="disaggregated"}'] == 1
    assert handed_off == text and text, "greedy text: local prefill vs hand-off"
    assert _complete(local_url, SHORT, stream=True) == text

    long_text = _complete(local_url, LONG, max_tokens=8)  # above the threshold: handed off
    p2, d2 = _samples(urls["prefill"]), _samples(urls["decode"])
    assert p2["pdserve_prefix_cache_queries_total"] > p1["pdserve_prefix_cache_queries_total"]
    assert d2["pdserve_kv_transfer_seconds_count"] == d1["pdserve_kv_transfer_seconds_count"] + 1
    assert _samples(local_url)['pdserve_router_decisions_total{path="disaggregated"}'] == 1
    assert long_text == _complete(stack.url, LONG, max_tokens=8)


def test_ready_reports_the_paths(pd_stack: tuple[Stack, Stack], colocated_stack: Stack) -> None:
    stack, _ = pd_stack
    body = httpx.get(f"{stack.url}/ready", timeout=5).json()
    assert body["paths"] == ["disaggregated", "local_prefill"]
    assert (body["prefill"], body["decode"], body["colocated"]) == (["prefill-0"], ["decode-0"], [])
    body = httpx.get(f"{colocated_stack.url}/ready", timeout=5).json()
    assert body["status"] == "ready" and body["paths"] == ["colocated"]
    assert body["colocated"] == ["colocated-0"]


def test_colocated_worker_behind_the_router_serves_completions(
    pd_stack: tuple[Stack, Stack], colocated_stack: Stack
) -> None:
    stack, _ = pd_stack
    want = _complete(stack.url, SHORT)
    assert _complete(colocated_stack.url, SHORT) == want
    assert _complete(colocated_stack.url, SHORT, stream=True) == want
    router = _samples(colocated_stack.url)
    assert router['pdserve_router_decisions_total{path="colocated"}'] == 2
    assert router['pdserve_requests_total{outcome="finished"}'] == 2


def test_colocated_worker_behind_the_router_serves_chat(colocated_stack: Stack) -> None:
    client = _client(colocated_stack.url)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=12,
              temperature=0)  # fmt: skip
    resp = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    whole = resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)  # type: ignore[call-overload]
        if c.choices
    ]
    assert "".join(parts) == whole


def test_delta_transfer_sends_only_the_blocks_the_decode_worker_lacks(
    pd_stack: tuple[Stack, Stack],
) -> None:
    """Turn 2 of a conversation whose turn 1 was decoded on the same decode worker: the prompt
    blocks turn 1 left in its prefix cache are not pulled again, and the greedy text equals a
    full transfer's (the other stack's decode worker never saw turn 1)."""
    stack, other = pd_stack
    turn1 = list(range(130, 220))  # 90 tokens (vocabulary: 260): above both thresholds
    turn2 = turn1 + list(range(220, 250))
    full = _complete(other.url, turn2, max_tokens=8)  # reference: a cold decode worker

    (decode,) = [w for w in stack.registry_workers() if w["role"] == "decode"]
    layout = decode["layout"]
    tpb = layout["tokens_per_block"]
    block_bytes = layout["num_layers"] * 2 * tpb * layout["num_kv_heads"] * layout["head_dim"] * 4
    assert layout["dtype"] == "float32"
    _complete(stack.url, turn1, max_tokens=4)
    before = _samples(decode["http_url"])
    delta = _complete(stack.url, turn2, max_tokens=8)
    after = _samples(decode["http_url"])

    skipped = len(turn1) // tpb  # turn 1's full blocks
    moved = -(-len(turn2) // tpb) - skipped
    name = "pdserve_kv_transfer_blocks_skipped_total"
    assert after[name] - before[name] == skipped
    sent = after["pdserve_kv_transfer_bytes_total"] - before["pdserve_kv_transfer_bytes_total"]
    assert sent == moved * block_bytes
    assert delta == full and delta, "greedy text: delta transfer vs a full transfer"


PROCESSED: dict[str, object] = dict(
    temperature=1.0, seed=7, max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5,
    logit_bias={"50": 3.0},
    extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "min_p": 0.05},
)  # fmt: skip


def test_every_sampling_rule_gives_the_same_tokens_across_the_split_and_colocated(
    pd_stack: tuple[Stack, Stack], colocated_stack: Stack
) -> None:
    stack, _ = pd_stack

    def complete(url: str, **kw: object) -> openai.types.Completion:
        return _client(url).completions.create(model=MODEL, prompt=LONG, **kw)  # type: ignore[call-overload,no-any-return]

    handed_off = complete(stack.url, **PROCESSED)
    colocated = complete(colocated_stack.url, **PROCESSED)
    assert handed_off.choices[0].text == colocated.choices[0].text
    assert handed_off.usage and handed_off.usage.completion_tokens >= 4  # min_tokens
    # A stop token id biased to the top is masked until min_tokens are out, then ends the choice
    # (its text not emitted): token 1 on the prefill worker, token 2 on the decode worker.
    stop = dict(temperature=0, max_tokens=8, logit_bias={"50": 100},
                extra_body={"stop_token_ids": [50], "min_tokens": 2})  # fmt: skip
    for url in (stack.url, colocated_stack.url):
        out = complete(url, **stop)
        assert (out.choices[0].finish_reason, out.usage and out.usage.completion_tokens) == (
            "stop",
            3,
        ), url
    assert (
        complete(stack.url, **stop).choices[0].text
        == complete(colocated_stack.url, **stop).choices[0].text
    )


def test_cached_tokens_report_the_prefix_cache_where_the_prompt_was_prefilled(
    pd_stack: tuple[Stack, Stack], colocated_stack: Stack
) -> None:
    stack, _ = pd_stack
    prompt = list(range(140, 220))  # 80 tokens: 5 full blocks of 16, a prompt no test sent
    for url in (stack.url, colocated_stack.url):
        client = _client(url)
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert first.usage and again.usage
        assert first.usage.prompt_tokens_details.cached_tokens == 0, url  # type: ignore[union-attr]
        # the last prompt token is always recomputed (its logits give the first token)
        assert again.usage.prompt_tokens_details.cached_tokens == 64, url  # type: ignore[union-attr]


def test_a_salted_prompt_hits_only_blocks_of_its_own_salt(
    pd_stack: tuple[Stack, Stack], colocated_stack: Stack
) -> None:
    """vLLM's cache_salt across the real stack (prefix cache, KV events, the router's index):
    the same prompt under salt a is cached the second time, under salt b it is not."""
    stack, _ = pd_stack
    prompt = list(range(140, 220))

    def cached(url: str, salt: str) -> int:
        out = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                              temperature=0, extra_body={"cache_salt": salt})  # fmt: skip
        assert out.usage and out.usage.prompt_tokens_details
        return out.usage.prompt_tokens_details.cached_tokens or 0

    for url in (stack.url, colocated_stack.url):
        assert [cached(url, "a"), cached(url, "a"), cached(url, "b")] == [0, 64, 0], url


def test_echo_with_logprobs_reports_the_prompt_tokens_where_they_were_prefilled(
    pd_stack: tuple[Stack, Stack], colocated_stack: Stack
) -> None:
    stack, _ = pd_stack
    kw = dict(model=MODEL, prompt=LONG, max_tokens=3, temperature=0, echo=True, logprobs=2)
    split = _client(stack.url).completions.create(**kw).choices[0]  # type: ignore[call-overload]
    alone = _client(colocated_stack.url).completions.create(**kw).choices[0]  # type: ignore[call-overload]
    lp = split.logprobs
    assert lp is not None and len(lp.tokens) == len(LONG) + 3
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs[1]) == 2
    assert lp.text_offset == sorted(lp.text_offset) and split.text.startswith(
        "".join(lp.tokens[:5])
    )
    assert alone.logprobs is not None
    assert alone.logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)
    vllm = (
        _client(stack.url)
        .completions.create(
            model=MODEL, prompt=LONG, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
        )
        .choices[0]
    )
    entries = vllm.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert entries[0] is None and len(entries) == len(LONG)
    assert str(LONG[1]) in entries[1] and len(entries[1]) <= 2
