"""What the router answers with: the OpenAI response objects of ``/v1/chat/completions`` and
``/v1/completions`` (whole and as stream chunks), ``/v1/models``, ``/health`` and ``/ready``.

Plain pydantic models; the server dumps them with ``model_dump(mode="json")``. The request
models are :mod:`pdserve.server.chat.schemas`'.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served by the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    """With ``echo``, the prompt's tokens come first; the first has no logprob (None)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt logprob entry (keyed by token id)."""

    logprob: float
    decoded_token: str


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None, description="with prompt_logprobs (vLLM's): one entry per prompt token"
    )


class CompletionResponse(BaseModel):
    """Also the stream chunk of ``/v1/completions`` (``usage`` None except in the usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """``GET /health``."""

    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """``GET /ready``: the usable workers by role, the paths that can serve a request now
    (``disaggregated``, ``local_prefill``, ``colocated``); ``missing`` (only when not ready)
    says what is lacking, ``notes`` (only when there are some) what a ready deployment lacks."""

    status: Literal["ready", "not_ready"]
    model: str
    prefill: list[str]
    decode: list[str]
    colocated: list[str] = []
    paths: list[str] = []
    missing: list[str] | None = None
    notes: list[str] | None = None
