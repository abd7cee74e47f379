"""The router's grammar checker with its real child process: a constraint that crashes the
compiler or outlasts the deadline costs that request a 400 and the child a restart, never the
router; a full queue is a 429; GBNF comes back as Lark."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pdserve.errors import InvalidRequestError, QueueFullError
from pdserve.grammar import MAX_RULES
from pdserve.protocol import StructuredOutput
from pdserve.server.chat.grammar_checker import GrammarChecker
from tests.support.models import tiny_tokenizer

OK = StructuredOutput(kind="json", spec='{"type": "object"}')


def ref_chain(n: int) -> StructuredOutput:
    """A JSON Schema of ``n`` chained ``$ref``s: llguidance's compiler recurses once per link
    and overflows an 8 MiB stack near 3000 (a segmentation fault), well within the size cap."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return StructuredOutput(kind="json", spec=json.dumps({"$defs": defs, "$ref": "#/$defs/d0"}))


@pytest.fixture
async def checker() -> Any:
    tok = tiny_tokenizer()
    checker = GrammarChecker(tok, len(tok), [257])
    yield checker
    await checker.close()


async def test_a_compiler_crash_is_a_400_and_the_next_check_gets_a_new_child(
    checker: GrammarChecker,
) -> None:
    assert await checker.check(OK, "response_format") == OK
    with pytest.raises(InvalidRequestError) as err:
        await checker.check(ref_chain(5000), "response_format.json_schema.schema")
    assert err.value.param == "response_format.json_schema.schema"
    assert "nests too deeply" in err.value.message and checker.killed == 1
    assert await checker.check(OK, "response_format") == OK


async def test_a_check_past_the_deadline_is_killed_and_answered_400(
    checker: GrammarChecker,
) -> None:
    await checker.check(OK, "x")  # the child is up: the deadline times the check alone
    chain = "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(MAX_RULES - 2))
    slow = StructuredOutput(kind="grammar", spec=f'root ::= r0\n{chain}r{MAX_RULES - 2} ::= "b"\n')
    checker.deadline_s = 0.02  # the quadratic GBNF converter needs far longer
    with pytest.raises(InvalidRequestError, match="too complex: not compiled within"):
        await checker.check(slow, "structured_outputs.grammar")
    assert checker.killed == 1
    checker.deadline_s = 30.0
    lark = await checker.check(slow, "structured_outputs.grammar")  # a new child, in time
    assert lark.spec.startswith("%llguidance")


async def test_a_full_queue_is_a_429_and_a_bad_grammar_a_400_naming_the_field(
    checker: GrammarChecker,
) -> None:
    checker.max_waiting = 1
    first = asyncio.ensure_future(checker.check(OK, "a"))  # spawns the child meanwhile
    await asyncio.sleep(0)
    with pytest.raises(QueueFullError) as busy:
        await checker.check(OK, "b")
    assert busy.value.code == "grammar_busy"
    assert await first == OK
    with pytest.raises(InvalidRequestError) as err:
        await checker.check(StructuredOutput(kind="regex", spec="(unclosed"), "guided_regex")
    assert err.value.param == "guided_regex" and "does not compile" in err.value.message


async def test_answers_are_remembered_and_a_refusal_names_the_new_askers_field(
    checker: GrammarChecker,
) -> None:
    tools = StructuredOutput(kind="json", spec='{"type": "array"}')
    assert await checker.check(tools, "tools") == tools
    bad = StructuredOutput(kind="regex", spec="[z-a]")
    with pytest.raises(InvalidRequestError):
        await checker.check(bad, "guided_regex")
    asked = checker.checked
    assert await checker.check(tools, "tools") == tools  # an agent's next turn: no child trip
    with pytest.raises(InvalidRequestError) as err:
        await checker.check(bad, "structured_outputs.regex")
    assert checker.checked == asked
    assert err.value.param == "structured_outputs.regex"
    assert err.value.message.startswith("structured_outputs.regex: ")
    assert "guided_regex" not in err.value.message
