"""Structured outputs through real processes on the tiny model (random weights: without the
grammar its text is noise, so every valid document below is the grammar's doing).

- A router + prefill + decode stack (every request handed off) and a router + colocated stack:
  ``response_format`` json_schema greedy output is the same token for token on both, parses and
  validates; seeded sampled output validates on every try; each of ``n`` choices does; a
  stream's deltas join into a valid document.
- vLLM's ``structured_outputs`` (regex, choice, grammar) and ``guided_choice`` constrain too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.stack import Stack, start_stack

MODEL = "tiny-llama"
PROMPT = list(range(40, 110))  # 70 tokens: past any local-prefill threshold
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def stacks(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Stack]]:
    """(router + 1 prefill + 1 decode, router + 1 colocated)."""
    pd = start_stack(tiny_model_dir, MODEL, tmp_path_factory.mktemp("pd"))
    try:
        colocated = start_stack(
            tiny_model_dir, MODEL, tmp_path_factory.mktemp("co"), prefill=0, decode=0, colocated=1
        )
        try:
            yield pd, colocated
        finally:
            colocated.stop()
    finally:
        pd.stop()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(stack: Stack, **kw: Any) -> Any:
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    return _client(stack).chat.completions.create(model=MODEL, messages=messages, **kw)


def _valid(text: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_json_schema_greedy_is_valid_and_equal_across_the_split_and_colocated(
    stacks: tuple[Stack, Stack],
) -> None:
    pd, colocated = stacks
    kw = dict(response_format=JSON_SCHEMA_FORMAT, temperature=0, max_tokens=80)
    split = _chat(pd, **kw).choices[0]
    alone = _chat(colocated, **kw).choices[0]
    assert split.finish_reason == "stop" and split.message.content == alone.message.content
    _valid(split.message.content)
    assert " " not in split.message.content.replace('" "', ""), "compact JSON by default"


def test_seeded_sampling_and_n_choices_stay_valid(stacks: tuple[Stack, Stack]) -> None:
    pd, colocated = stacks
    for seed in range(5):
        kw = dict(response_format=JSON_SCHEMA_FORMAT, temperature=1.0, seed=seed, max_tokens=80)
        text = _chat(pd, **kw).choices[0].message.content
        _valid(text)
        assert _chat(colocated, **kw).choices[0].message.content == text, "seeded: same tokens"
    many = _chat(pd, response_format=JSON_SCHEMA_FORMAT, temperature=1.0, n=3, max_tokens=80)
    assert len(many.choices) == 3
    for choice in many.choices:
        _valid(choice.message.content)


def test_a_streamed_json_object_joins_into_a_valid_document(stacks: tuple[Stack, Stack]) -> None:
    pd, _ = stacks
    chunks = _chat(
        pd, response_format=JSON_SCHEMA_FORMAT, temperature=1.0, seed=11, max_tokens=80, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _valid(text)
    anything = _chat(pd, response_format={"type": "json_object"}, temperature=0, max_tokens=60)
    choice = anything.choices[0]
    if choice.finish_reason == "stop":  # an object the tiny model closed within max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
         lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
         lambda t: t in ("alpha", "beta", "gamma")),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'root ::= "(" [a-c] [a-c]? ")"'}},
         lambda t: re.fullmatch(r"\([a-c]{1,2}\)", t)),
    ],
)  # fmt: skip
def test_vllm_structured_outputs_constrain_the_text(
    stacks: tuple[Stack, Stack], extra: dict[str, Any], check: Any
) -> None:
    pd, _ = stacks
    for seed in range(3):
        out = _client(pd).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, extra_body=extra
        )
        text = out.choices[0].text
        assert out.choices[0].finish_reason == "stop" and check(text), (extra, text)
