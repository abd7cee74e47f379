"""Prefill (context) role: run the context phase, park the KV blocks, answer with a handle.

:class:`PrefillWorker` is the process (its parts and routes: ``POST /internal/context``,
``POST /internal/context/stream``, ``POST /internal/release``); :class:`PrefillHandler` is the
request logic below.

Request lifecycle on a prefill worker::

    1 RECEIVED   ContextRequest validated (deadline not passed, prompt within the model window)
    2 PREFILLING engine runs the prompt in its batch and samples exactly one token
    3 PARKED     blocks handed from the engine to the lease table (ParkedBlocks); the router gets
                 ContextResponse(first_token, handle)
    4 SENDING    the decode worker's transceiver pulls the blocks (pdserve.transfer)
    5 RELEASED   the decode worker (or the router, on failure) releases them, or the lease expires

If the first token already ends the request (EOS, stop string, ``max_tokens == 1``) the engine
frees the blocks itself and the response carries ``finish_reason`` and no handle. A request for
``n > 1`` choices samples choice 0's first token only, and the engine always parks its blocks
(choices 1..n-1 still need them): the response carries the handle, and ``finish_reason`` too
when that token already ended choice 0.

The streamed hand-off (``/internal/context/stream``, the router's ``kv_stream_min_tokens``; the
TensorRT-LLM seed's outlook of communication that need not wait for the whole context phase):
at 1 the lease table opens a stream and the answer's first NDJSON line, ``ContextStarted``,
carries a streamed handle (no block ids, its lease id the park's to come); in 2 the engine
reports each chunk's completed blocks (``EngineOutput.ready_block_ids``), which the transceiver
sends to the decode worker pulling meanwhile; at 3 the park takes the stream's lease id, the
first token goes to the pull and the ``ContextResponse`` line follows. A prefill that fails
ends the pull (TransferFailed) and the stream's last line is ``ContextFailed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from pdserve.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    PdserveError,
    WorkerError,
)
from pdserve.protocol import (
    ContextFailed,
    ContextRequest,
    ContextResponse,
    ContextStarted,
    ReleaseRequest,
    Role,
    TransferHandle,
)
from pdserve.workers.engine.requests import EngineRequest
from pdserve.workers.roles.bridge import OutputStream
from pdserve.workers.roles.kv_transfer import TransferWorker, capped
from pdserve.workers.roles.parking import Lease, ParkedBlocks
from pdserve.workers.roles.service import service_of
from pdserve.workers.roles.timing import EngineClock, end_leg, leg_timeline

if TYPE_CHECKING:
    from pdserve.discovery.load_events import ParkedCounts
    from pdserve.observability.tracing import Timeline
    from pdserve.transfer import Transceiver
    from pdserve.workers.engine.api import WorkerEngine
    from pdserve.workers.roles.lending import PrefixPuller

log = logging.getLogger(__name__)


class PrefillHandler:
    """Serves ``/internal/context`` and ``/internal/release`` for one prefill worker.

    Ownership: the engine owns a request's blocks until its prefill output hands them over
    (``parked_block_ids``); from then on :attr:`parked` owns them until release or expiry.
    """

    def __init__(
        self,
        *,
        engine: WorkerEngine,
        transceiver: Transceiver,
        parked: ParkedBlocks,
        worker_id: str,
        puller: PrefixPuller | None = None,
    ) -> None:
        self.engine = engine
        self.transceiver = transceiver
        self.parked = parked
        self.worker_id = worker_id
        self.puller = puller

    async def context(self, req: ContextRequest) -> ContextResponse:
        """Run prefill for ``req``. Raises DeadlineExceededError, InvalidRequestError (from the
        engine's validation), CapacityError, or WorkerError when the engine fails the request.
        The request's timeline (phases ``queue``, ``compute``, ``park``: :mod:`.timing`) is
        finished here and its phases go back in the answer."""
        timeline = leg_timeline("prefill", self.worker_id, req)
        try:
            stream = await self._admit(req, progress=False, timeline=timeline)
            resp = await self._finish(req, stream)
        except BaseException as exc:
            end_leg(timeline, repr(exc))
            raise
        end_leg(timeline)
        return resp

    async def context_stream(
        self, req: ContextRequest
    ) -> AsyncIterator[ContextStarted | ContextResponse]:
        """The streamed hand-off: admit ``req``, yield :class:`ContextStarted` with a streamed
        handle at once (its lease id is the one the blocks are parked under at the end),
        report each prefill chunk's completed blocks to the lease table while the prefill
        runs (a decode worker pulls them meanwhile), then yield the :class:`ContextResponse`.
        Raises as :meth:`context` (before the first yield: nothing was admitted); a failure
        or cancellation after it ends the stream's waiting pulls (TransferFailed)."""
        timeline = leg_timeline("prefill", self.worker_id, req)
        try:
            stream = await self._admit(req, progress=True, timeline=timeline)
            lease = self.parked.open_stream(req.request_id, req.deadline)
        except BaseException as exc:
            end_leg(timeline, repr(exc))
            self.engine.abort(req.request_id)
            raise
        handle = self._handle(req, (), lease, streamed=True)
        try:
            yield ContextStarted(request_id=req.request_id, handle=handle)
            resp = await self._finish(req, stream, streamed=True)
        except BaseException as exc:
            end_leg(timeline, repr(exc))
            self.parked.fail_stream(req.request_id, "the prefill failed")
            log.info("req %s: streamed prefill ended early: %r", req.request_id, exc)
            raise
        end_leg(timeline)
        if resp.handle is None:  # the first token finished it: nothing for a decode worker
            self.parked.fail_stream(req.request_id, "the first token finished the request")
        else:
            self.parked.finish_stream(req.request_id, resp.first_token)
        # Not released if the router then leaves: it holds the lease id since ContextStarted
        # (it releases on failure) and the decode worker may be finishing its pull.
        yield resp

    async def _admit(
        self, req: ContextRequest, *, progress: bool, timeline: Timeline
    ) -> OutputStream:
        remaining = req.deadline - time.time()
        if remaining <= 0:
            raise DeadlineExceededError(f"request {req.request_id} arrived after its deadline")
        if req.sampling.structured is not None:  # compiled off the event loop and engine step
            t_grammar = time.time_ns()
            await asyncio.to_thread(self.engine.prepare_grammar, req.sampling)
            timeline.add("grammar", t_grammar, time.time_ns())
        if req.prefix is not None and self.puller is not None:  # a peer's cached prefix
            t_pull = time.time_ns()
            moved = await self.puller.take(
                req.request_id, req.prompt_token_ids, req.sampling, req.prefix, req.deadline
            )
            timeline.add("prefix_pull", t_pull, time.time_ns(), pdserve_kv_blocks=moved)
        stream = OutputStream(clock=EngineClock(timeline, "compute"))
        leg = EngineRequest.for_leg(req, "prefill")
        self.engine.add_request(replace(leg, progress=progress), stream.sink)
        return stream

    async def _finish(
        self, req: ContextRequest, stream: OutputStream, *, streamed: bool = False
    ) -> ContextResponse:
        """Wait for the prefill's sampled output (recording progress reports of a streamed
        request's chunks), park its blocks, answer with the timeline's phases."""
        try:
            while True:
                out = await stream.next(timeout=req.deadline - time.time())
                if out.ready_block_ids is None:
                    break
                if streamed:
                    self.parked.stream_progress(req.request_id, out.ready_block_ids)
        except TimeoutError:
            self.engine.abort(req.request_id)
            raise DeadlineExceededError(
                f"prefill of request {req.request_id} did not finish before its deadline"
            ) from None
        except BaseException:
            self.engine.abort(req.request_id)
            raise
        if out.error is not None and out.error_code is not None:  # the request's own: a 400
            raise InvalidRequestError(out.error, code=out.error_code)
        if out.error is not None:
            raise WorkerError(f"prefill failed for request {req.request_id}: {out.error}")
        handle = None if out.parked_block_ids is None else self._park(req, out.parked_block_ids)
        phases: dict[str, float] = {}
        if (clock := stream.clock) is not None and clock.timeline is not None:
            clock.timeline.add("park", clock.last_ns, time.time_ns())
            phases = clock.timeline.durations()
        return ContextResponse(
            request_id=req.request_id,
            first_token=out.token_ids[0],
            text=out.text,
            logprob=out.logprobs[0] if out.logprobs else None,
            finish_reason=out.finish_reason,
            handle=handle,
            cached_tokens=out.cached_tokens or 0,
            prompt_logprobs=tuple(out.prompt_logprobs or ()),
            phases=phases,
        )

    def _park(self, req: ContextRequest, block_ids: list[int]) -> TransferHandle:
        """Park ``block_ids`` under a new lease (a streamed request: the lease its handle
        named); the handle a decode worker pulls them with."""
        lease = self.parked.park(req.request_id, block_ids, len(req.prompt_token_ids))
        handle = self._handle(req, tuple(block_ids), lease)
        log.debug(
            "request %s parked %d KV blocks until %.1f",
            req.request_id,
            len(handle.block_ids),
            lease.deadline,
        )
        return handle

    def _handle(
        self,
        req: ContextRequest,
        block_ids: tuple[int, ...],
        lease: Lease,
        *,
        streamed: bool = False,
    ) -> TransferHandle:
        return TransferHandle(
            worker_id=self.worker_id,
            epoch=self.parked.epoch,
            request_id=req.request_id,
            lease_id=lease.lease_id,
            block_ids=block_ids,
            num_tokens=len(req.prompt_token_ids),
            lease_deadline=lease.deadline,
            layout=self.engine.layout,
            backend=self.transceiver.backend,
            transfer_endpoint=self.transceiver.endpoint,
            streamed=streamed,
        )

    def release(self, request_id: str, epoch: int, lease_id: str) -> bool:
        """Free a parked request (router-side abort) if ``lease_id`` is its park's lease (the
        secret only the handle's holders know). Returns False when nothing was parked, the
        epoch is not ours (blocks of an old incarnation are already gone), or the request is
        parked under another lease."""
        if epoch != self.parked.epoch:
            return False
        return self.parked.release(request_id, lease_id)


class PrefillWorker(TransferWorker):
    """Prefill role: runs the context phase, parks the blocks under a lease, serves pulls."""

    role: ClassVar[Role] = Role.PREFILL

    def __init__(self, **parts: Any) -> None:
        super().__init__(**parts)
        self.handler = PrefillHandler(
            engine=self.engine,
            transceiver=self.transceiver,
            parked=self.parked,
            worker_id=self.identity.worker_id,
            puller=self.puller,
        )

    def parked_count(self) -> int:
        return len(self.parked)

    def leases_expired(self) -> int:
        return self.parked.expired_total

    def kv_counts(self) -> ParkedCounts | None:
        return self.parked

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        super().add_role_routes(api)  # /internal/kv/lend

        @api.post("/internal/context")
        async def context(req: ContextRequest, request: Request) -> ContextResponse:
            worker: PrefillWorker = service_of(request)
            req = capped(req, worker.cfg.engine.scheduler.max_request_s)
            resp = await worker.handler.context(req)
            handle = resp.handle
            if handle is not None and await request.is_disconnected():
                # The router gave up (deadline, client gone) and will never see the lease id,
                # the only key that releases these blocks: free them now, not at lease expiry.
                worker.handler.release(req.request_id, handle.epoch, handle.lease_id)
                log.info("req %s: the router left before its handle; blocks freed", req.request_id)
            return resp

        @api.post("/internal/context/stream")
        async def context_stream(req: ContextRequest, request: Request) -> StreamingResponse:
            """NDJSON: ContextStarted (the streamed handle, at admission), then ContextResponse
            or ContextFailed. A refusal before admission is a plain error answer."""
            worker: PrefillWorker = service_of(request)
            req = capped(req, worker.cfg.engine.scheduler.max_request_s)
            lines = worker.handler.context_stream(req)
            started = await anext(lines)  # raises (an error answer) before anything is admitted

            async def body() -> AsyncIterator[bytes]:
                yield started.model_dump_json().encode() + b"\n"
                try:
                    async for line in lines:
                        yield line.model_dump_json().encode() + b"\n"
                except PdserveError as exc:
                    failed = ContextFailed(
                        status=exc.status, body=exc.envelope(req.request_id).model_dump_json()
                    )
                    yield failed.model_dump_json().encode() + b"\n"

            return StreamingResponse(body(), media_type="application/x-ndjson")

        @api.post("/internal/release")
        async def release(req: ReleaseRequest, request: Request) -> dict[str, bool]:
            worker: PrefillWorker = service_of(request)
            return {"released": worker.handler.release(req.request_id, req.epoch, req.lease_id)}
