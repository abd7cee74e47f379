"""Tool calling's text side: the prompt (tools and earlier calls through the chat template, or
pdserve's default for a template without tools), the constraints of required, named and auto
calls (auto's lazily triggered grammar run through a matcher on the byte-level tokenizer), and
the parsers (hermes, llama3_json, required) whole and streamed, which return calls of declared
tools only."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from pdserve.errors import InvalidRequestError
from pdserve.grammar import check
from pdserve.protocol import StructuredOutput
from pdserve.server.chat.tool_calls import (
    ToolPlan,
    ToolStream,
    is_special_token,
    prompt_messages,
    renders_tools,
)
from pdserve.workers.engine.sampling.grammar_masks import GrammarCompiler
from tests.support.models import TINY_SPECIAL_TOKENS, tiny_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = (WEATHER, TIME)


def plan(mode: str = "auto", **kw: Any) -> ToolPlan:
    return ToolPlan(mode=mode, tools=TOOLS, **kw)  # type: ignore[arg-type]


def streamed(p: ToolPlan, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Feed ``pieces`` through a ToolStream; return (content, calls as {id,name,arguments})."""
    stream = ToolStream(p)
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content = "".join(d.content for d in deltas if d.content)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.call is not None:
            assert d.index not in calls, "the name comes once, first"
            calls[d.index or 0] = {"id": d.call.id, "name": d.call.name, "arguments": ""}
        elif d.arguments is not None:
            calls[d.index or 0]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)]


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def test_hermes_calls_are_parsed_out_of_the_text_whole_and_streamed() -> None:
    content, calls = plan().parse(HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    for size in (1, 3, 7, 1000):
        text, got = streamed(plan(), pieces_of(HERMES, size))
        assert text.strip() == "Let me check."
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == [
            ("get_weather", {"city": "Paris"}),
            ("get_time", {}),
        ], size
    one, _ = plan(parallel=False).parse(HERMES)
    assert len(plan(parallel=False).parse(HERMES)[1]) == 1 and one == "Let me check."


def test_text_without_a_well_formed_call_stays_content() -> None:
    for text in ("plain <tool text", "<tool_call>not json</tool_call>", '<tool_call>{"name"'):
        assert plan().parse(text) == (text, [])
        content, calls = streamed(plan(), pieces_of(text, 2))
        assert (content, calls) == (text, [])


def test_llama3_json_replies_are_calls_and_other_text_is_content() -> None:
    p = plan(parser="llama3_json")
    reply = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    content, calls = p.parse(reply)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert streamed(p, pieces_of(reply, 4))[1][0]["name"] == "get_weather"
    assert p.parse("It is sunny.") == ("It is sunny.", [])
    assert streamed(p, ["It is ", "sunny."]) == ("It is sunny.", [])


ROGUE = '<tool_call>\n{"name": "delete_all_files", "arguments": {"path": "/"}}\n</tool_call>'


def test_a_call_of_an_undeclared_tool_stays_content_whole_and_streamed() -> None:
    # issue 39 (7): only get_weather and get_time are declared
    assert plan().parse(ROGUE) == (ROGUE, [])
    assert streamed(plan(), pieces_of(ROGUE, 3)) == (ROGUE, [])
    mixed = f"First {ROGUE} then\n" + HERMES.split("\n", 1)[1]  # a rogue call, then two good
    content, calls = plan().parse(mixed)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert content is not None and "delete_all_files" in content and "get_weather" not in content
    text, got = streamed(plan(), pieces_of(mixed, 5))
    assert [c["name"] for c in got] == ["get_weather", "get_time"] and ROGUE in text
    rogue_json = '{"name": "delete_all_files", "parameters": {}}'
    for reply in (rogue_json, '{"name": "get_time", "parameters": {}}; ' + rogue_json):
        assert plan(parser="llama3_json").parse(reply) == (reply, [])  # the reply is text
        assert streamed(plan(parser="llama3_json"), pieces_of(reply, 4)) == (reply, [])
    required = '[{"name": "delete_all_files", "parameters": {}}]'
    assert plan("required").parse(required) == (required, [])


def test_required_constrains_to_an_array_of_the_tools_calls_and_parses_it() -> None:
    p = plan("required")
    so = p.constraint()
    assert so is not None and so.kind == "json"
    schema = json.loads(so.spec)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert (
        "maxItems" not in schema
        and json.loads(plan("required", parallel=False).constraint().spec)["maxItems"] == 1
    )  # type: ignore[union-attr]
    content, calls = p.parse(json.dumps(good))
    assert content is None and (calls[0].name, json.loads(calls[0].arguments)) == (
        "get_weather",
        {"city": "Rome"},
    )
    assert streamed(p, pieces_of(json.dumps(good), 5))[1][0]["name"] == "get_weather"
    assert p.parse('[{"name": "get_wea') == ('[{"name": "get_wea', [])  # cut off: content


def test_a_named_call_is_constrained_to_its_schema_and_streams_its_arguments() -> None:
    p = plan("named", named="get_weather")
    so = p.constraint()
    assert so is not None and json.loads(so.spec) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert json.loads(plan("named", named="get_time").constraint().spec) == {"type": "object"}  # type: ignore[union-attr]
    content, calls = streamed(p, ['{"city"', ':"Lima"}'])
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Lima"}
    assert p.parse('{"city":"Lima"}')[1][0].arguments == '{"city":"Lima"}'


# --- auto's grammar, run through a matcher on the byte-level tokenizer (one token a byte) -------

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}  # fmt: skip
STRICT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
EOS = 256 + TINY_SPECIAL_TOKENS.index("<|eos|>")


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer(), 256 + len(TINY_SPECIAL_TOKENS), [EOS])


def fits(compiler: GrammarCompiler, so: StructuredOutput, text: str) -> str:
    """How ``so`` takes ``text``: ``"may end"`` (every byte fits and EOS may follow),
    ``"open"`` (every byte fits, EOS may not follow) or ``"refused at N"`` (byte N does not)."""
    state = compiler.state(so)
    for i, byte in enumerate(text.encode()):
        try:
            state.consume(byte)
        except InvalidRequestError:
            return f"refused at {i}"
    mask = torch.zeros(1, 9, dtype=torch.int32)
    state.fill_mask(mask, 0)
    return "may end" if int(mask[0, EOS // 32]) >> (EOS % 32) & 1 else "open"


def auto(parser: str = "hermes", parallel: bool = True) -> StructuredOutput:
    p = ToolPlan(mode="auto", tools=(STRICT_WEATHER, TIME), parser=parser, parallel=parallel)
    so = p.constraint()
    check(so, "tools")  # compiles as the router checks it
    assert so.kind == "grammar" and so.spec == p.constraint().spec, "deterministic: one cache key"
    return so


def test_auto_hermes_grammar_frees_text_and_constrains_an_opened_call(
    compiler: GrammarCompiler,
) -> None:
    so = auto()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert fits(compiler, so, "") == "may end", "EOS before any text"
    assert fits(compiler, so, "Any text <b>, even <tool_ca") == "may end"
    assert fits(compiler, so, f"Let me look.{call}") == "may end", "free again after the call"
    assert fits(compiler, so, f'{call} and <tool_call>{{"name": "get_time", "arguments": {{}}}}'
                "</tool_call>") == "may end"  # fmt: skip
    assert fits(compiler, so, '<tool_call>{"name": "get_weather", "arg') == "open"
    rogue = '<tool_call>\n{"name": "d'
    assert fits(compiler, so, rogue) == f"refused at {len(rogue) - 1}", "an undeclared name"
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": "R'
    assert fits(compiler, so, bad) == f"refused at {len(bad) - 1}", "outside the enum"
    spaced = '<tool_call>{"name":"get_weather"'
    assert fits(compiler, so, spaced) == f"refused at {spaced.index(':') + 1}", "json.dumps layout"
    # without parallel calls the text after the one call is free, a second opening included
    one = auto(parallel=False)
    assert fits(compiler, one, f"{call}<tool_call>{{anything") == "may end"
    content, calls = ToolPlan(mode="auto", tools=(STRICT_WEATHER,)).parse(f"Hi {call}")
    assert content == "Hi" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_auto_llama3_json_grammar_constrains_a_reply_that_opens_with_a_brace(
    compiler: GrammarCompiler,
) -> None:
    so = auto("llama3_json")
    call = '{"name": "get_time", "parameters": {}}'
    assert fits(compiler, so, "") == "may end" and fits(compiler, so, "  ") == "may end"
    assert fits(compiler, so, "It is sunny {not a call}") == "may end"
    assert fits(compiler, so, f" {call}; {call}") == "may end"
    assert fits(compiler, so, f"<|python_tag|>{call}") == "may end"
    assert fits(compiler, so, '{"name": "get_weather", "parameters": {"city": "Oslo"') == "open"
    for rogue in ('\n{"name": "d', '<|python_tag|>{"name": "d'):
        assert fits(compiler, so, rogue) == f"refused at {len(rogue) - 1}", rogue
    single = auto("llama3_json", parallel=False)
    assert fits(compiler, single, f"{call};") == f"refused at {len(call)}"


def test_auto_grammar_skips_schema_keywords_it_lacks_and_needs_a_known_parser() -> None:
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}  # fmt: skip
    check(ToolPlan(mode="auto", tools=(odd,)).constraint(), "tools")  # lenient: compiles
    with pytest.raises(InvalidRequestError):
        check(ToolPlan(mode="required", tools=(odd,)).constraint(), "tools")  # strict there
    with pytest.raises(ValueError, match="no tool-call grammar"):
        ToolPlan(mode="auto", tools=(odd,), parser="pythonic").constraint()
    assert not is_special_token(tiny_tokenizer(), "<|python_tag|>")
    assert is_special_token(tiny_tokenizer(), "<|eos|>")


class _Tok:
    def __init__(self, template: Any) -> None:
        self.chat_template = template


def test_the_prompt_carries_tools_and_earlier_calls_either_way() -> None:
    assert renders_tools(_Tok("{% if tools %}...{% endif %}")) and not renders_tools(
        _Tok("{{ x }}")
    )
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
    ]  # fmt: skip
    native = prompt_messages(history, plan(), True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[0] == history[0] and native[2]["content"] == "18C"
    default = prompt_messages(history, plan(), False)
    assert default[0]["role"] == "system" and '"get_weather"' in default[0]["content"]
    assert "<tool_call>" in default[0]["content"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        in default[2]["content"]
    )
    assert default[3]["content"] == "<tool_response>\n18C\n</tool_response>"
    with_system = prompt_messages(
        [{"role": "system", "content": "Be brief."}, *history], plan(), False
    )
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 4
    bad = [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": "{oops"}}]}]  # fmt: skip
    with pytest.raises(InvalidRequestError) as err:
        prompt_messages(bad, plan(), False)
    assert err.value.param == "messages[0].tool_calls[0].function.arguments"


# --- through the router (in-process, fake workers) --------------------------------------------

MODEL = "tiny-test"
CALL_TEXT = (
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.support.fakes import build_tokenizer_dir

    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=4096)


def _replies(text: str) -> list[tuple[int, str]]:
    """The fake workers' reply: ``text`` in pieces of 5 characters (token ids are arbitrary)."""
    return [(65 + i % 20, text[i : i + 5]) for i in range(0, len(text), 5)]


async def _post(
    model_dir: Any, body: dict[str, Any], reply: str = CALL_TEXT, path: str = "chat/completions"
) -> tuple[Any, Any]:
    from pdserve.config.loading import RouterConfig
    from pdserve.protocol import Role
    from tests.support.fakes import FakeWorker, router_harness

    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL)
    workers = [
        FakeWorker("p0", Role.PREFILL, _replies(reply)),
        FakeWorker("d0", Role.DECODE, _replies(reply)),
    ]
    async with router_harness(cfg, workers) as h:
        r = await h.client.post(f"/v1/{path}", json={"model": MODEL, **body})
    return r, workers[0]


MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _prompt(model_dir: Any, worker: Any) -> str:
    """The prompt text the prefill worker was sent."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return str(tok.decode(worker.contexts[0].prompt_token_ids))


async def test_auto_tool_calls_come_back_as_tool_calls_whole_and_streamed(model_dir: Any) -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 40}
    r, prefill = await _post(model_dir, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    prompt = _prompt(model_dir, prefill)
    assert "get_weather" in prompt and "<tool_call>" in prompt, "the tools reach the prompt"
    structured = prefill.contexts[0].sampling.structured
    assert structured == ToolPlan("auto", (WEATHER,)).constraint(), "auto's grammar goes along"
    r, _ = await _post(model_dir, {**body, "stream": True})
    lines = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    deltas = [c["choices"][0] for c in lines if c["choices"]]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {
        "city": "Paris"
    }
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking."
    assert deltas[-1]["finish_reason"] == "tool_calls"


ROGUE_REPLY = f"Cleaning up.{ROGUE}"


async def test_a_call_of_an_undeclared_tool_comes_back_as_text_on_both_endpoints(
    model_dir: Any,
) -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 60}
    r, _ = await _post(model_dir, body, ROGUE_REPLY)
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ROGUE_REPLY}
    assert choice["finish_reason"] == "stop"
    r, _ = await _post(model_dir, {**body, "stream": True}, ROGUE_REPLY)
    lines = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    deltas = [c["choices"][0] for c in lines if c["choices"]]
    assert not any("tool_calls" in d["delta"] for d in deltas)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ROGUE_REPLY
    assert deltas[-1]["finish_reason"] == "stop"
    flat = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    r, _ = await _post(
        model_dir,
        {"input": "Clean up.", "tools": [flat], "max_output_tokens": 60},
        ROGUE_REPLY,
        path="responses",
    )
    (item,) = r.json()["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == ROGUE_REPLY


async def test_auto_gives_way_to_a_response_format_and_none_or_no_tools_stay_free(
    model_dir: Any,
) -> None:
    json_object = {"type": "json_object"}
    r, prefill = await _post(
        model_dir, {"messages": MESSAGES, "tools": [WEATHER], "response_format": json_object}
    )
    assert r.status_code == 200, r.text
    assert prefill.contexts[0].sampling.structured.kind == "json", "the request's own governs"
    for extra in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        r, prefill = await _post(model_dir, {"messages": MESSAGES, **extra})
        assert r.status_code == 200 and prefill.contexts[0].sampling.structured is None, extra


async def test_tool_choice_none_keeps_tools_out_and_text_plain(model_dir: Any) -> None:
    r, prefill = await _post(
        model_dir, {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "none"}
    )
    assert r.json()["choices"][0]["message"] == {
        "role": "assistant",
        "content": CALL_TEXT,
    }
    assert "get_weather" not in _prompt(model_dir, prefill)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function":
          {"name": "f", "arguments": "{oops"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ],
)  # fmt: skip
async def test_a_malformed_tool_request_is_a_400_naming_the_field(
    model_dir: Any, body: dict[str, Any], param: str
) -> None:
    r, prefill = await _post(model_dir, {"messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and prefill.contexts == []
