"""The UCX backend beyond the backend-agnostic tests (test_transfer_backends.py runs all of
those on ucx too): UCX restricted to TCP, as between two hosts, and the whole serving stack
(router + prefill + decode processes) pulling KV over ucx."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.stack import Stack, start_stack
from tests.support.transfer import LAYOUT, PrefillPeer, assert_landed
from tests.support.transfer_inproc import assert_pull_fails_fast_when_the_peer_dies, decode_side

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="no ucxx"),
]


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX with only its TCP transport in this process and the peers it spawns: what two
    workers on different hosts get (on one host UCX would pick shared memory)."""
    monkeypatch.setenv("UCX_TLS", "tcp")


async def test_pulls_over_tcp_as_between_hosts_land_every_byte(tcp_only: None) -> None:
    peer = PrefillPeer("ucx")
    try:
        async with decode_side("ucx") as (t, pool):
            pairs = {
                "h1": ([3, 4, 5, 9], [10, 11, 0, 2]), "h2": ([12, 13], [5, 6]), "h3": ([1], [15])
            }  # fmt: skip
            handles = {rid: peer.park(rid, src) for rid, (src, _) in pairs.items()}
            await asyncio.gather(*(t.pull(handles[rid], dst) for rid, (_, dst) in pairs.items()))
            srcs = [b for src, _ in pairs.values() for b in src]
            dsts = [b for _, dst in pairs.values() for b in dst]
            assert_landed(pool, srcs, dsts, LAYOUT)
            assert set(pairs) <= set(peer.wait_released("h3"))
    finally:
        peer.stop()


async def test_peer_dying_mid_transfer_over_tcp_raises_transfer_error(tcp_only: None) -> None:
    await assert_pull_fails_fast_when_the_peer_dies("ucx", "posted")  # 48 MiB on the way


@pytest.fixture(scope="module")
def ucx_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(
        tiny_model_dir, "tiny-llama", tmp_path_factory.mktemp("ucx-stack"), backend="ucx"
    )
    yield stack
    stack.stop()


def test_stack_on_ucx_gives_the_greedy_tokens_of_transformers(
    ucx_stack: Stack, tiny_model_dir: Path
) -> None:
    workers = ucx_stack.registry_workers()
    assert {w["communicator"]["backend"] for w in workers} == {"ucx"}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = openai.OpenAI(
        base_url=f"{ucx_stack.url}/v1", api_key="unused", max_retries=0, timeout=60
    )
    for ids in ([1, 72, 101, 108, 108, 111], list(range(40, 90))):  # 1 block; several blocks
        got = client.completions.create(
            model="tiny-llama", prompt=ids, max_tokens=16, temperature=0
        )
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id
        )
        want = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
        assert got.choices[0].text == want, f"prompt {ids}"
