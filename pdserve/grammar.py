"""Structured outputs: a request's :class:`~pdserve.protocol.StructuredOutput` as a grammar.

pdserve enforces structured outputs with llguidance (Microsoft's guidance engine, one of the
backends vLLM, SGLang and TensorRT-LLM use): an Earley parser over the tokenizer's vocabulary
that computes, for each step, the set of tokens that keep the text inside the grammar (a
bitmask of ``ceil(vocab / 32)`` int32 words), in tens of microseconds, without compiling the
grammar ahead of time. It was picked over xgrammar because it has no dependencies (xgrammar pulls
triton and a tensor runtime into a CPU install), ships one wheel for every Python, and takes
JSON Schema, regular expressions and context-free grammars (Lark syntax, or the GBNF that vLLM's
xgrammar backend takes, converted) through one interface. Its parser limits (items, lexer states,
steps per token) bound what a hostile grammar can cost.

This module is the part the router and the workers share: the grammar text of a constraint
(:func:`grammar_of`) and its validation (:func:`check`, the router's 400 before any worker is
involved). The per-request matcher state lives in :mod:`pdserve.workers.engine.grammar`.
llguidance is imported on first use.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pdserve.errors import InvalidRequestError
from pdserve.protocol import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""``response_format: {"type": "json_object"}``: any JSON object."""

MAX_CHOICES = 1024
"""Most strings a ``choice`` constraint may list."""


def grammar_of(so: StructuredOutput) -> str:
    """The llguidance grammar (its top-level JSON form) enforcing ``so``. Raises
    :class:`ValueError` when ``so.spec`` is not what its kind needs (JSON text for ``json`` and
    ``choice``, a list of strings for ``choice``); grammar errors proper are reported by
    :func:`check` (llguidance accepts a grammar text lazily)."""
    from llguidance import LLMatcher

    if so.kind == "json":
        schema: Any = json.loads(so.spec)
        if not isinstance(schema, dict):
            raise ValueError("a JSON Schema is an object")
        compact: JsonCompileOptions = {"whitespace_flexible": so.whitespace}
        return str(LLMatcher.grammar_from_json_schema(schema, defaults=compact))
    if so.kind == "regex":
        return str(LLMatcher.grammar_from_regex(so.spec))
    if so.kind == "choice":
        options = json.loads(so.spec)
        if (
            not isinstance(options, list)
            or not options
            or not all(isinstance(o, str) for o in options)
        ):
            raise ValueError("choice is a non-empty list of strings")
        if len(options) > MAX_CHOICES:
            raise ValueError(f"choice lists at most {MAX_CHOICES} strings")
        # Lark string literals take JSON's escapes
        return str(LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options))))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(so.spec)  # Lark as it is, or GBNF converted
    except Exception as exc:  # the converter raises its own error types (and plain Exception)
        raise ValueError(f"not a Lark or GBNF grammar: {exc}") from None
    return str(LLMatcher.grammar_from_lark(lark))


def check(so: StructuredOutput, param: str) -> None:
    """Raise :class:`~pdserve.errors.InvalidRequestError` naming ``param`` when ``so`` does not
    compile (malformed JSON Schema, regex or grammar, or a schema feature llguidance lacks).
    Cost: linear in the spec's size; call it off the event loop for large ones."""
    try:
        grammar = grammar_of(so)
    except Exception as exc:  # ValueError, json.JSONDecodeError, or the library's own: a 400
        raise InvalidRequestError(f"{param}: {exc}", param=param) from None
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        first = error.strip().splitlines()[0] if error.strip() else error
        raise InvalidRequestError(f"{param} does not compile: {first[:500]}", param=param)
