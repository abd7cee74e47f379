"""A multi-megabyte prompt does not stall the router's other streams (issue 13, item 6).

A real router process in front of a colocated worker on the tiny model (context window 512).
One client streams completions back to back while another posts a ~5 MB prompt, as a
completion or as a chat message. The big prompt is refused as too long for the window
(400 ``context_length_exceeded``), but only after it was tokenized: that tokenization is its
cost. The router runs it on its tokenizer pool, so the stream's largest gap between two tokens
stays below its largest gap when streaming alone plus half the time that tokenizing the prompt
takes, measured in this test with the router's own code (:class:`Preprocessor`, the same
tokenizer). Tokenizing on the event loop (the code before) stalls the stream for the whole
tokenization, which fails the bound.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.config.loading import RouterConfig
from pdserve.errors import InvalidRequestError
from pdserve.server.chat.preprocess import Preprocessor, context_window, load_tokenizer
from pdserve.server.chat.schemas import ChatCompletionRequest, CompletionRequest
from tests.support.servers import wait_until_sync
from tests.support.stack import Stack, start_stack

MODEL = "tiny-llama"
BIG_BYTES = 5 * 10**6
BIG_TEXT = ("The quick brown fox jumps over the lazy dog. " * (BIG_BYTES // 45 + 1))[:BIG_BYTES]
STREAM = {
    "model": MODEL,
    "prompt": [1, 84, 104, 101, 32, 113, 117, 105, 99, 107],
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
BIG = {
    "completions": {"model": MODEL, "prompt": BIG_TEXT, "max_tokens": 16},
    "chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": BIG_TEXT}],
        "max_tokens": 16,
    },
}


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Router + 1 colocated worker (the fewest processes on a small machine)."""
    stack = start_stack(
        tiny_model_dir,
        MODEL,
        tmp_path_factory.mktemp("tokenizer-stall"),
        prefill=0,
        decode=0,
        colocated=1,
    )
    yield stack
    stack.stop()


def _stream_gaps(url: str, on_chunk: Callable[[], None] = lambda: None) -> list[float]:
    """One streamed completion; the seconds between consecutive chunks (after the first).
    ``on_chunk`` is called at each chunk."""
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                on_chunk()
                assert "error" not in json.loads(line[6:]), line
    assert len(times) >= STREAM["max_tokens"], f"only {len(times)} chunks"
    return [b - a for a, b in zip(times, times[1:], strict=False)]


class _Streamer(threading.Thread):
    """Streams completions back to back until :meth:`finish`; ``gaps`` collects every stream's
    inter-chunk gaps, ``chunks`` counts the chunks relayed so far, ``streams`` the completed
    streams, ``error`` what broke it."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.gaps: list[float] = []
        self.chunks = 0
        self.streams = 0
        self._finish = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._finish.is_set():
                self.gaps += _stream_gaps(self.url, self._counted)
                self.streams += 1
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _counted(self) -> None:
        self.chunks += 1

    def finish(self) -> None:
        self._finish.set()
        self.join(timeout=120)
        assert not self.is_alive(), "the stream never ended"
        if self.error is not None:
            raise self.error


def _tokenize_seconds(model_dir: Path, route: str) -> float:
    """How long the router's own preprocessing of the big prompt takes in this process (the
    same tokenizer, the same code path, the same refusal)."""
    cfg = RouterConfig(model_path=model_dir, served_model_name=MODEL)
    tokenizer = load_tokenizer(model_dir)
    pre = Preprocessor(
        tokenizer, served_model_name=MODEL, max_model_len=context_window(cfg, tokenizer)
    )
    body: Any
    if route == "completions":
        body, run = CompletionRequest.model_validate(BIG[route]), pre.completion
    else:
        body, run = ChatCompletionRequest.model_validate(BIG[route]), pre.chat
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError) as refused:
        run(body)
    elapsed = time.perf_counter() - started
    assert refused.value.code == "context_length_exceeded"
    return elapsed


@pytest.mark.parametrize("route", sorted(BIG))
def test_a_5mb_prompt_does_not_stall_a_concurrent_stream(
    stack: Stack, tiny_model_dir: Path, route: str
) -> None:
    tokenize_s = _tokenize_seconds(tiny_model_dir, route)
    alone = max(_stream_gaps(stack.url))

    streamer = _Streamer(stack.url)
    streamer.start()
    wait_until_sync(lambda: streamer.chunks >= 10, 30, what="the stream to relay tokens")
    started = time.perf_counter()
    big = httpx.post(f"{stack.url}/v1/{route}", json=BIG[route], timeout=120)
    big_s = time.perf_counter() - started
    streamer.finish()

    assert big.status_code == 400, big.text
    assert big.json()["error"]["code"] == "context_length_exceeded"
    assert streamer.streams >= 1
    worst = max(streamer.gaps)
    bound = alone + tokenize_s / 2
    print(
        f"{route}: tokenize {tokenize_s:.3f} s, big request {big_s:.3f} s, "
        f"largest gap alone {alone * 1e3:.0f} ms, beside it {worst * 1e3:.0f} ms "
        f"({streamer.streams} streams), bound {bound * 1e3:.0f} ms"
    )
    assert worst < bound, (
        f"a stream stalled {worst:.3f} s beside a {BIG_BYTES} B prompt (tokenizing it takes "
        f"{tokenize_s:.3f} s; alone its largest gap is {alone:.3f} s)"
    )
