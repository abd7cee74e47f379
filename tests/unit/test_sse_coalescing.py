"""The router's SSE body writes the chunks that arrived together as one write: while the
transaction has its next event at hand (``ready()``), what is rendered is held; when it has
not, all of it goes out at once, so nothing waits and a burst costs one write, not one per
chunk. A failure mid-stream still sends what was held before its error event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import WorkerError
from pdserve.observability.tracing import Timeline
from pdserve.router.request import TokenEvent
from pdserve.server.app import _sse
from pdserve.server.rendering.sse import DONE, encode_event


@dataclass
class Txn:
    """Yields one event per text; ``ready()`` after the i-th event is ``at_hand[i]``."""

    texts: list[str]
    at_hand: list[bool]
    fail_at: int | None = None
    closed: bool = False
    request_id: str = "r1"
    _i: int = field(default=-1)

    async def events(self) -> AsyncGenerator[TokenEvent, None]:
        for i, text in enumerate(self.texts):
            if i == self.fail_at:
                raise WorkerError("decode worker w1 broke its stream")
            self._i = i
            yield TokenEvent((i,), text, (), None, index=0)
            await asyncio.sleep(0)

    def ready(self) -> bool:
        return self.at_hand[self._i]

    async def aclose(self) -> None:
        self.closed = True


class Info:
    include_usage = False


class Renderer:
    info = Info()

    def start(self) -> list[dict[str, Any]]:
        return [{"start": True}]

    def chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        return [{"text": event.text}]


def writes(txn: Txn) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [w async for w in _sse(txn, Renderer(), Timeline("r1"))]  # type: ignore[arg-type]

    return asyncio.run(collect())


def ev(text: str) -> bytes:
    return encode_event({"text": text})


def test_chunks_at_hand_together_go_out_in_one_write() -> None:
    txn = Txn(["a", "b", "c", "d"], at_hand=[True, True, False, False])
    assert writes(txn) == [
        encode_event({"start": True}),
        ev("a") + ev("b") + ev("c"),
        ev("d"),
        DONE,
    ]
    assert txn.closed


def test_a_failure_sends_what_was_held_then_the_error() -> None:
    txn = Txn(["a", "b", "c"], at_hand=[False, True, True], fail_at=2)
    out = writes(txn)
    assert out[:2] == [encode_event({"start": True}), ev("a")]
    assert out[2].startswith(ev("b") + b'data: {"error":')
    assert out[2].endswith(DONE)
    assert txn.closed
