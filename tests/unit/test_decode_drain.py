"""Drain migration on the decode side, on the fake engine: a draining decode or colocated worker
ends every running stream at once with one ``worker_draining`` error chunk (the router then
continues the request elsewhere) and aborts it in the engine; outputs already queued go out
first; a stream that starts later ends the same way; ``migrate_on_drain=false`` lets streams
run. A migrated request (``resume``) reaches the engine in mode ``full`` and its stream waits
for the listed choices only."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve.config.loading import EngineConfig, WorkerConfig
from pdserve.config.settings import WorkerSettings
from pdserve.discovery import RegistrationState
from pdserve.protocol import (
    DRAINING_ERROR,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    ResumedChoice,
    Role,
    SamplingParams,
    WorkerRecord,
)
from pdserve.transfer.formatter.copies import CopyCounter
from pdserve.workers.engine.requests import EngineOutput
from pdserve.workers.roles.bridge import OutputStream
from pdserve.workers.roles.colocated import ColocatedWorker
from pdserve.workers.roles.decode import DecodeHandler
from pdserve.workers.roles.lending import Lender
from pdserve.workers.roles.parking import ParkedBlocks
from pdserve.workers.roles.service import WorkerIdentity
from tests.support.fake_engine import FakeEngine
from tests.support.fakes import CLUSTER_KEY, layout

pytestmark = pytest.mark.timeout(30)


def generation(rid: str = "r1", n: int = 2, **kw: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(n=n, max_tokens=8),
        deadline=time.time() + 20,
        **kw,  # type: ignore[arg-type]
    )


def is_draining(chunk: GenerationChunk) -> bool:
    return chunk.finish_reason is FinishReason.ERROR and (chunk.error or "").startswith(
        DRAINING_ERROR
    )


async def collect(handler: DecodeHandler, req: GenerationRequest, stream: OutputStream) -> list:
    return [c async for c in handler.chunks(req, stream)]


async def test_migrate_all_wakes_a_waiting_stream_with_the_draining_error() -> None:
    engine = FakeEngine(layout(), hold=True)  # admitted, no output comes
    handler = DecodeHandler(engine=engine, transceiver=None)  # type: ignore[arg-type]
    req = generation()
    stream = await handler.admit(req)
    task = asyncio.create_task(collect(handler, req, stream))
    await asyncio.sleep(0.01)  # blocked on the next output
    assert handler.migrate_all() == 1
    (chunk,) = await asyncio.wait_for(task, 1.0)
    assert is_draining(chunk) and chunk.index in (0, 1) and chunk.request_id == "r1"
    assert engine.aborted[0] == "r1" and engine.load().running == 0


async def test_outputs_already_queued_go_first_and_the_error_names_an_unfinished_choice() -> None:
    engine = FakeEngine(layout())
    handler = DecodeHandler(engine=engine, transceiver=None)  # type: ignore[arg-type]
    stream = OutputStream(choices=2)
    chunks = handler.chunks(generation(), stream)
    stream.sink(EngineOutput("r1", [5], "a", []))
    first = await anext(chunks)
    stream.sink(EngineOutput("r1", [6], "b", [], FinishReason.LENGTH, index=1))
    await asyncio.sleep(0)  # the sink's call_soon_threadsafe lands in the queue
    handler.migrate_all()
    rest = [c async for c in chunks]
    assert (first.index, first.token_ids) == (0, (5,))
    assert [(c.index, c.finish_reason) for c in rest] == [
        (1, FinishReason.LENGTH),
        (0, FinishReason.ERROR),
    ]
    assert is_draining(rest[-1]) and engine.aborted[0] == "r1"


async def test_a_stream_that_starts_after_migrate_all_ends_at_once() -> None:
    engine = FakeEngine(layout(), hold=True)
    handler = DecodeHandler(engine=engine, transceiver=None)  # type: ignore[arg-type]
    handler.migrate_all()
    req = generation(n=1)
    stream = await handler.admit(req)
    (chunk,) = await collect(handler, req, stream)
    assert is_draining(chunk) and chunk.index == 0 and engine.aborted == ["r1"]


async def test_a_resumed_request_runs_in_full_mode_and_waits_for_its_listed_choices() -> None:
    engine = FakeEngine(layout(), hold=True)
    handler = DecodeHandler(engine=engine, transceiver=None)  # type: ignore[arg-type]
    resume = (ResumedChoice(index=1, token_ids=(7, 8), text_chars=2),)
    req = generation(n=2, resume=resume)
    stream = await handler.admit(req)
    (sent,) = engine.requests
    assert sent.mode == "full" and sent.resume == resume and sent.first_token is None
    assert stream.unfinished == {1}
    stream.sink(EngineOutput("r1", [9], "x", [], FinishReason.LENGTH, index=1))
    chunks = await asyncio.wait_for(collect(handler, req, stream), 1.0)
    assert [(c.index, c.token_ids) for c in chunks] == [(1, (9,))]


@dataclass
class MemoryRegistration:
    state: RegistrationState = RegistrationState.REGISTERED

    async def start(self, record: WorkerRecord) -> None: ...

    async def update(self, record: WorkerRecord) -> None: ...

    async def close(self) -> None:
        self.state = RegistrationState.CLOSED


def colocated(engine: FakeEngine, *, migrate: bool) -> ColocatedWorker:
    cfg = WorkerConfig(
        role=Role.COLOCATED,
        engine=EngineConfig(model_path=Path("/nonexistent"), served_model_name="tiny-test"),
        worker=WorkerSettings(worker_id="colocated-0", migrate_on_drain=migrate),
        control_plane="memory://",
    )
    lender = Lender(engine, 30.0)  # type: ignore[arg-type]
    parked = ParkedBlocks(epoch=1, lease_s=30.0, free_blocks=lender.free)
    return ColocatedWorker(
        cfg=cfg,
        identity=WorkerIdentity("colocated-0", "http://colocated.test", CLUSTER_KEY),
        engine=engine,
        registration=MemoryRegistration(),
        parked=parked,
        lender=lender,
        peers=None,  # no pull happens here: the drain is the point
        transceiver=SimpleNamespace(copies=CopyCounter()),  # nor any transfer
    )


async def test_drain_deregisters_then_migrates_the_running_streams() -> None:
    engine = FakeEngine(layout(), hold=True)
    worker = colocated(engine, migrate=True)
    req = generation()
    stream = await worker.handler.admit(req)
    task = asyncio.create_task(collect(worker.handler, req, stream))
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    await worker.drain(timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0, "the drain waited for the stream"
    assert worker.registration.state is RegistrationState.CLOSED
    (chunk,) = await asyncio.wait_for(task, 1.0)
    assert is_draining(chunk)


async def test_without_migrate_on_drain_the_streams_run_on() -> None:
    engine = FakeEngine(layout(), hold=True)
    worker = colocated(engine, migrate=False)
    req = generation()
    stream = await worker.handler.admit(req)
    task = asyncio.create_task(collect(worker.handler, req, stream))
    await asyncio.sleep(0.01)
    await worker.drain(timeout_s=0.2)  # still busy after it: the request runs on
    assert not task.done() and engine.aborted == []
    engine.finish_held()
    chunks = await asyncio.wait_for(task, 1.0)
    assert not any(is_draining(c) for c in chunks)
    assert sorted({c.index for c in chunks if c.finish_reason}) == [0, 1]
