"""A Responses request (:class:`~pdserve.server.responses.schemas.ResponsesRequest`) mapped
onto the chat completion request that serves it, and errors mapped back.

:func:`to_chat`: ``instructions`` becomes a system message first; ``input`` (a string: one user
message) the messages, item by item: a message keeps its role and text (``input_text`` and
``output_text`` parts become chat's text parts, joined as chat joins them), ``function_call``
items become the ``tool_calls`` of an assistant message (the calls of one turn, and the
assistant message just before them, share it), a ``function_call_output`` a ``tool`` message
answering ``call_id``; ``max_output_tokens`` becomes ``max_tokens``, the flat function tools
chat's ``{"type": "function", "function": {...}}``, ``tool_choice`` ``{"type": "function",
"name"}`` chat's named choice, ``text.format`` ``response_format``. Refused first (400
``unsupported`` naming the field, :func:`check_unsupported`): what needs stored state
(``store: true``, ``previous_response_id``, ``conversation``, ``prompt``), ``background: true``,
a non-empty ``include``, ``reasoning``, an input item, content part or tool of another type.

:func:`public_error`: an error raised for the chat request names the Responses field instead
(``max_tokens`` -> ``max_output_tokens``, ``messages`` -> ``input``, ``messages[3].content`` ->
``input[2].content`` by :class:`Origins`, a call's ``arguments`` -> its ``function_call`` item,
``response_format...`` -> ``text.format...``, ``tools[0].function.name`` -> ``tools[0].name``),
in its ``param`` and in its message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pdserve.errors import InvalidRequestError, PdserveError, UnsupportedFieldError
from pdserve.http.error_responses import validation_error
from pdserve.server.chat.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from pdserve.server.chat.schemas import ChatCompletionRequest
from pdserve.server.responses.schemas import (
    INPUT_ITEM_TYPES,
    PART_TYPES,
    ContentPart,
    FunctionToolChoice,
    ResponsesRequest,
)

NOTHING_STORED = "storing responses is not supported yet; send the whole conversation as input"


def check_unsupported(req: ResponsesRequest) -> None:
    """Refuse (400 ``unsupported`` naming the field) what would need stored state or another
    feature pdserve lacks; :mod:`.responses_schemas` lists the values accepted."""
    if req.store:
        raise UnsupportedFieldError(
            f"store: true is not supported: {NOTHING_STORED}", param="store"
        )
    for name in ("previous_response_id", "conversation", "prompt"):
        if getattr(req, name) is not None:
            raise UnsupportedFieldError(f"{name} is not supported: {NOTHING_STORED}", param=name)
    if req.background:
        raise UnsupportedFieldError("background: true is not supported", param="background")
    if req.include not in (None, []):
        raise UnsupportedFieldError("include is not supported (only empty)", param="include")
    if req.reasoning is not None:
        raise UnsupportedFieldError("reasoning is not supported (only null)", param="reasoning")


@dataclass
class Origins:
    """Where each chat message came from, to name Responses fields in errors: per message its
    item's path and its content's path; per ``(message, call)`` the ``function_call`` item."""

    items: list[str] = field(default_factory=list)
    contents: list[str] = field(default_factory=list)
    calls: dict[tuple[int, int], str] = field(default_factory=dict)


def _need(value: Any, param: str, what: str) -> Any:
    if value is None:
        raise InvalidRequestError(f"{param} is required {what}", param=param)
    return value


def _parts(content: str | list[ContentPart], param: str) -> str | list[dict[str, Any]]:
    """Content as chat takes it (text parts); another part type is refused."""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if part.type not in PART_TYPES:
            raise UnsupportedFieldError(
                f"content part type {part.type!r} is not supported (only input_text and "
                "output_text)",
                param=f"{param}[{j}].type",
            )
        out.append(
            {"type": "text", "text": _need(part.text, f"{param}[{j}].text", "on a text part")}
        )
    return out


def _messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], Origins]:
    messages: list[dict[str, Any]] = []
    origins = Origins()

    def add(message: dict[str, Any], item: str, content: str) -> None:
        messages.append(message)
        origins.items.append(item)
        origins.contents.append(content)

    if req.instructions is not None:
        add({"role": "system", "content": req.instructions}, "instructions", "instructions")
    if isinstance(req.input, str):
        add({"role": "user", "content": req.input}, "input", "input")
        return messages, origins
    for i, item in enumerate(req.input):
        path = f"input[{i}]"
        kind = item.type or "message"
        if kind not in INPUT_ITEM_TYPES:
            raise UnsupportedFieldError(
                f"input item type {kind!r} is not supported (only message, function_call, "
                "function_call_output)",
                param=f"{path}.type",
            )
        if kind == "message":
            role = _need(item.role, f"{path}.role", "on a message")
            content = _parts(
                _need(item.content, f"{path}.content", "on a message"), f"{path}.content"
            )
            add({"role": role, "content": content}, path, f"{path}.content")
        elif kind == "function_call":
            call = {
                "id": _need(item.call_id, f"{path}.call_id", "on a function_call"),
                "type": "function",
                "function": {
                    "name": _need(item.name, f"{path}.name", "on a function_call"),
                    "arguments": _need(item.arguments, f"{path}.arguments", "on a function_call"),
                },
            }
            last = messages[-1] if messages and origins.items[-1] != "instructions" else None
            if last is None or last["role"] != "assistant":  # calls of one turn share a message
                add({"role": "assistant", "content": None}, path, f"{path}.content")
                last = messages[-1]
            calls = last.setdefault("tool_calls", [])
            origins.calls[(len(messages) - 1, len(calls))] = path
            calls.append(call)
        else:
            call_id = _need(item.call_id, f"{path}.call_id", "on a function_call_output")
            output = _need(item.output, f"{path}.output", "on a function_call_output")
            message = {"role": "tool", "tool_call_id": call_id}
            add({**message, "content": _parts(output, f"{path}.output")}, path, f"{path}.output")
    return messages, origins


def to_chat(req: ResponsesRequest) -> tuple[ChatCompletionRequest, Origins]:
    """The chat request that serves ``req``, and where its messages came from. Raises a typed
    error naming the Responses field (an unsupported item, a missing field)."""
    check_unsupported(req)
    messages, origins = _messages(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "user": req.user,
    }
    if req.tools is not None:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.type != "function":
                raise UnsupportedFieldError(
                    f"tool type {tool.type!r} is not supported (only function)",
                    param=f"tools[{i}].type",
                )
            _need(tool.name, f"tools[{i}].name", "on a function tool")
            fn = tool.model_dump(mode="json", exclude={"type"}, exclude_none=True)
            tools.append({"type": "function", "function": fn})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, FunctionToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema = {
            "name": _need(fmt.name, "text.format.name", "with json_schema"),
            "schema": _need(fmt.schema_, "text.format.schema", "with json_schema"),
            "description": fmt.description,
            "strict": fmt.strict,
        }
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    body = {k: v for k, v in body.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(body), origins
    except ValidationError as exc:
        raise public_error(validation_error(exc.errors()), origins) from None


_MESSAGE_PARAM = re.compile(
    r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](\.function\.arguments)?)?(\.content)?"
)
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function(\..*)?")
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("the messages take", "the input takes"),
    ("the messages", "the input"),
)


def _param(param: str, origins: Origins) -> str:
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param == "messages":
        return "input"
    if param.startswith("response_format"):
        return "text.format.schema" if param.endswith(".schema") else "text.format"
    if m := _TOOL_PARAM.fullmatch(param):
        return f"tools[{m[1]}]{m[2] or ''}"
    if (m := _MESSAGE_PARAM.match(param)) and int(m[1]) < len(origins.items):
        i = int(m[1])
        if m[2] is not None:
            call = origins.calls.get((i, int(m[2])), origins.items[i])
            return call + (".arguments" if m[3] else "")
        return origins.contents[i] if m[4] else origins.items[i]
    return param


def public_error(exc: PdserveError, origins: Origins) -> PdserveError:
    """``exc`` (raised for the chat request) naming the Responses request's fields instead:
    its ``param`` and the chat field names in its message."""
    if exc.param is not None:
        exc.param = _param(exc.param, origins)
    for old, new in _RENAMES:
        exc.message = exc.message.replace(old, new)
    exc.args = (exc.message,)
    return exc


def echo_fields(
    req: ResponsesRequest, defaults: SamplingDefaults = OPENAI_DEFAULTS
) -> dict[str, Any]:
    """The request's settings a response object repeats (the effective values: temperature
    and top_p default to the model's ``defaults``, tool_choice to auto, parallel_tool_calls to
    true)."""
    fmt = req.text.format if req.text is not None else None
    choice = req.tool_choice or "auto"
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": defaults.temperature if req.temperature is None else req.temperature,
        "top_p": defaults.top_p if req.top_p is None else req.top_p,
        "tools": [t.model_dump(mode="json", by_alias=True) for t in req.tools or ()],
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(mode="json"),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {
            "format": (
                fmt.model_dump(mode="json", by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            )
        },
        "metadata": req.metadata or {},
        "user": req.user,
    }
