"""Structured-output fields of the router's OpenAI API: response_format, vLLM's
structured_outputs and guided_* map to one StructuredOutput and the field it came from; a
malformed one (the size caps in preprocessing, then :func:`pdserve.grammar.check`, which the
router's grammar checker runs), or two at once, is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.grammar import JSON_OBJECT_SCHEMA, check
from pdserve.protocol import StructuredOutput
from pdserve.server.chat.sampling_fields import structured_output
from pdserve.server.chat.schemas import ChatCompletionRequest, CompletionRequest

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields: Any) -> StructuredOutput | None:
    """The chat request's constraint, checked as the router checks it."""
    so, param = structured_output(ChatCompletionRequest.model_validate({**CHAT, **fields}))
    if so is not None:
        assert param is not None
        check(so, param)
    return so


def completion(**fields: Any) -> StructuredOutput | None:
    body = {"model": "m", "prompt": "x", **fields}
    so, param = structured_output(CompletionRequest.model_validate(body))
    assert (so is None) == (param is None)
    return so


def test_each_form_maps_to_its_constraint() -> None:
    assert chat() is None and chat(response_format={"type": "text"}) is None
    assert chat(response_format={"type": "json_object"}) == StructuredOutput(
        kind="json", spec=JSON_OBJECT_SCHEMA
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    so = chat(response_format=fmt)
    assert so is not None and (so.kind, json.loads(so.spec), so.whitespace) == (
        "json",
        SCHEMA,
        False,
    )
    assert completion(structured_outputs={"json": SCHEMA}) == so
    assert completion(guided_json=json.dumps(SCHEMA)) == so
    assert completion(structured_outputs={"regex": "[a-z]+"}) == StructuredOutput(
        kind="regex", spec="[a-z]+"
    )
    assert completion(guided_choice=["a", "b"]) == StructuredOutput(
        kind="choice", spec='["a", "b"]'
    )
    assert completion(structured_outputs={"grammar": 'start: "x"'}) == StructuredOutput(
        kind="grammar", spec='start: "x"'
    )
    spaced = completion(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert spaced is not None and spaced.whitespace


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema", "needs json_schema.schema"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema", "does not compile"),
        ({"structured_outputs": {"json": {"$ref": "#/missing"}}}, "structured_outputs.json",
         "does not compile"),
        ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs.regex",
         "does not compile"),
        ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar",
         "does not compile"),
        ({"guided_json": "{not json"}, "guided_json", "guided_json:"),
        ({"guided_grammar": "J"}, "guided_grammar", "not a Lark or GBNF grammar"),
        ({"guided_grammar": "a ::= b"}, "guided_grammar", "guided_grammar"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "exactly one"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "one structured output"),
    ],
)  # fmt: skip
def test_a_bad_or_doubled_constraint_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, fragment: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        chat(**fields)
    assert err.value.param == param and fragment in str(err.value), err.value
