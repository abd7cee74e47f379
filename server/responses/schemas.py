"""Request and response models of the stateless OpenAI Responses API (``POST /v1/responses``).

The request is validated here for types and ranges (a wrong value is a 400 naming the field, as
in :mod:`pdserve.server.chat.schemas`, whose conventions apply: strict JSON types, :data:`Text` for
text the model reads, ``_FAIL_FAST`` on every list, bounded sizes). Everything else is checked
after the request is mapped onto a chat completion
(:func:`pdserve.server.responses.chat_mapping.to_chat`): the model name, the context window, the
tools, the structured output.

Input items are one flat model (:class:`InputItem`): ``type`` selects which fields an item
needs (a message: ``role`` + ``content``; ``function_call``: ``call_id``, ``name``,
``arguments``; ``function_call_output``: ``call_id``, ``output``), and the mapping refuses an
item type or content part type other than those (images, files, reasoning, ...) with a 400
``unsupported`` whose ``param`` is the field's path (``input[2].content[0].type``). Tools are
Responses' flat function form (``{"type": "function", "name", "parameters", ...}``).

Declared so they are documented and refused rather than dropped (400 ``unsupported`` unless
the value that does nothing): ``store`` (false; OpenAI's default is true, an absent ``store``
is taken as false here), ``previous_response_id``, ``conversation`` and ``prompt`` (null:
nothing is stored server-side), ``background`` (false), ``include`` (empty), ``reasoning``
(null). Accepted, without effect on the output: ``metadata`` (echoed), ``user``. Other unknown
fields are ignored.

The response models (:class:`ResponseObject` and its output items) describe what the route
returns; the renderer dumps them with ``model_dump(mode="json")``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from pdserve.server.chat.json_values import JSONObject, JSONText, Text
from pdserve.server.chat.schemas import (
    _FAIL_FAST,
    FUNCTION_NAME,
    MAX_MESSAGES,
    MAX_TOOLS,
    _accepts,
    _Req,
)

MAX_METADATA = 16
"""Most ``metadata`` entries (OpenAI's limit), keys of at most 64 characters, values 512."""

MAX_PARTS = 1024
"""Most content parts in one input message (or one function call output)."""

_NULL_ONLY = WithJsonSchema({"type": "null"})
_UNSUPPORTED = "not supported: refused (400 unsupported) unless "
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text")


class ContentPart(_Req):
    """A content part: ``input_text`` or ``output_text`` (an earlier reply passed back); any
    other type (``input_image``, ``input_file``, ...) is a 400 unsupported naming it."""

    type: Annotated[Text, WithJsonSchema({"enum": list(PART_TYPES)})] = Field(
        description="input_text or output_text (another type is a 400 unsupported)"
    )
    text: Text | None = Field(default=None, description="required")


Content = Text | Annotated[list[ContentPart], Field(max_length=MAX_PARTS), _FAIL_FAST]


class InputItem(_Req):
    """One input item. A message (``type`` ``message`` or absent) needs ``role`` and
    ``content``; a ``function_call`` (an earlier call of the model) ``call_id``, ``name`` and
    ``arguments`` (JSON text); a ``function_call_output`` (its result) ``call_id`` and
    ``output``. Other item types are a 400 unsupported naming ``input[i].type``."""

    type: Annotated[
        Text | None, WithJsonSchema({"anyOf": [{"enum": list(INPUT_ITEM_TYPES)}, {"type": "null"}]})
    ] = Field(
        default=None, description="message (the default), function_call or function_call_output"
    )
    role: Literal["user", "system", "developer", "assistant"] | None = Field(
        default=None, description="a message's author"
    )
    content: Content | None = Field(default=None, description="a message's text, or its parts")
    call_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="the call (function_call, function_call_output)",
    )
    name: str | None = Field(default=None, pattern=FUNCTION_NAME, description="function_call")
    arguments: JSONText | None = Field(default=None, description="function_call: JSON text")
    output: Content | None = Field(default=None, description="function_call_output: the result")


class FunctionTool(_Req):
    """A tool in Responses' flat form. Only ``function`` tools; another type (``web_search``,
    ``file_search``, ``mcp``, ...) is a 400 unsupported naming ``tools[i].type``."""

    model_config = ConfigDict(json_schema_extra={"required": ["type", "name"]})

    type: Annotated[Text, WithJsonSchema({"const": "function"})] = Field(
        description="function (another type is a 400 unsupported)"
    )
    name: str | None = Field(default=None, pattern=FUNCTION_NAME, description="required")
    description: Text | None = None
    parameters: JSONObject | None = Field(default=None, description="the arguments' JSON Schema")
    strict: bool | None = Field(default=None, description="the schema is enforced either way")


class FunctionToolChoice(_Req):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormat(_Req):
    """``text.format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (``name`` and ``schema`` required; the schema is enforced whether or not
    ``strict``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64, description="json_schema: required")
    description: Text | None = None
    schema_: JSONObject | None = Field(
        default=None, alias="schema", description="json_schema: required"
    )
    strict: bool | None = None


class TextConfig(_Req):
    """``text``: the output's ``format`` (other keys, ``verbosity``, are ignored)."""

    format: TextFormat | None = None


MetadataKey = Annotated[Text, Field(max_length=64)]
MetadataValue = Annotated[Text, Field(max_length=512)]


class ResponsesRequest(_Req):
    """``POST /v1/responses`` (stateless: nothing is stored)."""

    model: Text
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES), _FAIL_FAST] = Field(
        description=f"a string (one user message) or a list of input items (at most "
        f"router.max_messages messages, at most {MAX_MESSAGES} items)"
    )
    instructions: Text | None = Field(default=None, description="a system message, first")
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS), _FAIL_FAST] | None = Field(
        default=None, description=f"functions the model may call (at most {MAX_TOOLS})"
    )
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        default=None,
        description="none, auto (the default with tools), required, or "
        '{"type": "function", "name": ...}',
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call")
    text: TextConfig | None = Field(
        default=None, description="format: text, json_object or json_schema (structured outputs)"
    )
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = (
        Field(default=None, description="accepted and echoed, unused")
    )
    user: Text | None = Field(
        default=None,
        description="an end-user id, echoed; the session id of session affinity with "
        "router.session_from_user",
    )
    store: Annotated[bool | None, _accepts({"const": False})] = Field(
        default=None, description=_UNSUPPORTED + "false or absent (nothing is stored)"
    )
    previous_response_id: Annotated[Any, _NULL_ONLY] = Field(
        default=None, description=_UNSUPPORTED + "null (nothing is stored)"
    )
    conversation: Annotated[Any, _NULL_ONLY] = Field(
        default=None, description=_UNSUPPORTED + "null (nothing is stored)"
    )
    prompt: Annotated[Any, _NULL_ONLY] = Field(
        default=None, description=_UNSUPPORTED + "null (no stored prompts)"
    )
    background: Annotated[bool | None, _accepts({"const": False})] = Field(
        default=None, description=_UNSUPPORTED + "false"
    )
    include: Annotated[Any, _accepts({"type": "array", "maxItems": 0})] = Field(
        default=None, description=_UNSUPPORTED + "empty"
    )
    reasoning: Annotated[Any, _NULL_ONLY] = Field(default=None, description=_UNSUPPORTED + "null")


# --- responses ---------------------------------------------------------------------------------


ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served by the prefix cache")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(BaseModel):
    """A failed response's error (``response.failed``): OpenAI's ``server_error`` or
    ``rate_limit_exceeded``, with the public message."""

    code: str
    message: str


class ResponseObject(BaseModel):
    """A response (``object: "response"``): the output items, the usage, and the request's
    settings echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    background: bool = False
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]
