"""What a hostile structured output may cost (issue 39's probe): size and rule caps before any
parsing, llguidance's parser limits, a worker cache bounded by the bytes its matchers hold,
and a grammar that fails mid-way as the request's own error (one line, no grammar text)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from pdserve.errors import InvalidRequestError
from pdserve.grammar import (
    MAX_RULES,
    MAX_SPEC_BYTES,
    check,
    check_size,
    normalized,
    parser_limits,
)
from pdserve.protocol import StructuredOutput
from pdserve.workers.engine.sampling.grammar_masks import (
    MIN_ENTRY_BYTES,
    GrammarCompiler,
    GrammarError,
    apply_masks,
)
from tests.support.models import tiny_tokenizer

EOS = 257


def gbnf_chain(rules: int) -> str:
    """A GBNF grammar of ``rules`` chained rules (the probe's shape: 50,000 made 1.38 MB)."""
    body = "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(rules - 2))
    return f'root ::= r0\n{body}r{rules - 2} ::= "b"\n'


def lark_chain(rules: int) -> str:
    body = "".join(f'r{i}: "a" r{i + 1}\n' for i in range(rules - 2))
    return f'start: r0\n{body}r{rules - 2}: "b"\n'


def test_the_probes_50k_rule_gbnf_is_refused_by_its_size_before_any_parsing() -> None:
    so = StructuredOutput(kind="grammar", spec=gbnf_chain(50_000))
    assert len(so.spec.encode()) > MAX_SPEC_BYTES
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError) as err:
        check_size(so, "structured_outputs.grammar")
    assert time.perf_counter() - t0 < 0.5  # a regex count, not the quadratic converter
    assert err.value.param == "structured_outputs.grammar"
    assert f"at most {MAX_SPEC_BYTES}" in err.value.message


@pytest.mark.parametrize("make", [gbnf_chain, lark_chain])
def test_more_rules_than_the_cap_are_refused_and_the_cap_itself_compiles(make: Any) -> None:
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_RULES} are accepted"):
        check_size(StructuredOutput(kind="grammar", spec=make(MAX_RULES + 1)), "g")
    at_cap = StructuredOutput(kind="grammar", spec=make(MAX_RULES))
    norm = check(at_cap, "g")  # GBNF converted once, to Lark; a deep chain still compiles
    assert norm.spec.lstrip().startswith(("%llguidance", "start:"))


def test_gbnf_is_normalized_to_lark_and_lark_is_left_as_it_is() -> None:
    gbnf = StructuredOutput(kind="grammar", spec='root ::= "yes" | "no"')
    lark = normalized(gbnf)
    assert lark.spec.startswith("%llguidance") and '"yes"' in lark.spec
    assert normalized(lark) == lark
    regex = StructuredOutput(kind="regex", spec="[a-z]+")
    assert normalized(regex) is regex


def test_parser_limits_bound_the_lexer_and_keep_grammar_text_out_of_errors() -> None:
    limits = parser_limits()
    assert limits.initial_lexer_fuel == 100_000 and limits.max_lexer_states == 20_000
    assert limits.verbose_errors is False


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tiny model's byte-level tokenizer (ids 0-255 the bytes, 257 EOS)."""
    return tiny_tokenizer()


def pathological(i: int) -> StructuredOutput:
    """The probe's regex: its lexer blows llguidance's fuel on the first token it meets."""
    return StructuredOutput(kind="regex", spec=f"(a{{{1000 + i}}}){{1000}}")


def test_the_cache_is_bounded_by_the_bytes_its_matchers_hold(tokenizer: Any) -> None:
    budget = 48 << 20
    compiler = GrammarCompiler(tokenizer, 260, [EOS], capacity_bytes=budget)
    try:
        for i in range(8):
            compiler.prepare(pathological(i))
            assert compiler.cached_bytes <= budget or len(compiler._cache) == 1
        assert compiler.compiled == 8
        # each pathological matcher measured well above the floor, so few stay
        assert 1 <= len(compiler._cache) < 8
        charged = [cost for _, cost in compiler._cache.values()]
        assert all(cost >= MIN_ENTRY_BYTES for cost in charged)
        assert sum(charged) == compiler.cached_bytes
    finally:
        compiler.close()


def test_a_grammar_failing_mid_way_is_a_one_line_grammar_error(tokenizer: Any) -> None:
    compiler = GrammarCompiler(tokenizer, 260, [EOS])
    try:
        state = compiler.state(pathological(0))
        logits = torch.zeros(1, 260)
        apply_masks(logits, [(0, state)])
        with pytest.raises(GrammarError) as err:
            state.consume(int(logits.argmax()))
        assert err.value.status == 400 and err.value.code == "grammar_failed"
        assert "\n" not in err.value.message and "a{1000}" not in err.value.message
    finally:
        compiler.close()


def test_a_schema_that_fits_compiles_and_masks_on_the_compiler_thread(tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    so = StructuredOutput(kind="json", spec=json.dumps(schema))
    compiler = GrammarCompiler(tokenizer, 260, [EOS])
    try:
        state = compiler.state(so)
        logits = torch.zeros(1, 260)
        apply_masks(logits, [(0, state)])
        assert torch.isfinite(logits[0, ord("{")]) and not torch.isfinite(logits[0, ord("x")])
        compiler.state(so)  # cached: no second compile
        assert compiler.compiled == 1
    finally:
        compiler.close()
