"""Structured outputs through real processes on the tiny model (random weights: without the
grammar its text is noise, so every valid document below is the grammar's doing).

- A router + prefill + decode stack (every request handed off) and a router + colocated stack:
  ``response_format`` json_schema greedy output is the same token for token on both, parses and
  validates; seeded sampled output validates on every try; each of ``n`` choices does; a
  stream's deltas join into a valid document.
- vLLM's ``structured_outputs`` (regex, choice, grammar) and ``guided_choice`` constrain too.
- Tool calls: ``required`` and named ones are schema-valid; under ``auto`` the lazily triggered
  grammar runs on both legs (free text, equal across the split).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.models import build_tiny_model
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
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    """(router + 1 prefill + 1 decode, router + 1 colocated) on the tiny model with a 2048-token
    window (the tools' prompt in bytes outgrows the usual 512)."""
    tiny_model_dir = build_tiny_model(
        tmp_path_factory.mktemp("tiny-2k"), arch={"max_position_embeddings": 2048}
    )
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


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}


def _check_calls(calls: Any) -> None:
    assert calls, "at least one call"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def test_required_tool_calls_are_schema_valid_across_the_split(stacks: tuple[Stack, Stack]) -> None:
    pd, colocated = stacks
    tools = [WEATHER_TOOL, TIME_TOOL]
    for seed in range(5):
        kw = dict(
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,  # one call: the array closes after it
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        choice = _chat(pd, **kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
        alone = _chat(colocated, **kw).choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in alone] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ], "seeded: the same calls colocated"
    several = _chat(pd, tools=tools, tool_choice="required", temperature=1.0, seed=1,
                    max_tokens=400).choices[0]  # fmt: skip
    assert several.finish_reason == "tool_calls"
    _check_calls(several.message.tool_calls)


def test_a_named_tool_call_streams_as_tool_call_deltas_that_parse(
    stacks: tuple[Stack, Stack],
) -> None:
    pd, _ = stacks
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = _chat(
        pd, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named, temperature=0, max_tokens=80
    )
    choice = whole.choices[0]
    assert (
        choice.finish_reason == "tool_calls"
        and choice.message.tool_calls[0].function.name == "get_weather"
    )
    _check_calls(choice.message.tool_calls)
    chunks = list(_chat(pd, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named, temperature=0,
                        max_tokens=80, stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [t for d in deltas for t in (d.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    assert len(pieces) > 2, "the arguments arrive in pieces"
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert arguments == choice.message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


# --- the Responses API (POST /v1/responses) on the same stacks ----------------------------------

TEXT_FORMAT = {
    "format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
}
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER_TOOL, TIME_TOOL)]


def _respond(stack: Stack, **kw: Any) -> Any:
    return _client(stack).responses.create(model=MODEL, input="Describe a person as JSON.", **kw)


def test_responses_create_returns_output_text_within_max_output_tokens(
    stacks: tuple[Stack, Stack],
) -> None:
    pd, _ = stacks
    resp = _respond(pd, max_output_tokens=20, temperature=0)
    assert resp.object == "response" and resp.id.startswith("resp_")
    (message,) = resp.output
    assert message.type == "message" and message.content[0].text == resp.output_text
    assert resp.output_text, "the tiny model's noise is text"
    assert resp.usage is not None and 0 < resp.usage.output_tokens <= 20
    if resp.status == "incomplete":
        assert resp.usage.output_tokens == 20
        assert resp.incomplete_details is not None
        assert resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed"
    assert resp.max_output_tokens == 20 and resp.store is False


def test_responses_json_schema_is_valid_and_equal_across_the_split_and_colocated(
    stacks: tuple[Stack, Stack],
) -> None:
    pd, colocated = stacks
    kw = dict(text=TEXT_FORMAT, temperature=0, max_output_tokens=80)
    split, alone = _respond(pd, **kw), _respond(colocated, **kw)
    assert split.status == "completed" and split.output_text == alone.output_text
    _valid(split.output_text)
    chat = _chat(pd, response_format=JSON_SCHEMA_FORMAT, temperature=0, max_tokens=80)
    assert split.output_text == chat.choices[0].message.content, "the same request as chat's"


def test_responses_required_tool_call_is_a_schema_valid_function_call(
    stacks: tuple[Stack, Stack],
) -> None:
    pd, colocated = stacks
    kw = dict(
        tools=FLAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=120,
    )
    resp = _respond(pd, **kw)
    assert resp.status == "completed" and resp.output_text == ""
    (call,) = resp.output
    assert call.type == "function_call" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    (other,) = _respond(colocated, **kw).output
    assert (other.name, other.arguments) == (call.name, call.arguments)


def test_auto_tool_choice_runs_its_grammar_on_both_legs_and_free_text_stays_content(
    stacks: tuple[Stack, Stack],
) -> None:
    # the random model does not open a call (the engine test resumes one inside a call): its
    # text under auto's lazily triggered grammar is the same on both stacks, content, no calls
    pd, colocated = stacks
    kw = dict(tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=40)
    split = _chat(pd, **kw).choices[0]
    alone = _chat(colocated, **kw).choices[0]
    assert split.finish_reason in ("stop", "length") and split.message.tool_calls is None
    assert split.message.content and split.message.content == alone.message.content
    resp = _respond(pd, tools=FLAT_TOOLS, temperature=0, max_output_tokens=40)
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output_text == split.message.content, "the same request as chat's"


def test_responses_stream_ends_with_the_completed_response_of_the_deltas(
    stacks: tuple[Stack, Stack],
) -> None:
    pd, _ = stacks
    events = list(_respond(pd, text=TEXT_FORMAT, temperature=0, max_output_tokens=80, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == deltas
    _valid(deltas)
    assert deltas == _respond(pd, text=TEXT_FORMAT, temperature=0, max_output_tokens=80).output_text
