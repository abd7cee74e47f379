"""Tool calling: the prompt side (tools and earlier calls into the chat template), the
constraint of each ``tool_choice`` (built in :mod:`.tool_grammar`), and the parsing of the
model's text into OpenAI ``tool_calls``, whole or streamed.

How each ``tool_choice`` is served (after vLLM's OpenAI server, with xgrammar-style structural
tags for ``auto``):

- ``none`` (or no tools): the tools stay out of the prompt; plain text.
- ``auto`` (the default with tools): the tools go through the chat template
  (``apply_chat_template(tools=...)``); a template that does not render tools gets pdserve's
  default, a system message listing them in the Hermes format. The text is then parsed by the
  router's tool-call parser (``router.tool_call_parser``): ``hermes`` (calls in
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` tags, content around them) or
  ``llama3_json`` (the whole reply a JSON call ``{"name": ..., "parameters": {...}}``, several
  separated by ``;``, after an optional ``<|python_tag|>``). The output runs under a lazily
  triggered grammar: free text, but a call the model opens names a declared tool and its
  arguments follow that tool's schema. Only calls of declared tools are returned: a call of
  any other name (possible where the grammar is not applied: beside a ``response_format``)
  stays in the content, as text.
- ``required``: the output is constrained to a JSON array of
  ``{"name": <a tool>, "parameters": <its schema>}``, at least one (one when
  ``parallel_tool_calls`` is false), so even a small model returns schema-valid arguments.
- named (``{"type": "function", "function": {"name": N}}``): the output is constrained to N's
  parameters schema; the whole text is the call's arguments.

A choice that produced calls ends with ``finish_reason: "tool_calls"``. Streaming: content is
relayed as it comes except text that may open a call; a call is sent as two deltas, its id and
name first, then its arguments (a named call streams its arguments as they are generated).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.errors import InvalidRequestError
from pdserve.protocol import StructuredOutput
from pdserve.server.chat.tool_grammar import (
    HERMES_CLOSE,
    HERMES_OPEN,
    PYTHON_TAG,
    auto_grammar,
    named_constraint,
    required_constraint,
)

ToolMode = Literal["auto", "required", "named"]
PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class Call:
    """One parsed tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls[]`` item."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are served. ``tools``: the OpenAI tool definitions (dicts, at
    least one, distinct names); ``named``: the forced function (mode ``named``); ``parallel``:
    more than one call allowed; ``parser``: the auto mode's text format;
    ``python_tag_token``: the tokenizer has ``<|python_tag|>`` as a special token (it may then
    open llama3_json calls)."""

    mode: ToolMode
    tools: tuple[dict[str, Any], ...]
    named: str | None = None
    parallel: bool = True
    parser: str = "hermes"
    python_tag_token: bool = False

    @property
    def names(self) -> frozenset[str]:
        """The declared functions' names: the only calls :meth:`parse` returns."""
        return frozenset(t["function"]["name"] for t in self.tools)

    def constraint(self) -> StructuredOutput:
        """The structured output the choice runs under (:mod:`.tool_grammar`): the JSON of
        ``required`` and named calls, auto's lazily triggered grammar. The caller compiles it
        to check it, as any constraint (a tool schema that does not compile: 400 ``tools``)."""
        if self.mode == "named":
            (tool,) = [t for t in self.tools if t["function"]["name"] == self.named]
            return named_constraint(tool)
        if self.mode == "required":
            return required_constraint(self.tools, self.parallel)
        spec = auto_grammar(
            self.tools, self.parser, self.parallel, python_tag_token=self.python_tag_token
        )
        return StructuredOutput(kind="grammar", spec=spec)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """``(content, calls)`` of a finished choice's text (no calls: the text unchanged).
        Only calls of declared tools come back (:attr:`names`); a hermes call of another name
        stays in the content, and a llama3_json reply naming one is content as a whole."""
        if self.mode == "named":
            return None, [Call(self.named or "", text)]
        if self.mode == "required":
            return _parse_required(text, self.names)
        parse = _parse_hermes if self.parser == "hermes" else _parse_llama3
        content, calls = parse(text, self.names)
        if not self.parallel:
            calls = calls[:1]
        return content, calls


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _parse_required(text: str, names: frozenset[str]) -> tuple[str | None, list[Call]]:
    try:
        items = json.loads(text)
    except ValueError:
        return text, []  # cut off by max_tokens: the text stays content
    if not isinstance(items, list):
        return text, []
    calls = [_call_of(item, "parameters", names) for item in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, [c for c in calls if c is not None]


def _call_of(obj: Any, arguments_key: str, names: frozenset[str]) -> Call | None:
    """The call ``obj`` is, when it is one of a declared tool (``names``); else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return Call(obj["name"], _arguments(args))


def _parse_hermes(text: str, names: frozenset[str]) -> tuple[str | None, list[Call]]:
    calls: list[Call] = []
    kept: list[str] = []
    pos = 0
    for match in re.finditer(
        re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), text, re.DOTALL
    ):
        try:
            call = _call_of(json.loads(match.group(1).strip()), "arguments", names)
        except ValueError:
            call = None
        if call is None:
            continue  # not a well-formed call of a declared tool: it stays in the content
        kept.append(text[pos : match.start()])
        pos = match.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return content or None, calls


def _parse_llama3(text: str, names: frozenset[str]) -> tuple[str | None, list[Call]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return text, []
    calls: list[Call] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_of(obj, "parameters", names)
        if call is None:
            return text, []  # not all calls of declared tools: the reply is text
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


# --- the prompt ------------------------------------------------------------------------------


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template uses the ``tools`` it is given."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the tool-use one counts
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def is_special_token(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` is one special token of ``tokenizer`` (an added token marked special,
    such as Llama 3's ``<|python_tag|>``): llguidance then matches it as a token, never as
    text, and the detokenized reply leaves it out."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return any(t.content == text and t.special for t in added.values())


def default_tool_prompt(tools: tuple[dict[str, Any], ...]) -> str:
    """pdserve's system text for a chat template that cannot render tools: the tools as JSON
    lines and how to call them (the Hermes format, which the ``hermes`` parser reads)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer. The functions, one JSON object per line:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, reply with a JSON object naming it and giving its arguments, between "
        f"{HERMES_OPEN} and {HERMES_CLOSE} tags, one pair of tags per call:\n"
        f'{HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{...}}}}\n{HERMES_CLOSE}'
    )


def prompt_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, template_has_tools: bool
) -> list[dict[str, Any]]:
    """The messages for the chat template. ``messages`` carry ``tool_calls`` (OpenAI form,
    ``arguments`` as JSON text) and ``tool`` results. A template that renders tools gets the
    calls with their arguments decoded (the Hugging Face convention); otherwise calls become
    Hermes-tagged text in the assistant's content, results are wrapped in
    ``<tool_response>`` tags, and the tools go into the system message
    (:func:`default_tool_prompt`). Raises InvalidRequestError for arguments that are not JSON."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if template_has_tools:
            if calls:
                m["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.get("id"),
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _decoded(c["function"]["arguments"], i, j),
                        },
                    }
                    for j, c in enumerate(calls)
                ]
        else:
            tagged = [
                f"{HERMES_OPEN}\n"
                + json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _decoded(c["function"]["arguments"], i, j),
                    },
                    ensure_ascii=False,
                )
                + f"\n{HERMES_CLOSE}"
                for j, c in enumerate(calls)
            ]
            if tagged:
                m["content"] = "\n".join([m["content"], *tagged] if m["content"] else tagged)
            if m["role"] == "tool":
                m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if plan is not None and not template_has_tools:
        prompt = default_tool_prompt(plan.tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _decoded(arguments: str, i: int, j: int) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        raise InvalidRequestError(
            "tool call arguments must be JSON text",
            param=f"messages[{i}].tool_calls[{j}].function.arguments",
        ) from None


# --- streaming -------------------------------------------------------------------------------


@dataclass
class StreamDelta:
    """What one stream chunk of a choice carries: content, or one call's id + name, or a
    piece of one call's arguments (``index``: the call's position in the choice)."""

    content: str | None = None
    index: int | None = None
    call: Call | None = None  # id + name (arguments empty)
    arguments: str | None = None


class ToolStream:
    """One choice's stream under a :class:`ToolPlan`: :meth:`feed` each text delta, then
    :meth:`finish`; both return the deltas to send now. ``calls``: how many calls were sent."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls = 0
        self._buffer = ""
        self._inside = False
        self._held = plan.mode == "required"  # the whole array is parsed at the end
        self._json_call = False  # llama3_json: the reply opened with a call

    def feed(self, text: str) -> list[StreamDelta]:
        plan = self.plan
        if plan.mode == "named":
            out = []
            if self.calls == 0:
                self.calls = 1
                out.append(StreamDelta(index=0, call=Call(plan.named or "", "")))
            if text:
                out.append(StreamDelta(index=0, arguments=text))
            return out
        self._buffer += text
        if self._held or self._json_call:
            return []
        if plan.parser == "llama3_json":
            head = self._buffer.lstrip()
            if not head:
                return []
            if head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
                self._json_call = True
                return []
            out_text, self._buffer = self._buffer, ""
            return [StreamDelta(content=out_text)]
        return self._hermes()

    def _hermes(self) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        while self._buffer:
            if self._inside:
                end = self._buffer.find(HERMES_CLOSE)
                if end < 0:
                    return out
                block = self._buffer[: end + len(HERMES_CLOSE)]
                self._buffer = self._buffer[end + len(HERMES_CLOSE) :]
                self._inside = False
                _, calls = _parse_hermes(HERMES_OPEN + block, self.plan.names)
                if not (calls and self._may_add()):
                    if not calls:
                        out.append(StreamDelta(content=HERMES_OPEN + block))
                    continue
                out.extend(self._call(calls[0]))
                continue
            start = self._buffer.find(HERMES_OPEN)
            if start >= 0:
                if start:
                    out.append(StreamDelta(content=self._buffer[:start]))
                self._buffer = self._buffer[start + len(HERMES_OPEN) :]
                self._inside = True
                continue
            keep = _partial_suffix(self._buffer, HERMES_OPEN)
            if len(self._buffer) > keep:
                out.append(StreamDelta(content=self._buffer[: len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep :]
            return out
        return out

    def _may_add(self) -> bool:
        return self.plan.parallel or self.calls == 0

    def _call(self, call: Call) -> list[StreamDelta]:
        index = self.calls
        self.calls += 1
        return [
            StreamDelta(index=index, call=Call(call.name, "", call.id)),
            StreamDelta(index=index, arguments=call.arguments),
        ]

    def finish(self) -> list[StreamDelta]:
        """The deltas still held when the choice ends (a call cut off stays content)."""
        if self.plan.mode == "named":
            return self.feed("") if self.calls == 0 else []
        text, self._buffer = self._buffer, ""
        if self._inside:
            text, self._inside = HERMES_OPEN + text, False
        if not text:
            return []
        if self._held or self._json_call:
            content, calls = self.plan.parse(text)
            out = [d for c in calls for d in self._call(c)]
            return out if out else [StreamDelta(content=content)]
        return [StreamDelta(content=text)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
