"""Prefill and decode workers with different KV block sizes and KV dtypes serve the same greedy
completions as workers with matched layouts: one real stack (router + worker processes), driven
by the official ``openai`` client.

The prefill worker stores K/V in bfloat16, 16 tokens per block. The completions are first
served with a decode worker of the same layout (matched), then, after that worker is stopped,
with a decode worker storing float32, 32 tokens per block (mixed): the prefill side re-blocks
and widens every transfer. The prefill worker is the same process in both phases, so only the
decode side's layout changes.

Why these dtypes: every worker computes in bfloat16 (``--dtype bfloat16``). Widening bfloat16 to
float32 is exact and attention reads the cache back in the compute dtype, so the mixed decode
worker attends over the very same values as the matched one, and any difference in the tokens
is a formatter bug. (A float32 model over a float32 cache would attend over values a bfloat16
cache never holds, and greedy tokens then legitimately differ at near-ties.) The workers run
the compiled forward: with the eager one in bfloat16, the 50-token prompt's greedy tokens
differed between the 16- and 32-token-block decode workers in one run (bfloat16 rounding in
the eager attention path, which this test is not about; the compiled forward gives both the
same tokens).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.servers import wait_until_sync
from tests.support.stack import Stack

PROMPTS = [
    [1, 72, 101, 108, 108, 111],  # one block on either side
    list(range(40, 90)),  # 50 tokens: 4 blocks of 16 into 2 blocks of 32
    [1, *range(100, 131)],  # 32 tokens: exactly 2 blocks of 16, 1 of 32
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110] * 4,
]
MATCHED_DECODE = ("--tokens-per-block", "16", "--kv-dtype", "bfloat16")
MIXED_DECODE = ("--tokens-per-block", "32", "--kv-dtype", "float32")


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Router + prefill (bfloat16 cache, 16/block) + matched decode worker ``decode-matched``."""
    stack = Stack(
        model_dir=tiny_model_dir,
        served_model_name="tiny-llama",
        log_dir=tmp_path_factory.mktemp("mixed"),
        extra_worker_args=("--dtype", "bfloat16"),
        compile=True,
    )
    try:
        stack.start_router()
        stack.start_worker("prefill", "prefill-0", ("--tokens-per-block", "16"))
        stack.start_worker("decode", "decode-matched", MATCHED_DECODE)
        stack.wait_ready(2)
        yield stack
    finally:
        stack.stop()


def _layouts(stack: Stack) -> dict[str, tuple[int, str]]:
    records = stack.registry_workers()
    return {
        r["worker_id"]: (r["layout"]["tokens_per_block"], r["layout"]["dtype"]) for r in records
    }


def _wait_for_workers(stack: Stack, names: set[str], timeout_s: float = 60.0) -> None:
    wait_until_sync(
        lambda: set(_layouts(stack)) == names,
        timeout_s,
        interval_s=0.2,
        what=f"the registry to hold exactly {sorted(names)}",
    )
    stack.wait_ready(len(names))


def _complete(stack: Stack, prompt: list[int], *, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0, timeout=60)
    kw = dict(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0)
    if stream:
        chunks = client.completions.create(**kw, stream=True)  # type: ignore[call-overload]
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]


def test_mixed_block_size_and_kv_dtype_give_the_same_greedy_tokens_as_matched_layouts(stack):
    assert _layouts(stack) == {"prefill-0": (16, "bfloat16"), "decode-matched": (16, "bfloat16")}
    matched = [_complete(stack, prompt) for prompt in PROMPTS]

    stack.start_worker("decode", "decode-mixed", MIXED_DECODE)
    _wait_for_workers(stack, {"prefill-0", "decode-matched", "decode-mixed"})
    stack.procs["decode-matched"].kill(signal.SIGTERM)  # drains: deregisters first
    _wait_for_workers(stack, {"prefill-0", "decode-mixed"})
    assert _layouts(stack)["decode-mixed"] == (32, "float32")

    for prompt, want in zip(PROMPTS, matched, strict=True):
        assert _complete(stack, prompt) == want, f"prompt {prompt}"
    assert _complete(stack, PROMPTS[1], stream=True) == matched[1]
    assert all(text for text in matched)  # the comparison is over real completions
