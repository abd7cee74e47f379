"""``n`` choices per request on the whole disaggregated path (router + prefill + decode on the
tiny model, real processes), driven by the official ``openai`` client: indexes, seeded
reproducibility (choice ``i`` samples with seed ``seed + i``), distinct choices, usage summed
over the choices, chat and completions, streamed and not; the decode worker frees every block
the choices shared."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from tests.support.servers import wait_until_sync
from tests.support.stack import Stack

PROMPT = [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110]
N = 3
SEED = 1234
SAMPLED: dict[str, Any] = dict(model="tiny-llama", n=N, seed=SEED, temperature=1.0, max_tokens=12)


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _streamed_texts(chunks: list[Any], text_of: Any) -> tuple[list[str], list[str | None]]:
    """Per choice: the joined text and the finish reasons (exactly one expected) of a stream."""
    texts: list[str] = [""] * N
    finishes: list[list[str]] = [[] for _ in range(N)]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += text_of(choice) or ""
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes), finishes
    return texts, [f[0] for f in finishes]


def test_completions_n_choices_are_indexed_distinct_seeded_and_counted(tiny_stack: Stack) -> None:
    client = _client(tiny_stack)
    first = client.completions.create(prompt=PROMPT, logprobs=0, **SAMPLED)
    assert [c.index for c in first.choices] == list(range(N))
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1, texts
    tokens = [len(c.logprobs.tokens) for c in first.choices]
    assert all(1 <= t <= 12 for t in tokens)
    assert first.usage.completion_tokens == sum(tokens)
    assert first.usage.total_tokens == first.usage.prompt_tokens + sum(tokens)
    assert first.usage.prompt_tokens == len(PROMPT)

    again = client.completions.create(prompt=PROMPT, logprobs=0, **SAMPLED)
    assert [c.text for c in again.choices] == texts
    assert [c.finish_reason for c in again.choices] == [c.finish_reason for c in first.choices]

    # Choice i samples as a one-choice request seeded with seed + i would.
    for i in range(N):
        solo = client.completions.create(prompt=PROMPT, **{**SAMPLED, "n": 1, "seed": SEED + i})
        assert solo.choices[0].text == texts[i], f"choice {i}"

    stream = client.completions.create(
        prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    chunks = list(stream)
    streamed, finishes = _streamed_texts([c for c in chunks if c.choices], lambda c: c.text)
    assert streamed == texts
    assert finishes == [c.finish_reason for c in first.choices]
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens


def test_chat_n_choices_streamed_and_not_agree_and_repeat(tiny_stack: Stack) -> None:
    client = _client(tiny_stack)
    kwargs = dict(messages=[{"role": "user", "content": "tell me"}], logprobs=True, **SAMPLED)
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == list(range(N))
    texts = [c.message.content for c in whole.choices]
    assert all(c.message.role == "assistant" for c in whole.choices)
    assert len(set(texts)) > 1, texts
    tokens = [len(c.logprobs.content) for c in whole.choices]
    assert whole.usage.completion_tokens == sum(tokens)

    assert [c.message.content for c in client.chat.completions.create(**kwargs).choices] == texts

    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    with_choices = [c for c in chunks if c.choices]
    roles = [c.choices[0].index for c in with_choices if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == list(range(N))  # one role chunk per choice
    streamed, finishes = _streamed_texts(with_choices, lambda c: c.delta.content)
    assert streamed == texts
    assert finishes == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_of_one_token_each(tiny_stack: Stack) -> None:
    """The first token ends choice 0 on the prefill worker; the other choices still run."""
    got = _client(tiny_stack).completions.create(
        prompt=PROMPT, **{**SAMPLED, "max_tokens": 1, "n": 4}
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("length", "stop") for c in got.choices)
    assert got.usage.completion_tokens == 4


def test_greedy_choices_all_equal_the_single_choice(tiny_stack: Stack) -> None:
    client = _client(tiny_stack)
    kwargs: dict[str, Any] = dict(model="tiny-llama", prompt=PROMPT, max_tokens=16, temperature=0)
    solo = client.completions.create(**kwargs).choices[0].text
    many = client.completions.create(n=4, **kwargs)
    assert [c.text for c in many.choices] == [solo] * 4


def _idle(worker: dict[str, Any]) -> bool:
    load = httpx.get(f"{worker['http_url']}/load", timeout=5).json()
    return bool(
        load["parked"] == load["running"] == load["waiting"] == 0
        and load["free_blocks"] == load["total_blocks"]
    )


def test_shared_prompt_blocks_are_all_freed(tiny_stack: Stack) -> None:
    _client(tiny_stack).completions.create(prompt=PROMPT, **SAMPLED)
    workers = tiny_stack.registry_workers()
    wait_until_sync(
        lambda: all(_idle(w) for w in workers), 5, interval_s=0.1, what="every worker to be idle"
    )


def test_a_list_of_prompts_gives_each_its_n_choices_in_order(tiny_stack: Stack) -> None:
    """Choice ``k * n + i`` of a batch is choice ``i`` of prompt ``k`` alone (seeded), whole and
    streamed; ``echo`` puts each prompt's text first."""
    client = _client(tiny_stack)
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:]]
    batch = client.completions.create(prompt=prompts, **SAMPLED)
    assert [c.index for c in batch.choices] == list(range(len(prompts) * N))
    for k, prompt in enumerate(prompts):
        alone = client.completions.create(prompt=prompt, **SAMPLED)
        assert [c.text for c in batch.choices[k * N : (k + 1) * N]] == [
            c.text for c in alone.choices
        ], f"prompt {k}"
    assert batch.usage is not None and batch.usage.prompt_tokens == sum(map(len, prompts))
    chunks = list(client.completions.create(prompt=prompts, stream=True, **SAMPLED))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(len(prompts) * N)] == [c.text for c in batch.choices]
    echoed = client.completions.create(prompt=["Hello", "World"], echo=True, **SAMPLED)
    assert [c.text[:5] for c in echoed.choices] == ["Hello"] * N + ["World"] * N
