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

This module is the part the router and the workers share: the caps on a constraint's size
(:func:`check_size`), the parser limits every matcher is built with (:func:`parser_limits`), the
grammar text of a constraint (:func:`grammar_of`) and its validation (:func:`check`). The
router runs :func:`check` in a child process under a deadline
(:mod:`pdserve.server.chat.grammar_checker`); the per-request matcher state lives in
:mod:`pdserve.workers.engine.sampling.grammar_masks`. llguidance is imported on first use.

What a hostile constraint can cost, and what bounds it (docs/reliability.md):

- size: at most :data:`MAX_SPEC_BYTES` of spec and :data:`MAX_RULES` grammar rules, refused
  before any parsing (llguidance's pure-Python GBNF converter is quadratic in the rules, and
  its Rust compiler recurses once per chained rule: about 3000 overflow an 8 MiB stack);
- CPU and memory of the lexer: :func:`parser_limits` (the initial lexer build's fuel is what
  a regex like ``(a{1000}){1000}`` spends: 160 MB and 0.7 s at llguidance's default, 18 MB
  and 0.08 s at ours; the lexer's states; the Earley items and lexer fuel of one step);
- wall time: the router's deadline on conversion, compilation and the first mask.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import TYPE_CHECKING, Any

from pdserve.errors import InvalidRequestError
from pdserve.protocol import StructuredOutput

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer
    from llguidance._lib import JsonCompileOptions

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""``response_format: {"type": "json_object"}``: any JSON object."""

MAX_CHOICES = 1024
"""Most strings a ``choice`` constraint may list."""

MAX_SPEC_BYTES = 256 * 1024
"""Largest constraint spec (a JSON Schema's text, a regex, a grammar, a choice list), UTF-8
bytes: 256 KiB holds a schema of hundreds of properties; vLLM sets no bound."""

MAX_RULES = 500
"""Most rules a ``grammar`` constraint may define (Lark or GBNF). GBNF conversion is quadratic
in them (500 chained rules: about 0.25 s on a 2-core machine, 1000: about 1 s)."""

INITIAL_LEXER_FUEL = 100_000
"""llguidance's fuel for building a grammar's lexer (default 1,000,000, about 50 k/ms): a
schema of 60 typed properties needs a few thousand; ``(a{1000}){1000}`` hits the bound."""

MAX_LEXER_STATES = 20_000
"""llguidance's bound on the lexer states one grammar builds while decoding (default 250,000;
each costs 1-2 kB)."""

# GBNF rule heads ("name ::=") and Lark ones ("name:" / "?name:" / "NAME.2:" at a line start).
_GBNF_RULE = re.compile(r"::=")
_LARK_RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?!:)")


@cache
def parser_limits() -> LLParserLimits:
    """The llguidance parser limits every pdserve matcher is built with, on the router's checker
    and the workers alike (so a constraint the router accepts compiles on every worker): the
    lexer fuel and states above, llguidance's defaults for one step's items and fuel (about
    15 ms at most), and no parser state or grammar text in error messages (they reach logs)."""
    from llguidance import LLParserLimits

    return LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        max_lexer_states=MAX_LEXER_STATES,
        verbose_errors=False,
    )


def check_size(so: StructuredOutput, param: str) -> None:
    """Raise :class:`~pdserve.errors.InvalidRequestError` naming ``param`` when ``so`` exceeds
    :data:`MAX_SPEC_BYTES` or (a grammar) :data:`MAX_RULES`. Linear in the spec's size, parses
    nothing: the router calls it before any grammar work."""
    size = len(so.spec.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(
            f"{param} is {size} bytes; at most {MAX_SPEC_BYTES} are accepted", param=param
        )
    if so.kind == "grammar":
        rules = len(_GBNF_RULE.findall(so.spec)) or len(_LARK_RULE.findall(so.spec))
        if rules > MAX_RULES:
            raise InvalidRequestError(
                f"{param} defines {rules} rules; at most {MAX_RULES} are accepted", param=param
            )


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
    return str(LLMatcher.grammar_from_lark(lark_of(so.spec)))


def lark_of(grammar: str) -> str:
    """``grammar`` in Lark syntax: as it is, or converted from GBNF (llguidance's converter,
    pure Python, quadratic in the rules: call it only on a grammar within :data:`MAX_RULES`).
    Raises :class:`ValueError` when it is neither."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except RecursionError:
        raise ValueError("the grammar nests too deeply") from None
    except Exception as exc:  # the converter raises its own error types (and plain Exception)
        raise ValueError(f"not a Lark or GBNF grammar: {exc}") from None


def normalized(so: StructuredOutput) -> StructuredOutput:
    """``so`` as the workers should get it: a GBNF grammar converted to Lark once (so no worker
    runs the quadratic converter), anything else unchanged. Raises :class:`ValueError` for a
    grammar that is neither Lark nor GBNF."""
    if so.kind != "grammar":
        return so
    lark = lark_of(so.spec)
    return so if lark == so.spec else so.model_copy(update={"spec": lark})


def check(
    so: StructuredOutput, param: str, tokenizer: LLTokenizer | None = None
) -> StructuredOutput:
    """``so`` checked, and :func:`normalized`. Raises
    :class:`~pdserve.errors.InvalidRequestError` naming ``param`` when ``so`` is too large
    (:func:`check_size`) or does not compile (malformed JSON Schema, regex or grammar, a schema
    feature llguidance lacks, a parser limit hit). With ``tokenizer`` (llguidance's view of the
    model's) the matcher is built over the vocabulary and its first token mask computed, as a
    worker will (where a lexer spends its build fuel); without, the grammar alone is validated.
    Cost: bounded by the caps and :func:`parser_limits` but up to seconds, and a deep enough
    grammar overflows an 8 MiB stack: on untrusted input run it where it can be killed
    (:mod:`pdserve.server.chat.grammar_checker`)."""
    from llguidance import LLMatcher

    check_size(so, param)
    try:
        norm = normalized(so)
        grammar = grammar_of(norm)
    except Exception as exc:  # ValueError, json.JSONDecodeError, or the library's own: a 400
        raise InvalidRequestError(f"{param}: {str(exc)[:300]}", param=param) from None
    if tokenizer is not None:
        matcher_of(tokenizer, grammar, param)
        return norm
    error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise InvalidRequestError(f"{param} does not compile: {first_line(error)}", param=param)
    return norm


def matcher_of(tokenizer: LLTokenizer, grammar: str, param: str) -> LLMatcher:
    """An llguidance matcher of ``grammar`` (:func:`grammar_of`'s text) over ``tokenizer``, with
    :func:`parser_limits`, its first token mask computed (the lexer's build: the part of a
    grammar's cost that the first step would otherwise pay). Raises
    :class:`~pdserve.errors.InvalidRequestError` naming ``param`` when it does not compile
    or a limit is hit. Releases the GIL while compiling."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        error = first_line(matcher.get_error())
        raise InvalidRequestError(f"{param} does not compile: {error}", param=param)
    return matcher


def first_line(error: str) -> str:
    """The first line of an llguidance error, at most 300 characters (its later lines quote the
    grammar and the parser state: the client's text, not for logs)."""
    text = error.strip()
    return (text.splitlines()[0] if text else "unknown error")[:300]
