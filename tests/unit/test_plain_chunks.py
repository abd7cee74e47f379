"""The stream chunks of plain text (no logprobs, no echo, no tools) are built from a template
(server/rendering/chunks.py ``_plain_chunk``) instead of through the response models per token:
byte for byte what the models render, for chat and completions, every choice, with and without
the usage option and a finish reason."""

from __future__ import annotations

import json

import pytest

from pdserve.protocol import FinishReason
from pdserve.router.request import TokenEvent
from pdserve.server.rendering.chunks import ChatRenderer, CompletionRenderer, RequestInfo
from pdserve.server.rendering.logprobs import TokenRenderer
from pdserve.server.rendering.replies import DeltaMessage

EVENTS = [
    TokenEvent((5,), "Hel", (), None, index=0, cached_tokens=3),
    TokenEvent((6,), 'lo "\u2028', (), None, index=1),
    TokenEvent((7,), "", (), FinishReason.STOP, index=0),
    TokenEvent((8, 9), "!", (), FinishReason.LENGTH, index=1),
]


def info(include_usage: bool) -> RequestInfo:
    return RequestInfo("id-1", "m", prompt_tokens=4, include_usage=include_usage, n=2)


@pytest.mark.parametrize("include_usage", [False, True])
def test_plain_chat_chunks_equal_the_models(include_usage: bool) -> None:
    fast, slow = (ChatRenderer(info(include_usage), TokenRenderer(None)) for _ in range(2))
    for e in EVENTS:
        finish = str(e.finish_reason) if e.finish_reason is not None else None
        want = slow._chunk(e.index, DeltaMessage(content=e.text), None, finish)
        assert json.dumps(fast.chunk(e)) == json.dumps(want)
    assert fast.completion_tokens == 5 and fast.cached_tokens == 3  # still accounted


@pytest.mark.parametrize("include_usage", [False, True])
def test_plain_completion_chunks_equal_the_models(include_usage: bool) -> None:
    fast = CompletionRenderer(info(include_usage), TokenRenderer(None))
    slow = CompletionRenderer(info(include_usage), TokenRenderer(None), echo=["", ""])  # models
    for e in EVENTS:
        got, want = fast.chunk(e), slow.chunk(e)
        assert json.dumps(got) == json.dumps(want)
        assert "prompt_logprobs" not in got["choices"][0]
    assert fast.response() == slow.response()
