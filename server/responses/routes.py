"""The stateless OpenAI Responses API, ``POST /v1/responses``, on the chat machinery.

A Responses request (:mod:`.responses_schemas`) is mapped onto a chat completion request
(:func:`~pdserve.server.responses.chat_mapping.to_chat`: ``instructions`` a system message first,
``input`` items the messages, ``function_call`` / ``function_call_output`` items an assistant's
``tool_calls`` / ``tool`` messages, ``max_output_tokens`` ``max_tokens``, flat function tools
chat's, ``text.format`` ``response_format``), which then goes through
:meth:`~pdserve.server.chat.preprocess.Preprocessor.chat` on the tokenizer pool as
``/v1/chat/completions`` does: every check, the chat template, tool calling and structured
outputs apply unchanged, and an error names the Responses field
(:func:`~pdserve.server.responses.chat_mapping.public_error`). Then the transaction runs as chat's
does (the app's ``_collect`` for a whole response: a client that leaves abandons it; an
:class:`~pdserve.server.rendering.sse.SSEResponse` closing it for a stream). Nothing is stored
(``store: true``, ``previous_response_id``, ``background: true`` are a 400 ``unsupported``); one
output (no ``n``).

The output (:class:`ResponsesRenderer`) is the text of the one choice, read for tool calls as
chat reads it (:class:`~pdserve.server.chat.tool_calls.ToolPlan`: ``parse`` whole,
:class:`~pdserve.server.chat.tool_calls.ToolStream` streamed): a ``message`` item with the text (when
there is text, or nothing else), then one ``function_call`` item per call. A choice cut by the
token limit is ``status: "incomplete"``, ``incomplete_details.reason: "max_output_tokens"``,
its last item ``incomplete``.

Event lifecycle of a stream (``stream: true``; each event is ``event: <type>`` + ``data:
<json>`` carrying ``type`` and a ``sequence_number`` counting from 0; no ``[DONE]``)::

    response.created, response.in_progress              the response, status in_progress
    per output item, in order (output_index 0, 1, ...):
      message:        response.output_item.added, response.content_part.added,
                      response.output_text.delta (per piece of text),
                      response.output_text.done, response.content_part.done,
                      response.output_item.done
      function_call:  response.output_item.added (id, call_id, name; arguments ""),
                      response.function_call_arguments.delta (per piece),
                      response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete           the whole response, usage included

An item is done when the next one starts or the output ends; a reply with no text and no call
is one empty message. Text that may open a call is held back until it is known (as chat's
streams do). A failure after the first byte (the HTTP status is sent) ends the stream with an
``error`` event (the pdserve error's ``code``, public ``message`` and ``param``) and then
``response.failed`` (the response so far, ``error: {"code": "server_error" |
"rate_limit_exceeded", "message"}``). A failure before it is an HTTP error status, as on chat.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.config.loading import RouterConfig
from pdserve.errors import PdserveError
from pdserve.http.error_responses import internal_error, log_failure
from pdserve.router.request import TokenEvent
from pdserve.router.router import Router
from pdserve.router.sessions import SESSION_HEADER, session_id_from
from pdserve.router.transaction import Transaction
from pdserve.server.chat.grammar_checker import GrammarChecker, checked
from pdserve.server.chat.preprocess import Preprocessor
from pdserve.server.chat.tokenizer_pool import TokenizerPool
from pdserve.server.chat.tool_calls import StreamDelta, ToolPlan, ToolStream
from pdserve.server.openapi import responses_api_responses
from pdserve.server.rendering.chunks import ChatRenderer, RequestInfo
from pdserve.server.rendering.logprobs import TokenRenderer
from pdserve.server.rendering.sse import SSEResponse, encode_named_event
from pdserve.server.responses.chat_mapping import echo_fields, public_error, to_chat
from pdserve.server.responses.schemas import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseErrorInfo,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from pdserve.server.timelines import (
    closer,
    collecting,
    received_ns,
    request_timeline,
    started,
    unless_disconnected,
)

log = logging.getLogger(__name__)

Collect = Callable[[Request, Transaction, ChatRenderer], Awaitable[None]]
"""The app's disconnect-aware collector (``server/app.py``'s ``_collect``): feeds every event
of a transaction to the renderer; a client that leaves abandons the transaction."""


class _State(Protocol):
    """What the route reads of the app's ``ServerState`` (``app.state.pdserve``)."""

    cfg: RouterConfig
    preprocessor: Preprocessor
    tokenizer_pool: TokenizerPool
    grammars: GrammarChecker
    tokens: TokenRenderer
    router: Router


# --- the output --------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """One output item as it is streamed: a message (``text``) or a function call."""

    index: int
    id: str
    call_id: str | None = None  # a function call's
    name: str = ""
    text: str = ""  # a message's text, or a call's arguments
    done: bool = False

    def model(self, status: ItemStatus) -> OutputItem:
        """The item; a message just added has no content part yet (the next event adds it)."""
        if self.call_id is None:
            content = [] if status == "in_progress" else [OutputText(text=self.text)]
            return OutputMessage(id=self.id, status=status, content=content)
        return FunctionCallItem(
            id=self.id, call_id=self.call_id, name=self.name, arguments=self.text, status=status
        )


class ResponsesRenderer:
    """Router events -> a Responses object, or the stream's events (module docstring). Not
    streaming: every event goes to ``chat`` (a :class:`ChatRenderer`, which accounts for the
    text, the tokens and the finish reason), then :meth:`response`. Streaming: :meth:`start`,
    :meth:`events` per event, :meth:`finish` (or :meth:`failed`)."""

    def __init__(
        self,
        info: RequestInfo,
        tokens: TokenRenderer,
        tools: ToolPlan | None,
        echo: dict[str, Any],
    ) -> None:
        """``echo``: the request's settings every response object repeats (instructions,
        max_output_tokens, temperature, top_p, tools, tool_choice, parallel_tool_calls, text,
        metadata, user)."""
        self.info = info
        self.chat = ChatRenderer(info, tokens, tools)
        self.echo = echo
        self._stream = ToolStream(tools) if tools is not None else None
        self._items: list[_Item] = []
        self._calls: dict[int, _Item] = {}  # the stream's call index -> its item
        self._flushed = False
        self._seq = 0

    # --- whole ---

    @property
    def incomplete(self) -> bool:
        return self.chat.choices[0].finish_reason == "length"

    def response(self) -> dict[str, Any]:
        """The whole response (not streamed)."""
        text = self.chat.choices[0].text
        content: str | None = text
        items: list[_Item] = []
        if self.chat.tools is not None:
            content, calls = self.chat.tools.parse(text)
            items = [_Item(0, _id("fc"), c.id, c.name, c.arguments) for c in calls]
        if content is not None or not items:
            items.insert(0, _Item(0, _id("msg"), text=content or ""))
        return self._object(self._status(), self._output(items))

    def _status(self) -> Literal["completed", "incomplete"]:
        return "incomplete" if self.incomplete else "completed"

    def _output(self, items: list[_Item]) -> list[OutputItem]:
        """The items as output, the last one ``incomplete`` when the token limit cut it."""
        last = len(items) - 1
        return [
            it.model("incomplete" if i == last and self.incomplete else "completed")
            for i, it in enumerate(items)
        ]

    def _usage(self) -> ResponseUsage:
        usage = self.chat.usage()
        details = usage.prompt_tokens_details
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=details.cached_tokens if details is not None else 0
            ),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )

    def _object(
        self,
        status: ResponseStatus,
        output: list[OutputItem],
        error: ResponseErrorInfo | None = None,
    ) -> dict[str, Any]:
        final = status in ("completed", "incomplete")
        obj = ResponseObject(
            id=self.info.response_id,
            created_at=self.info.created,
            status=status,
            error=error,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
            model=self.info.model,
            output=output,
            usage=self._usage() if final else None,
            **self.echo,
        )
        return obj.model_dump(mode="json")

    # --- streamed ---

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """The first events: the response created and in progress, no output yet."""
        obj = self._object("in_progress", [])
        return [
            self._event("response.created", response=obj),
            self._event("response.in_progress", response=obj),
        ]

    def events(self, event: TokenEvent) -> list[dict[str, Any]]:
        """The events of one router event (none while text that may open a call is held)."""
        self.chat.add(event)
        if self._stream is None:
            return self._apply([StreamDelta(content=event.text)])
        deltas = self._stream.feed(event.text)
        if event.finish_reason is not None:
            deltas += self._flush()
        return self._apply(deltas)

    def _flush(self) -> list[StreamDelta]:
        """What the tool stream still holds, once."""
        if self._stream is None or self._flushed:
            return []
        self._flushed = True
        return self._stream.finish()

    def _apply(self, deltas: list[StreamDelta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if d.index is None:
                if d.content:
                    self._text(d.content, out)
            elif d.call is not None:
                item = self._open(_Item(len(self._items), _id("fc"), d.call.id, d.call.name), out)
                self._calls[d.index] = item
            elif d.arguments:
                item = self._calls[d.index]
                item.text += d.arguments
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=item.index,
                        delta=d.arguments,
                    )
                )
        return out

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        item = self._items[-1] if self._items else None
        if item is None or item.done or item.call_id is not None:
            item = self._open(_Item(len(self._items), _id("msg")), out)
        item.text += text
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )

    def _open(self, item: _Item, out: list[dict[str, Any]]) -> _Item:
        """Close the open item, open ``item``."""
        self._close(out, "completed")
        self._items.append(item)
        out.append(
            self._event(
                "response.output_item.added",
                output_index=item.index,
                item=item.model("in_progress").model_dump(mode="json"),
            )
        )
        if item.call_id is None:
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=item.index,
                    content_index=0,
                    part=OutputText(text="").model_dump(mode="json"),
                )
            )
        return item

    def _close(self, out: list[dict[str, Any]], status: ItemStatus) -> None:
        """The done events of the open item, if any."""
        if not self._items or self._items[-1].done:
            return
        item = self._items[-1]
        item.done = True
        where = {"item_id": item.id, "output_index": item.index}
        if item.call_id is None:
            part = OutputText(text=item.text).model_dump(mode="json")
            out.append(
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=item.text,
                    logprobs=[],
                )
            )
            out.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            out.append(
                self._event("response.function_call_arguments.done", **where, arguments=item.text)
            )
        done = item.model(status).model_dump(mode="json")
        out.append(self._event("response.output_item.done", output_index=item.index, item=done))

    def finish(self) -> list[dict[str, Any]]:
        """The last events, once the transaction ended: the open item done (an empty message
        when there was no output at all), then ``response.completed`` or ``.incomplete``."""
        out = self._apply(self._flush())  # (the last event flushed it already)
        if not self._items:
            self._open(_Item(0, _id("msg")), out)
        self._close(out, self._status())
        obj = self._object(self._status(), self._output(self._items))
        out.append(self._event(f"response.{self._status()}", response=obj))
        return out

    def failed(self, exc: PdserveError) -> list[dict[str, Any]]:
        """The events of a failure mid-stream: ``error``, then ``response.failed``."""
        code = "rate_limit_exceeded" if exc.status == 429 else "server_error"
        message = exc.public_message
        output = [it.model("completed" if it.done else "incomplete") for it in self._items]
        error = ResponseErrorInfo(code=code, message=message)
        return [
            self._event("error", code=exc.code or exc.type, message=message, param=exc.param),
            self._event("response.failed", response=self._object("failed", output, error)),
        ]


# --- the route ---------------------------------------------------------------------------------


def add_responses_routes(app: FastAPI, *, secured: bool, collect: Collect) -> None:
    """Register ``POST /v1/responses`` on ``app`` (behind the ``/v1`` API-key guard, every
    status declared: :func:`~pdserve.server.openapi.responses_api_responses`). ``collect``:
    the app's collector (:data:`Collect`), passed in so this module imports no app module."""

    @app.post(
        "/v1/responses",
        response_model=None,
        responses=responses_api_responses(ResponseObject, secured=secured),
    )
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI Responses API (stateless: nothing is stored), streamed (SSE) or not."""
        t0 = received_ns(request)
        st: _State = request.app.state.pdserve
        session = session_id_from(request.headers.get(SESSION_HEADER), body.user,
                                  from_user=st.cfg.router.session_from_user)  # fmt: skip
        chat, origins = to_chat(body)
        try:
            prepared = await st.tokenizer_pool.run(
                len(await request.body()), st.preprocessor.chat, chat
            )
            (prepared,) = await checked(st.grammars, [prepared])
        except PdserveError as exc:
            raise public_error(exc, origins) from None
        info = RequestInfo(
            response_id=_id("resp"),
            model=st.cfg.served_model_name,
            prompt_tokens=len(prepared.prompt_token_ids),
        )
        fmt = ResponsesRenderer(
            info, st.tokens, prepared.tools, echo_fields(body, st.preprocessor.sampling_defaults)
        )
        rid = info.response_id
        log.debug(
            "req %s: %d prompt tokens, %s, stream=%s",
            rid,
            len(prepared.prompt_token_ids),
            prepared.sampling,
            body.stream,
        )
        timeline = request_timeline(
            request, "chat", info.model, rid, info.prompt_tokens, prepared.sampling, t0
        )
        log_phases = st.cfg.observability.phase_log
        tenant = getattr(request.state, "tenant", None)  # the fair queue's (server/guard.py)
        start = st.router.start(
            rid, prepared.prompt_token_ids, prepared.sampling, timeline, session, tenant
        )
        txn = await started(
            unless_disconnected(request, start), timeline, rid, phase_log=log_phases
        )
        if body.stream:
            on_close = closer(txn.aclose, timeline, rid, phase_log=log_phases)
            return SSEResponse(_sse(txn, fmt), headers={"x-request-id": rid}, on_close=on_close)
        async with collecting(txn.aclose, timeline, rid, phase_log=log_phases):
            await collect(request, txn, fmt.chat)
            response = JSONResponse(fmt.response(), headers={"x-request-id": rid})
        return response


async def _sse(txn: Transaction, fmt: ResponsesRenderer) -> AsyncIterator[bytes]:
    """The SSE body (module docstring); the transaction is closed however this ends."""
    rid = txn.request_id
    try:
        for e in fmt.start():
            yield encode_named_event(e["type"], e)
        async with aclosing(txn.events()) as events:
            async for event in events:
                for e in fmt.events(event):
                    yield encode_named_event(e["type"], e)
        for e in fmt.finish():
            yield encode_named_event(e["type"], e)
    except PdserveError as exc:
        log_failure(rid, exc, public=True, what="failed mid-stream")
        for e in fmt.failed(exc):
            yield encode_named_event(e["type"], e)
    except Exception:
        log.exception("req %s: unexpected error mid-stream", rid)
        for e in fmt.failed(internal_error(rid)):
            yield encode_named_event(e["type"], e)
    finally:
        await txn.aclose()
