"""Router events -> OpenAI responses and stream chunks, for chat and for completions.

One renderer object per request. Streaming: ``start()`` (chat only: one role chunk per
choice), one ``chunk(event)`` per :class:`~pdserve.router.request.TokenEvent`, then
``usage_chunk()`` when ``stream_options.include_usage`` asked for it. Not streaming:
``add(event)`` for every event, then ``response()``. Both paths count completion tokens for
``usage``, summed over all choices.

Choices: a request asks for ``RequestInfo.n`` of them. Every event names its choice
(``TokenEvent.index``); a stream chunk carries that one choice (``choices[0].index``), and a
whole response lists every choice in index order, each with its own text, logprobs and finish
reason.

Logprobs: natural-log probabilities from the workers' :class:`TokenLogprob`, token strings and
bytes from :class:`~pdserve.server.rendering.logprobs.TokenRenderer`. Chat reports
``choices[].logprobs.content[]`` (token, logprob, bytes, top_logprobs); completions report
``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob) and ``text_offset`` (the
character offset of each token in its choice's completion text).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from pdserve.protocol import TokenLogprob
from pdserve.router.request import TokenEvent
from pdserve.server.chat.tool_calls import StreamDelta, ToolPlan, ToolStream
from pdserve.server.rendering.logprobs import TokenRenderer
from pdserve.server.rendering.replies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FunctionCallDelta,
    PromptLogprob,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)


@dataclass
class RequestInfo:
    """What every response of one request repeats. ``n``: choices asked for."""

    response_id: str
    model: str
    prompt_tokens: int
    logprobs: bool = False
    include_usage: bool = False
    n: int = 1
    prompts: int = 1  # a completion of several prompts: n // prompts choices each
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Choice:
    """What one choice has produced so far."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0  # characters of text reported so far (completions' text_offset)

    @property
    def text(self) -> str:
        return "".join(self.texts)


class _Renderer:
    def __init__(self, info: RequestInfo, tokens: TokenRenderer) -> None:
        self.info = info
        self.tokens = tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.per_prompt = max(1, info.n // info.prompts)
        self.choices = [_Choice() for _ in range(info.n)]
        self._template: dict[str, Any] | None = None  # a plain text chunk (_plain_chunk)

    def add(self, event: TokenEvent) -> None:
        """Account for one event (both paths call this)."""
        choice = self.choices[event.index]
        self.completion_tokens += len(event.token_ids)
        if event.cached_tokens is not None and event.index % self.per_prompt == 0:
            self.cached_tokens += event.cached_tokens  # each prompt's first choice
        choice.texts.append(event.text)
        if self.info.logprobs:
            choice.logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            choice.finish_reason = str(event.finish_reason)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.info.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.info.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def _dump_chunk(self, model: BaseModel) -> dict[str, Any]:
        out = model.model_dump(mode="json")
        if not self.info.include_usage:
            out.pop("usage", None)
        return out

    def _plain_chunk(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        """The stream chunk of choice ``index``'s next ``text`` without logprobs (and without
        role, tool calls or echo): what the models render, filled into a copy of this
        request's first such chunk (its keys, in its order; built through the models once) instead
        of building and dumping two models per token. Its choice's text is under ``delta``'s
        ``content`` (chat) or under ``text`` (completions): :meth:`_template_chunk` says."""
        if self._template is None:
            self._template = self._template_chunk()
        t = self._template
        choice = dict(t["choices"][0])
        choice["index"], choice["finish_reason"] = index, finish
        if "delta" in choice:
            choice["delta"] = {**choice["delta"], "content": text}
        else:
            choice["text"] = text
        return {**t, "choices": [choice]}

    def _template_chunk(self) -> dict[str, Any]:
        """A plain text chunk of choice 0, rendered through the models."""
        raise NotImplementedError


class ChatRenderer(_Renderer):
    """Chat responses and chunks; with a :class:`~pdserve.server.chat.tool_calls.ToolPlan` each choice's
    text is read for tool calls (:mod:`pdserve.server.chat.tool_calls`)."""

    def __init__(self, info: RequestInfo, tokens: TokenRenderer, tools: ToolPlan | None = None):
        super().__init__(info, tokens)
        self.tools = tools
        self._streams = [ToolStream(tools) for _ in range(info.n)] if tools else []

    def chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        """The stream chunks of ``event``: one, or with tools as many as the parsed deltas
        (none while text that may open a call is held back)."""
        if self.tools is None:
            return [self.chunk(event)]
        self.add(event)
        stream = self._streams[event.index]
        deltas = stream.feed(event.text)
        finish = str(event.finish_reason) if event.finish_reason is not None else None
        if finish is not None:
            deltas += stream.finish()
            if finish == "stop" and stream.calls:
                finish = "tool_calls"
        out = [self._tool_chunk(event.index, d) for d in deltas]
        if finish is not None:
            if out:
                out[-1]["choices"][0]["finish_reason"] = finish
            else:
                out.append(self._chunk(event.index, DeltaMessage(), None, finish))
        return out

    def _tool_chunk(self, index: int, d: StreamDelta) -> dict[str, Any]:
        if d.index is None:
            return self._chunk(index, DeltaMessage(content=d.content), None, None)
        if d.call is not None:
            call = ToolCallDelta(
                index=d.index,
                id=d.call.id,
                type="function",
                function=FunctionCallDelta(name=d.call.name, arguments=""),
            )
        else:
            call = ToolCallDelta(index=d.index, function=FunctionCallDelta(arguments=d.arguments))
        out = self._chunk(index, DeltaMessage(tool_calls=[call]), None, None)
        delta = out["choices"][0]["delta"]
        delta.pop("content", None)
        delta["tool_calls"] = [call.model_dump(mode="json", exclude_none=True)]
        return out

    def _chat_logprobs(self, items: list[TokenLogprob]) -> ChatLogprobs | None:
        if not self.info.logprobs:
            return None
        t = self.tokens
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=t.text(lp.token_id),
                    logprob=lp.logprob,
                    bytes=t.bytes(lp.token_id),
                    top_logprobs=[
                        TopLogprob(token=t.text(tid), logprob=v, bytes=t.bytes(tid))
                        for tid, v in lp.top
                    ],
                )
                for lp in items
            ]
        )

    def start(self) -> list[dict[str, Any]]:
        """The first stream chunks: per choice, the assistant role and no content yet."""
        return [
            self._chunk(i, DeltaMessage(role="assistant", content=""), None, None)
            for i in range(self.info.n)
        ]

    def chunk(self, event: TokenEvent) -> dict[str, Any]:
        self.add(event)
        finish = str(event.finish_reason) if event.finish_reason is not None else None
        if not self.info.logprobs:
            return self._plain_chunk(event.index, event.text, finish)
        logprobs = self._chat_logprobs(list(event.logprobs))
        return self._chunk(event.index, DeltaMessage(content=event.text), logprobs, finish)

    def _template_chunk(self) -> dict[str, Any]:
        return self._chunk(0, DeltaMessage(content=""), None, None)

    def usage_chunk(self) -> dict[str, Any]:
        chunk = ChatCompletionChunk(
            id=self.info.response_id,
            created=self.info.created,
            model=self.info.model,
            choices=[],
            usage=self.usage(),
        )
        return chunk.model_dump(mode="json")

    def _chunk(
        self, index: int, delta: DeltaMessage, logprobs: ChatLogprobs | None, finish: str | None
    ) -> dict[str, Any]:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        chunk = ChatCompletionChunk(
            id=self.info.response_id,
            created=self.info.created,
            model=self.info.model,
            choices=[choice],
        )
        out = self._dump_chunk(chunk)
        if delta.role is None:
            out["choices"][0]["delta"].pop("role")
        if delta.tool_calls is None:
            out["choices"][0]["delta"].pop("tool_calls")
        return out

    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            message, finish = AssistantMessage(content=c.text), c.finish_reason
            if self.tools is not None:
                content, calls = self.tools.parse(c.text)
                if calls:
                    message = AssistantMessage(
                        content=content,
                        tool_calls=[ToolCall.model_validate(x.message()) for x in calls],
                    )
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self._chat_logprobs(c.logprobs),
                    finish_reason=finish,
                )
            )
        resp = ChatCompletionResponse(
            id=self.info.response_id,
            created=self.info.created,
            model=self.info.model,
            choices=choices,
            usage=self.usage(),
        ).model_dump(mode="json")
        for choice in resp["choices"]:  # as OpenAI: the key only when there are calls
            if choice["message"]["tool_calls"] is None:
                del choice["message"]["tool_calls"]
        return resp


class CompletionRenderer(_Renderer):
    """Completion responses and chunks. ``echo``: per choice, the prompt text its text starts
    with (``echo: true``), sent with the choice's first chunk. ``prompts``: each prompt's token
    ids, when its prompt logprobs are wanted (``echo`` with ``logprobs``: they open the choice's
    logprobs; ``prompt_logprobs``, vLLM's: the choice's ``prompt_logprobs`` list)."""

    def __init__(
        self,
        info: RequestInfo,
        tokens: TokenRenderer,
        echo: list[str] | None = None,
        prompts: list[list[int]] | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        super().__init__(info, tokens)
        self.echo = echo
        self.prompts = prompts
        self.prompt_logprobs = prompt_logprobs
        self._prompt_lps: dict[int, tuple[TokenLogprob | None, ...]] = {}
        self._echoed: set[int] = set()

    def add(self, event: TokenEvent) -> None:
        super().add(event)
        if event.prompt_logprobs:
            self._prompt_lps[event.index // self.per_prompt] = event.prompt_logprobs

    def _echo(self, index: int) -> str:
        """The echo of choice ``index`` the first time it is asked for, else ''."""
        if self.echo is None or index in self._echoed:
            return ""
        self._echoed.add(index)
        return self.echo[index]

    def _prompt_part(self, index: int, choice: _Choice) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs for choice ``index`` (None unless echo with
        logprobs); advances the choice's text offset past the prompt's tokens."""
        if self.echo is None or not self.info.logprobs or self.prompts is None:
            return None
        group = index // self.per_prompt
        lps = self._prompt_lps.get(group, ())
        t, out = self.tokens, CompletionLogprobs()
        for i, token in enumerate(self.prompts[group]):
            lp = lps[i] if i < len(lps) else None
            text = t.text(token)
            out.tokens.append(text)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else {t.text(k): v for k, v in lp.top})
            out.text_offset.append(choice.offset)
            choice.offset += len(text)
        return out

    def _vllm_prompt_logprobs(self, index: int) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's ``prompt_logprobs`` list of choice ``index``'s prompt (None: not asked)."""
        if not self.prompt_logprobs:
            return None
        t = self.tokens
        out: list[dict[str, PromptLogprob] | None] = []
        for lp in self._prompt_lps.get(index // self.per_prompt, ()):
            if lp is None:
                out.append(None)
                continue
            entries = [(lp.token_id, lp.logprob), *lp.top]
            out.append(
                {str(k): PromptLogprob(logprob=v, decoded_token=t.text(k)) for k, v in entries}
            )
        return out

    def _opening(self, index: int, choice: _Choice, items: list[TokenLogprob]) -> Any:
        """Choice ``index``'s echo text and logprobs (prompt part first) for ``items``."""
        first = index not in self._echoed
        text = self._echo(index)
        head = self._prompt_part(index, choice) if first else None
        tail = self._logprobs_for(choice, items)
        if head is not None and tail is not None:
            head.tokens += tail.tokens
            head.token_logprobs += tail.token_logprobs
            head.top_logprobs += tail.top_logprobs
            head.text_offset += tail.text_offset
            tail = head
        prompt = self._vllm_prompt_logprobs(index) if first else None
        return text, tail, prompt

    def chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        """The stream chunk of ``event``."""
        return [self.chunk(event)]

    def _logprobs_for(
        self, choice: _Choice, items: list[TokenLogprob]
    ) -> CompletionLogprobs | None:
        """Logprobs of ``items``, the next tokens of ``choice`` (advances its text offset)."""
        if not self.info.logprobs:
            return None
        t = self.tokens
        out = CompletionLogprobs()
        for lp in items:
            text = t.text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({t.text(tid): v for tid, v in lp.top})
            out.text_offset.append(choice.offset)
            choice.offset += len(text)
        return out

    def start(self) -> list[dict[str, Any]]:
        """Completions streams have no role chunk."""
        return []

    def chunk(self, event: TokenEvent) -> dict[str, Any]:
        self.add(event)
        if self.echo is None and not self.info.logprobs and not self.prompt_logprobs:
            finish = str(event.finish_reason) if event.finish_reason is not None else None
            return self._plain_chunk(event.index, event.text, finish)
        c = self.choices[event.index]
        echo, logprobs, prompt = self._opening(event.index, c, list(event.logprobs))
        choice = CompletionChoice(
            index=event.index,
            text=echo + event.text,
            logprobs=logprobs,
            finish_reason=str(event.finish_reason) if event.finish_reason is not None else None,
            prompt_logprobs=prompt,
        )
        return _without_prompt_logprobs(self._dump_chunk(self._wrap([choice], None)))

    def usage_chunk(self) -> dict[str, Any]:
        return self._wrap([], self.usage()).model_dump(mode="json")

    def _template_chunk(self) -> dict[str, Any]:
        choice = CompletionChoice(index=0, text="", logprobs=None, finish_reason=None)
        return _without_prompt_logprobs(self._dump_chunk(self._wrap([choice], None)))

    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            c.offset = 0
            echo, logprobs, prompt = self._opening(i, c, c.logprobs)
            choices.append(
                CompletionChoice(
                    index=i,
                    text=echo + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    prompt_logprobs=prompt,
                )
            )
        return _without_prompt_logprobs(self._wrap(choices, self.usage()).model_dump(mode="json"))

    def _wrap(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.info.response_id,
            created=self.info.created,
            model=self.info.model,
            choices=choices,
            usage=usage,
        )


def _without_prompt_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with each choice's ``prompt_logprobs`` key dropped where it is null (it is
    vLLM's extension: a plain client never sees it)."""
    for choice in body.get("choices", ()):
        if choice.get("prompt_logprobs", 0) is None:
            del choice["prompt_logprobs"]
    return body
