"""The whole disaggregated path on the tiny model: router + prefill + decode as real processes,
driven by the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures
import json
import signal
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.servers import wait_until_sync
from tests.support.stack import Stack

PROMPTS = [
    [1, 72, 101, 108, 108, 111],
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110],
    list(range(40, 90)),  # spans several KV blocks
]


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def generate(ids: list[int], max_tokens: int) -> str:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    return generate


def test_greedy_completions_equal_transformers_generate(tiny_stack: Stack, hf_reference) -> None:
    client = _client(tiny_stack)
    for ids in PROMPTS:
        got = client.completions.create(
            model="tiny-llama", prompt=ids, max_tokens=24, temperature=0
        )
        assert got.choices[0].text == hf_reference(ids, 24), f"prompt {ids}"
        assert got.usage.prompt_tokens == len(ids)


def test_chat_completion_not_streamed_has_text_and_usage(tiny_stack: Stack) -> None:
    resp = _client(tiny_stack).chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi there"}],
        max_tokens=8,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_equals_non_stream(tiny_stack: Stack) -> None:
    client = _client(tiny_stack)
    kwargs = dict(model="tiny-llama", messages=[{"role": "user", "content": "abc"}],
                  max_tokens=12, temperature=0)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    ]
    assert "".join(parts) == whole


def test_completion_stream_ends_with_done(tiny_stack: Stack) -> None:
    body = {"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 6, "stream": True,
            "temperature": 0}  # fmt: skip
    with httpx.stream("POST", f"{tiny_stack.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]
                   if json.loads(ln[6:])["choices"])  # fmt: skip
    whole = _client(tiny_stack).completions.create(
        model="tiny-llama", prompt=PROMPTS[0], max_tokens=6, temperature=0
    )
    assert text == whole.choices[0].text


def test_seeded_sampling_repeats(tiny_stack: Stack) -> None:
    client = _client(tiny_stack)
    kwargs = dict(model="tiny-llama", prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                  top_p=0.9, seed=1234)  # fmt: skip
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_eight_concurrent_requests_equal_their_solo_outputs(tiny_stack: Stack) -> None:
    client = _client(tiny_stack)
    prompts = [PROMPTS[i % 3][: 5 + i] for i in range(8)]

    def run(ids: list[int]) -> str:
        return (
            client.completions.create(model="tiny-llama", prompt=ids, max_tokens=20, temperature=0)
            .choices[0]
            .text
        )

    solo = [run(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, prompts))
    assert together == solo


def _samples(text: str) -> dict[str, float]:
    """``name{labels} value`` lines of a Prometheus exposition, by name-with-labels."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_metrics_count_requests_ttft_and_kv_transfers(tiny_stack: Stack) -> None:
    before = _samples(httpx.get(f"{tiny_stack.url}/metrics").text)
    client = _client(tiny_stack)
    for ids in PROMPTS[:2]:
        client.completions.create(model="tiny-llama", prompt=ids, max_tokens=8, temperature=0)
    router = _samples(httpx.get(f"{tiny_stack.url}/metrics").text)

    def grew(name: str) -> float:
        return router[name] - before.get(name, 0.0)

    assert grew('pdserve_requests_total{outcome="finished"}') == 2
    assert grew("pdserve_time_to_first_token_seconds_count") == 2
    assert grew("pdserve_time_per_output_token_seconds_count") == 2
    assert grew("pdserve_prompt_tokens_total") == sum(len(p) for p in PROMPTS[:2])
    assert grew("pdserve_generation_tokens_total") == 16
    assert router['pdserve_workers{role="decode"}'] == 1
    assert router["pdserve_requests_running"] == 0
    workers = tiny_stack.registry_workers()
    decode = next(w for w in workers if w["role"] == "decode")
    d = _samples(httpx.get(f"{decode['http_url']}/metrics").text)
    assert d["pdserve_kv_transfer_seconds_count"] >= 2
    assert d["pdserve_kv_transfer_bytes_total"] > 0
    assert d['pdserve_kv_blocks{state="used"}'] == 0  # every finished request freed its blocks
    assert d['pdserve_kv_blocks{state="free"}'] > 0


def test_models_lists_served_model(tiny_stack: Stack) -> None:
    ids = [m.id for m in _client(tiny_stack).models.list()]
    assert ids == ["tiny-llama"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
        ({"model": "tiny-llama", "messages": []}, 400),
        (
            {
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 10_000_000,
            },
            400,
        ),  # fmt: skip
        ({"model": "tiny-llama", "messages": "not a list"}, 400),
        (
            {
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": "x"}],
                "temperature": "hot",
            },
            400,
        ),  # fmt: skip
    ],
)
def test_bad_input_gets_4xx_json_and_server_keeps_serving(
    tiny_stack: Stack, body: dict, status: int
) -> None:
    r = httpx.post(f"{tiny_stack.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status
    assert "message" in r.json()["error"]
    ok = httpx.post(
        f"{tiny_stack.url}/v1/completions",
        json={"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200


def test_invalid_json_gets_400(tiny_stack: Stack) -> None:
    r = httpx.post(
        f"{tiny_stack.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"]


def _parked(stack: Stack) -> int:
    records = stack.registry_workers()
    total = 0
    for rec in records:
        if rec["role"] == "prefill":
            total += httpx.get(f"{rec['http_url']}/load", timeout=5).json()["parked"]
    return total


def test_killed_decode_worker_ends_stream_with_error_and_frees_parked_blocks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tests.support.stack import start_stack

    lease_s = 4.0
    # Each killed decode worker leaves its request no worker to migrate to: the router holds
    # it 1 s for one (router.worker_wait_s), not 30, before the error reaches the client.
    stack = start_stack(
        tiny_model_dir,
        "tiny-llama",
        tmp_path,
        lease_s=lease_s,
        extra_router_args=("--worker-wait-s", "1"),
    )
    try:
        body = {"model": "tiny-llama", "prompt": PROMPTS[2], "max_tokens": 400, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        events: list[str] = []
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    stack.procs["decode-0"].kill()
        assert events[-1] == "[DONE]"
        errors = [json.loads(e) for e in events[:-1] if "error" in json.loads(e)]
        assert errors, f"no error event in {events[-3:]}"
        wait_until_sync(
            lambda: _parked(stack) == 0, lease_s + 3, interval_s=0.2, what="the lease to expire"
        )

        # A decode worker that hangs before pulling: the prefill worker's lease frees the blocks.
        _wait_until_gone(stack, "decode-0")
        frozen = stack.start_worker("decode", "decode-1")
        stack.wait_ready(2)
        frozen.popen.send_signal(signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                httpx.post,
                f"{stack.url}/v1/completions",
                json={"model": "tiny-llama", "prompt": PROMPTS[2], "max_tokens": 4},
                timeout=90,
            )
            wait_until_sync(lambda: _parked(stack) > 0, 20, what="the request to park its blocks")
            wait_until_sync(
                lambda: _parked(stack) == 0, lease_s + 3, interval_s=0.2, what="the lease to expire"
            )
            frozen.kill()
            resp = pending.result(timeout=90)
        assert resp.status_code >= 500
        assert resp.json()["error"]["message"]
    finally:
        stack.stop()


def _wait_until_gone(stack: Stack, worker_id: str, timeout_s: float = 20) -> None:
    def gone() -> bool:
        workers = stack.registry_workers()
        return worker_id not in [w["worker_id"] for w in workers]

    wait_until_sync(gone, timeout_s, interval_s=0.3, what=f"{worker_id} to deregister")
