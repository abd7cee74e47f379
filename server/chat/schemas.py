"""OpenAI-compatible request and response models for ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``.

Field constraints here check types and ranges, so a wrong value is a 400 naming the field
(``param``); the checks that need the tokenizer, the served model or the router's settings
(model name, context window, token ids, ``n`` against ``router.max_n``, the message count
against ``router.max_messages``) are in :mod:`pdserve.server.chat.preprocess`, the refusals of
unsupported fields in :mod:`pdserve.server.chat.sampling_fields`.

Bounds fixed here (module constants, documented in the OpenAPI schema): at most
:data:`MAX_STOP_SEQUENCES` stop strings of at most :data:`MAX_STOP_CHARS` characters each
(OpenAI's limit of 4), chat ``top_logprobs`` 0..20 and completions ``logprobs`` 0..5 (OpenAI's
ranges), ``seed`` any integer, ``temperature`` 0..2 (below
:data:`~pdserve.protocol.GREEDY_TEMPERATURE` greedy, as vLLM), ``top_p`` in (0, 1], finite
numbers only (``NaN``/``Infinity`` are refused). Every string is Unicode text (no lone
surrogate), and free-form JSON (tool ``parameters``, schemas, ``metadata``,
``chat_template_kwargs``, a call's ``arguments`` decoded) is so throughout and at most
:data:`~pdserve.server.chat.json_values.MAX_JSON_DEPTH` levels deep (:mod:`.json_values`).

Sampling beyond OpenAI's temperature/top_p: ``presence_penalty`` and ``frequency_penalty``
(-2..2), ``logit_bias`` (at most :data:`MAX_LOGIT_BIAS` token ids, biases -100..100), and
vLLM's extensions ``min_p``, ``min_tokens``, ``repetition_penalty`` (0.01..10, so no logit
overflows float32), ``stop_token_ids`` (at most :data:`MAX_STOP_TOKEN_IDS`) and ``ignore_eos``;
:class:`pdserve.protocol.SamplingParams` says how each is applied.

OpenAI fields pdserve does not implement are declared (so they are documented, and refused
rather than dropped): ``functions``, ``function_call``,
``response_format``, ``audio``, ``modalities``, ``reasoning_effort``,
``web_search_options``, ``echo``, ``suffix``, ``best_of``. A value that does
nothing (an empty list or map, ``"none"``, ``{"type": "text"}``, ``["text"]``, 0) is accepted;
any other is a 400 ``unsupported``
(:func:`pdserve.server.chat.sampling_fields.check_unsupported`).
Fields without effect on the output (``user``, ``store``, ``metadata``, ``service_tier``,
``parallel_tool_calls``, ``prediction``, ``stream_options`` without ``stream``) are accepted
and ignored. Other unknown fields are kept in ``model_extra``; the known extensions of other
servers that would change the output (:data:`EXTENSION_DEFAULTS`) are refused unless they
carry their default, anything else unknown is ignored.

With ``n`` choices a response lists ``n`` choices (``index`` 0..n-1); a stream's chunks carry
one choice each, the choices' chunks interleaved, each choice's ``index`` set.

The response objects are in :mod:`pdserve.server.rendering.replies`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from pdserve.protocol import (
    GREEDY_TEMPERATURE,
    MAX_CHOICES,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)
from pdserve.server.chat.json_values import (
    JSONObject,
    JSONText,
    JSONValue,
    Text,
    unicode_text,
)

MAX_STOP_SEQUENCES = 4
"""Most stop strings in one request (OpenAI's limit)."""

MAX_STOP_CHARS = 1024
"""Longest stop string, characters."""

MAX_TOP_LOGPROBS_CHAT = 20
"""Chat ``top_logprobs`` upper bound (OpenAI's)."""

MAX_LOGPROBS_COMPLETIONS = 5
"""Completions ``logprobs`` upper bound (OpenAI's)."""

MAX_MESSAGES = 16384
"""Most chat messages the schema takes, whatever ``router.max_messages`` says (it may not
exceed this): validation stops at the first item past it, so a body of tiny messages cannot
hold the event loop for a second."""


MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries in one request."""

MAX_STOP_TOKEN_IDS = 64
"""Most ``stop_token_ids`` in one request."""


EXTENSION_DEFAULTS: dict[str, Any] = {
    "length_penalty": 1,
    "use_beam_search": False,
    "bad_words": [],
    "allowed_token_ids": None,
    "prompt_logprobs": None,  # chat (completions declare it)
    "truncate_prompt_tokens": None,
    "chat_template": None,
}
"""Extension fields of other OpenAI-compatible servers (vLLM, SGLang) that change the output,
with the one value pdserve's behaviour matches; any other value is refused (``unsupported``)."""


_FAIL_FAST = Field(fail_fast=True)
"""On every list a client sends: validation stops at the first bad item, so a body of a
hundred thousand bad items costs one error, not one per item (and per union member), on the
event loop."""


class _Req(BaseModel):
    # strict: JSON types as JSON Schema has them ("5" is no integer, 1 no boolean), as OpenAI
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


def _accepts(schema: dict[str, Any]) -> WithJsonSchema:
    """Document only the values accepted (``schema`` or null); validation of the others is a
    400 ``unsupported`` in :mod:`pdserve.server.chat.preprocess`, not a type error."""
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}]})


_EMPTY_LIST = _accepts({"type": "array", "maxItems": 0})
_NULL_ONLY = WithJsonSchema({"type": "null"})
_NONE_OR_AUTO = _accepts({"enum": ["none", "auto"]})


class TextPart(_Req):
    """A content part. Only ``{"type": "text", "text": ...}`` is supported."""

    type: Annotated[Text, WithJsonSchema({"const": "text"})] = Field(
        description="only text (another type is a 400 unsupported)"
    )
    text: Text | None = None


FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"
MAX_TOOLS = 128
"""Most tools in one request."""


class CalledFunction(_Req):
    """An earlier call's function: its name and its arguments as JSON text."""

    name: str = Field(pattern=FUNCTION_NAME)
    arguments: JSONText = Field(description="JSON text")


class ToolCallIn(_Req):
    """An assistant message's earlier tool call."""

    id: str | None = Field(default=None, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Req):
    """One chat message. An assistant message may carry its earlier ``tool_calls``, and a
    ``tool`` message the result of one (``tool_call_id``); ``function_call`` (the deprecated
    form) is refused when set."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], _FAIL_FAST] | None = None
    name: Text | None = None
    tool_call_id: str | None = Field(
        default=None, max_length=128, description="the call a tool message answers"
    )
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS), _FAIL_FAST] | None = None
    function_call: Annotated[Any, _NULL_ONLY] = Field(
        default=None, description="not supported: refused unless null"
    )


class FunctionDef(_Req):
    """A tool's function: ``parameters`` is its arguments' JSON Schema."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = Field(default=None, description="the schema is enforced either way")


class ToolDef(_Req):
    """One tool (``tools[]``)."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Req):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Req):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Req):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool | None = False


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS), AfterValidator(unicode_text)]
_UNSUPPORTED = "not supported: refused (400 unsupported) unless "


def _token_bias(value: dict[str, float]) -> dict[str, float]:
    """``logit_bias``: keys are token ids written as decimal strings (OpenAI's form), biases in
    [-100, 100]. The ids' range is checked against the vocabulary in preprocessing."""
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ValueError(f"keys must be token ids (decimal strings); got {key[:20]!r}")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"biases must lie in [-100, 100]; got {bias} for token {key}")
    return value


LogitBias = Annotated[
    dict[str, float],
    Field(max_length=MAX_LOGIT_BIAS),
    AfterValidator(_token_bias),
    WithJsonSchema(
        {
            "type": "object",
            "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
]


class StructuredOutputs(_Req):
    """vLLM's ``structured_outputs`` extension: exactly one of ``json`` (a JSON Schema),
    ``json_object``, ``regex``, ``choice`` or ``grammar`` (Lark, or GBNF as vLLM's xgrammar
    backend takes). ``disable_any_whitespace`` (default true here, false in vLLM): JSON without
    whitespace between tokens."""

    json_: JSONObject | JSONText | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=1024), _FAIL_FAST] | None = None
    grammar: Text | None = None
    disable_any_whitespace: bool | None = None


class _SamplingFields(_Req):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Text
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0, description=f"below {GREEDY_TEMPERATURE:g}: greedy"
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        default=None, ge=-1, le=2**31 - 1, description="extension; 0 or -1 disable it"
    )
    seed: int | None = Field(
        default=None,
        description="any integer (hashed with the output position, so no range applies: the "
        "schema and the server agree on every integer a JSON parser reads)",
    )
    stop: (
        StopString
        | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES), _FAIL_FAST]
        | None
    ) = Field(
        default=None,
        description=f"up to {MAX_STOP_SEQUENCES} strings of at most {MAX_STOP_CHARS} characters",
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Annotated[
        int | None, _accepts({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES})
    ] = Field(default=None, description="choices; 1 to router.max_n (default 16)")
    presence_penalty: float | None = Field(
        default=None, ge=-2.0, le=2.0, description="subtracted once from each token in the output"
    )
    frequency_penalty: float | None = Field(
        default=None,
        ge=-2.0,
        le=2.0,
        description="subtracted from each token's logit once per time it is in the output",
    )
    logit_bias: LogitBias | None = Field(
        default=None,
        description=f"token id (as a string) -> bias in [-100, 100] added to its logit; at most "
        f"{MAX_LOGIT_BIAS} entries",
    )
    min_p: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="extension: drop tokens below min_p x the most likely one's probability",
    )
    min_tokens: int | None = Field(
        default=None, ge=0, description="extension: EOS and stop_token_ids masked until then"
    )
    repetition_penalty: float | None = Field(
        default=None,
        ge=MIN_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        description="extension: a seen token's (prompt or output) logit is divided by it when "
        "positive, multiplied when negative; 1 is off",
    )
    stop_token_ids: (
        Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS), _FAIL_FAST] | None
    ) = Field(default=None, description="extension: token ids that end the choice (not emitted)")
    ignore_eos: bool | None = Field(default=False, description="extension (benchmarks)")
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="extension (vLLM's): constrain the text to a schema or grammar"
    )
    guided_json: JSONObject | JSONText | None = Field(
        default=None, description="extension, vLLM's older name of structured_outputs.json"
    )
    guided_regex: Text | None = Field(
        default=None, description="extension, vLLM's older name of structured_outputs.regex"
    )
    guided_choice: (
        Annotated[list[Text], Field(min_length=1, max_length=1024), _FAIL_FAST] | None
    ) = Field(default=None, description="extension, vLLM's older structured_outputs.choice")
    guided_grammar: Text | None = Field(
        default=None, description="extension, vLLM's older name of structured_outputs.grammar"
    )
    cache_salt: Annotated[Text, Field(min_length=1, max_length=256)] | None = Field(
        default=None,
        description="extension (vLLM's): the prompt reuses cached KV blocks only of requests "
        "with the same salt (and, when API keys name tenants, of the same tenant)",
    )
    priority: int = Field(
        default=0,
        ge=-(2**31),
        le=2**31 - 1,
        description="extension (vLLM's): the request's place among its tenant's requests in "
        "the router's fair queue and the workers' prefill schedulers, lower first (used only "
        "when the fair queue is on)",
    )
    user: Text | None = Field(
        default=None,
        description="an end-user id; the session id of session affinity with "
        "router.session_from_user (else unused)",
    )


class JSONSchemaFormat(_Req):
    """``response_format.json_schema``: the schema is enforced whether or not ``strict``."""

    name: str = Field(max_length=64)
    description: Text | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Req):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (``json_schema.schema``; compact JSON)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


_TEXT_ONLY = {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], _FAIL_FAST] = Field(
        max_length=MAX_MESSAGES,
        description=f"at least 1, at most router.max_messages (default 2048, at most "
        f"{MAX_MESSAGES})",
        json_schema_extra={"minItems": 1},
    )
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS_CHAT,
        description="only with logprobs=true",
    )
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS), _FAIL_FAST] | None = Field(
        default=None, description=f"functions the model may call (at most {MAX_TOOLS})"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="none, auto (the default with tools: the model chooses; its text is "
        "parsed by router.tool_call_parser), required (at least one call, constrained to the "
        "tools' schemas) or a named function (one call to it, constrained to its schema)",
    )
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: at most one call per choice"
    )
    functions: Annotated[Any, _EMPTY_LIST] = Field(default=None, description=_UNSUPPORTED + "empty")
    function_call: Annotated[Any, _NONE_OR_AUTO] = Field(
        default=None, description=_UNSUPPORTED + '"none" or "auto"'
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        description="text, json_object or json_schema (structured outputs, enforced by a "
        "grammar on every token)",
    )
    audio: Annotated[Any, _NULL_ONLY] = Field(default=None, description=_UNSUPPORTED + "null")
    modalities: Annotated[Any, _accepts(_TEXT_ONLY)] = Field(
        default=None, description=_UNSUPPORTED + '["text"]'
    )
    reasoning_effort: Annotated[Any, _NULL_ONLY] = Field(
        default=None, description=_UNSUPPORTED + "null"
    )
    web_search_options: Annotated[Any, _NULL_ONLY] = Field(
        default=None, description=_UNSUPPORTED + "null"
    )
    chat_template_kwargs: JSONObject | None = Field(
        default=None,
        description="extension: more variables for the chat template (e.g. enable_thinking)",
    )
    add_generation_prompt: bool | None = Field(
        default=None,
        description="extension: end the prompt with the assistant's turn (default true)",
    )
    continue_final_message: bool | None = Field(
        default=None,
        description="extension: continue the last (assistant) message instead of starting a new "
        "one; needs add_generation_prompt false",
    )
    prediction: JSONValue = Field(default=None, description="accepted, ignored (latency hint only)")
    store: bool | None = Field(default=None, description="accepted, unused")
    metadata: JSONObject | None = Field(default=None, description="accepted, unused")
    service_tier: Text | None = Field(default=None, description="accepted, unused")


MAX_PROMPTS = 64
"""Most prompts in one ``/v1/completions`` request (each runs as its own transaction)."""

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            _TOKEN_IDS,
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
             "maxItems": MAX_PROMPTS},
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
        ]
    }
)  # fmt: skip


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: Annotated[
        Text
        | Annotated[list[int], _FAIL_FAST]
        | Annotated[list[Text], _FAIL_FAST]
        | Annotated[list[Annotated[list[int], _FAIL_FAST]], _FAIL_FAST],
        _PROMPT,
    ] = Field(
        description=f"a string or token ids, or a list of up to {MAX_PROMPTS} of either: each "
        "prompt gets n choices, listed prompt by prompt (choice index = prompt index x n + i)"
    )
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS_COMPLETIONS)
    echo: bool | None = Field(
        default=False,
        description="each choice's text starts with its prompt; with logprobs, the logprobs "
        "start with the prompt's (the first token's is null)",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS_CHAT,
        description="extension (vLLM's): each choice carries the prompt tokens' logprobs with "
        "this many alternatives (the prompt is computed whole: no prefix-cache reuse)",
    )
    best_of: Annotated[int | None, _accepts({"type": "integer", "minimum": 1})] = Field(
        default=None, description=_UNSUPPORTED + "equal to n"
    )
    suffix: Annotated[Text | None, _accepts({"type": "string", "maxLength": 0})] = Field(
        default=None, description=_UNSUPPORTED + "empty"
    )


class TokenizeRequest(_Req):
    """``POST /tokenize`` (vLLM's): exactly one of ``prompt`` (text) or ``messages`` (through the
    chat template, with ``tools`` and the template options of a chat request)."""

    model: Text
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], _FAIL_FAST] | None = Field(
        default=None, max_length=MAX_MESSAGES
    )
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS), _FAIL_FAST] | None = None
    chat_template_kwargs: JSONObject | None = None
    add_generation_prompt: bool | None = Field(
        default=None, description="messages only; default true"
    )
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = Field(
        default=None,
        description="add the tokenizer's special tokens (BOS); default true for a prompt, false "
        "for messages (the template writes them)",
    )
    return_token_strs: bool | None = Field(default=False, description="also each token's text")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Req):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: Text
    tokens: Annotated[list[int], _FAIL_FAST]


class DetokenizeResponse(BaseModel):
    prompt: str
