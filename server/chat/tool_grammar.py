"""The constraints of tool calling: what each ``tool_choice`` lets the model write, as a
:class:`~pdserve.protocol.StructuredOutput` the workers enforce token by token (the same path as
``response_format``, on the prefill and decode legs alike).

- ``required``: a JSON array of ``{"name": <a tool>, "parameters": <its schema>}`` items, at
  least one (exactly one without parallel calls).
- named: the named function's parameters schema; the whole text is its arguments.
- ``auto``: free text, until the text opens a call in the tool-call parser's format; from there
  to the end of that call the name is one of the declared tools and the arguments follow its
  schema; then free text again (a grammar of lazy lexemes, as xgrammar's and llguidance's
  structural tags: llguidance ``StructTag``, docs/syntax.md "Tool calling"). Free text may
  end at any point (EOS is allowed wherever a call is not open):

  - ``hermes``: the opening is the text ``<tool_call>``; the call is ``\\n``? then
    ``{"name": N, "arguments": {...}}`` then ``\\n``? ``</tool_call>``; any number of calls (one
    without parallel calls: the text after it is free).
  - ``llama3_json``: a reply whose first non-blank character is ``{`` (or that opens with
    ``<|python_tag|>``) is calls ``{"name": N, "parameters": {...}}``, separated by ``;``;
    any other reply is free text.

  A call's JSON is laid out as Python's ``json.dumps`` writes it (``", "`` and ``": "``, no
  other whitespace), as the calls in pdserve's default tool prompt are, so a model cannot
  spend its tokens on whitespace inside an unfinished call.

  Cost on free text (SmolLM2's 49k vocabulary, one core): the token mask takes about 5 us a
  step, as for no grammar at all, and about 0.45 ms while the text ends in a prefix of the
  opening (``<``, ``<tool``...); the masking itself, as for every constrained request, about
  0.1 ms.

Names are trusted here (the request schema checked them: letters, digits, ``_ . -``); schemas
are not: the router compiles every constraint before any worker sees it (a schema that does
not compile is a 400 naming ``tools``). In auto mode the schemas are compiled leniently:
keywords llguidance does not implement (``not``, ``if``/``then``, an unknown ``format``, ...)
are not enforced rather than refused, since auto served any schema before it was constrained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pdserve.protocol import StructuredOutput

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

AUTO_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}
"""llguidance's JSON options for a call in auto mode (``x-guidance``): ``json.dumps``'s layout;
keywords llguidance lacks are ignored."""

ArgumentsKey = Literal["arguments", "parameters"]


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of an OpenAI tool's arguments (``function.parameters``); a tool without
    one (or with an empty one) takes any object."""
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def call_schema(tool: dict[str, Any], key: ArgumentsKey) -> dict[str, Any]:
    """The JSON Schema of one call of ``tool``: ``{"name": <its name>, key: <its arguments>}``,
    nothing else, the name first."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool["function"]["name"]}, key: parameters_of(tool)},
        "required": ["name", key],
        "additionalProperties": False,
    }


def required_constraint(tools: Sequence[dict[str, Any]], parallel: bool) -> StructuredOutput:
    """``tool_choice: required``: a JSON array of calls of ``tools`` (OpenAI tool dicts), at
    least one, at most one unless ``parallel``."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [call_schema(t, "parameters") for t in tools]},
    }
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput(kind="json", spec=json.dumps(schema))


def named_constraint(tool: dict[str, Any]) -> StructuredOutput:
    """A named ``tool_choice``: the text is ``tool``'s arguments."""
    return StructuredOutput(kind="json", spec=json.dumps(parameters_of(tool)))


def auto_grammar(
    tools: Sequence[dict[str, Any]],
    parser: str,
    parallel: bool,
    *,
    python_tag_token: bool = False,
) -> str:
    """The Lark grammar (llguidance's dialect) of ``tool_choice: auto`` for ``parser``
    (``hermes`` or ``llama3_json``; see the module docstring): free text in which an opened call
    is one of ``tools`` (OpenAI tool dicts, at least one) with schema-valid arguments.
    ``parallel``: more than one call. ``python_tag_token``: the
    tokenizer has ``<|python_tag|>`` as a special token, which may then open llama3_json calls
    too. Deterministic: equal arguments give equal text (the workers' cache key). Raises
    ValueError for an empty ``tools`` or an unknown ``parser``."""
    if not tools:
        raise ValueError("auto_grammar needs at least one tool")
    key: ArgumentsKey = "arguments" if parser == "hermes" else "parameters"
    calls = {"anyOf": [call_schema(t, key) for t in tools], "x-guidance": AUTO_JSON_OPTIONS}
    body = f"%json {json.dumps(calls)}"
    if parser == "hermes":
        return "\n".join(
            (
                "%llguidance {}",
                f"start: call{'*' if parallel else '?'} TEXT",
                r"TEXT: /(.|\n)*/",
                f"call_open[lazy]: TEXT {json.dumps(HERMES_OPEN)}",
                rf'call: call_open "\n"? body "\n"? {json.dumps(HERMES_CLOSE)}',
                f"body: {body}",
            )
        )
    if parser == "llama3_json":
        tag = f"(PYTHON_TAG | {PYTHON_TAG})" if python_tag_token else "PYTHON_TAG"
        more = " (SEP call)*" if parallel else ""
        return "\n".join(
            (
                "%llguidance {}",
                "start: TEXT | calls",
                # blank, or a first non-blank character other than "{", and not the tag's text
                r"TEXT: /[ \t\r\n]*([^{ \t\r\n](.|\n)*)?/"
                r" & ~/[ \t\r\n]*<\|python_tag\|>(.|\n)*/",
                f"calls: BLANK? ({tag} BLANK?)? call{more} BLANK?",
                f"PYTHON_TAG: {json.dumps(PYTHON_TAG)}",
                r"BLANK: /[ \t\r\n]+/",
                r"SEP: /[ \t\r\n]*;[ \t\r\n]*/",
                f"call: {body}",
            )
        )
    raise ValueError(f"no tool-call grammar for parser {parser!r}")
