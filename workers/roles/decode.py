"""Decode (generation) role: pull the KV blocks, resume decoding, stream tokens.

:class:`DecodeWorker` is the process (its parts and the ``POST /internal/generate`` route,
:func:`add_generate_route`, which colocated workers share); :class:`DecodeHandler` is the
request logic below.

Request lifecycle on a decode worker::

    1 RECEIVED     GenerationRequest checked against the handle: token count, blocks at the
                   handle's tokens per block, layout mappable (the formatter converts tokens per
                   block and dtype), lease, epoch
    2 RESERVED     engine.reserve(): blocks for the prompt (under guaranteed_no_evict, capacity
                   for the whole completion too), starting with the prompt's longest prefix
                   cached here when the layouts are equal (delta transfer: an earlier turn of
                   the conversation decoded here; those blocks are not pulled); while the pool
                   is full the request waits for
                   blocks, at most until the prefill worker's lease (or the deadline) runs out,
                   then gets 429 (QueueFullError), as it does when ``max_queued_requests``
                   requests already wait
    3 TRANSFERRING the transceiver pulls the prefill worker's blocks into the reserved blocks
                   (SendBlocks.skip_blocks: the cached leading ones are left out); a streamed
                   handle (published when the prefill started) is pulled chunk by chunk as
                   the prefill computes it, and the pull brings the first token too
    4 RUNNING      engine resumes at the first token in its continuous batch; chunks streamed
    5 FINISHED     every choice stopped (stop / length), or abort (client gone) / error, or
                   migration: the worker drains (SIGTERM, ``worker.migrate_on_drain``) and,
                   right after it deregistered, every stream in 4 (and any that reaches 4
                   later) ends at once with one in-band error chunk whose ``error`` starts with
                   :data:`DRAINING_ERROR`, which the router answers by continuing the request
                   on another worker (``GenerationRequest.resume``); the engine frees the blocks

A request for ``n`` choices (``sampling.n``) runs them on one copy of the prompt's blocks: the
handle's blocks are pulled once, choice 0 resumes at the prefill worker's first token and the
engine samples the first token of choices 1..n-1 here. Each chunk names its choice (``index``);
the stream ends after every choice's final chunk.

A failure in 3 ends the stream with an error. Blocks refused before any byte moved (bad handle,
layout mismatch) are unreserved at once, and so are blocks whose bytes all landed but failed the
digest check (IntegrityError: never used); after a failure mid-transfer (timeout, peer death) they
are quarantined for the transfer timeout first, since a remote WRITE may still land in them.
Without a handle (a colocated worker, or a decode worker the router chose for local prefill)
the engine runs the prefill itself (mode ``full``), after pulling the prompt's prefix from a
peer when the request carries a lent one (``prefix``, :mod:`pdserve.workers.roles.lending`).

Migration (protocol 10): a request with ``resume`` (no handle) continues one another worker had
started (it died, or drained as above): 1 -> 4 with engine mode ``full``, only the listed
choices run (each recomputes the prompt and the tokens the client already has, then goes on
exactly where that worker stopped; :mod:`pdserve.workers.engine.resume`), and the stream
ends after those choices.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from pdserve.config.settings import SchedulerSettings, TransferSettings
from pdserve.errors import (
    CapacityError,
    DeadlineExceededError,
    HandleError,
    IntegrityError,
    LayoutMismatchError,
    QueueFullError,
)
from pdserve.observability import tracing
from pdserve.protocol import (
    DRAINING_ERROR,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    Role,
    TransferHandle,
)
from pdserve.workers.engine.requests import EngineRequest, Reservation
from pdserve.workers.roles.bridge import OutputStream, StreamInterrupted
from pdserve.workers.roles.kv_transfer import TransferWorker, capped
from pdserve.workers.roles.prefill_directory import PrefillDirectory
from pdserve.workers.roles.service import service_of
from pdserve.workers.roles.timing import EngineClock, end_leg, leg_timeline

if TYPE_CHECKING:
    from pdserve.observability.tracing import Timeline
    from pdserve.transfer import Transceiver
    from pdserve.workers.engine.api import WorkerEngine
    from pdserve.workers.engine.requests import EngineOutput
    from pdserve.workers.roles.lending import PrefixPuller
    from pdserve.workers.roles.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

_DRAINING_MESSAGE = (
    f"{DRAINING_ERROR}: this worker is shutting down; continue the request elsewhere"
)


def check_handle(req: GenerationRequest, handle: TransferHandle, engine: WorkerEngine) -> None:
    """Refuse a handle that cannot fill this request's blocks. Raises HandleError or
    LayoutMismatchError."""
    if handle.request_id != req.request_id:
        raise HandleError(f"handle names request {handle.request_id!r}, not {req.request_id!r}")
    if handle.num_tokens != len(req.prompt_token_ids):
        raise HandleError(
            f"handle holds K/V for {handle.num_tokens} tokens but the prompt has "
            f"{len(req.prompt_token_ids)}"
        )
    tpb = handle.layout.tokens_per_block
    needed = -(-handle.num_tokens // tpb)
    if handle.streamed:  # published at admission: the ids and the first token come by pull
        if handle.block_ids or req.first_token is not None or req.sampling.n != 1:
            raise HandleError("a streamed handle names no blocks, no first token and one choice")
    elif len(handle.block_ids) != needed:
        raise HandleError(
            f"handle lists {len(handle.block_ids)} blocks; {handle.num_tokens} tokens at "
            f"{tpb} tokens/block need {needed}"
        )
    if not handle.layout.can_map_to(engine.layout):  # tokens/block and dtype are converted
        raise LayoutMismatchError(
            "prefill and decode KV layouts cannot be mapped: "
            + handle.layout.describe_unmappable(engine.layout)
        )
    if handle.lease_remaining() <= 0:
        raise HandleError(f"lease of request {req.request_id!r} expired before decode began")
    if handle.streamed:
        return
    if min(handle.block_ids) < 0 or len(set(handle.block_ids)) != len(handle.block_ids):
        raise HandleError(
            f"handle of request {req.request_id!r} names negative or repeated KV blocks "
            f"{list(handle.block_ids)}"
        )
    if req.first_token is None:
        raise HandleError("a generation request with a handle needs first_token")


class DecodeHandler:
    """Serves ``/internal/generate`` for a decode (or colocated) worker.

    ``transceiver``: None on a colocated worker (a request with a handle is then refused).
    ``scheduler``: the scheduler section (``max_queued_requests``: how many requests may wait
    for free KV blocks at once, more get 429 at once; ``evicts``: False under
    ``guaranteed_no_evict``, where a reservation that does not fit now is refused at once,
    since nothing running will free blocks for it). ``transfer``: the transfer section
    (``timeout_s`` is also how long a failed pull's blocks are quarantined). ``prefills``: the
    prefill workers discovery lists; a handle naming another is refused before any connection
    (None: handles are not checked against discovery, for tests of the admission logic).
    ``draining``: set by :meth:`migrate_all`; every stream then ends with the draining error.
    """

    def __init__(
        self,
        *,
        engine: WorkerEngine,
        transceiver: Transceiver | None,
        metrics: WorkerMetrics | None = None,
        scheduler: SchedulerSettings = SchedulerSettings(),  # noqa: B008 (frozen)
        transfer: TransferSettings = TransferSettings(),  # noqa: B008 (frozen)
        prefills: PrefillDirectory | None = None,
        puller: PrefixPuller | None = None,
    ) -> None:
        self.engine = engine
        self.puller = puller
        self.transceiver = transceiver
        self.scheduler = scheduler
        self.quarantine_s = transfer.timeout_s
        self.quarantined = 0
        self.metrics = metrics
        self.prefills = prefills
        self.waiting_for_blocks = 0
        self.draining = False
        self._streams: dict[OutputStream, str] = {}  # streaming now (state 4) -> request id

    def _quarantine(self, request_id: str) -> None:
        """Free a failed transfer's destination blocks only after ``quarantine_s``: a remote
        WRITE (NIXL) issued before the failure may still land in them, and a block must never
        be reused while that can happen (Dynamo's deferred abort)."""
        self.quarantined += 1

        def _free() -> None:
            self.quarantined -= 1
            self.engine.unreserve(request_id)

        asyncio.get_running_loop().call_later(self.quarantine_s, _free)
        log.warning(
            "request %s: KV transfer failed mid-flight; its blocks are quarantined for %.0f s",
            request_id,
            self.quarantine_s,
        )

    async def admit(self, req: GenerationRequest, timeline: Timeline | None = None) -> OutputStream:
        """States 1-3: validate, reserve, transfer, then add to the running batch (a request
        without a handle, ``resume`` included, goes to the engine in mode ``full`` at once).
        ``timeline``: the request's on this worker (:mod:`.timing`), which gets the phases
        ``reserve`` and ``kv_pull`` (and the transfer's inside it) here and the engine's
        through the stream's clock; :meth:`chunks` finishes it.

        Raises (before anything is streamed): DeadlineExceededError, HandleError,
        LayoutMismatchError, CapacityError, InvalidRequestError, TransferError.
        """
        if req.deadline <= time.time():
            raise DeadlineExceededError(f"request {req.request_id} arrived after its deadline")
        t_admit = time.time_ns()
        if req.sampling.structured is not None:  # compiled off the event loop and engine step
            await asyncio.to_thread(self.engine.prepare_grammar, req.sampling)
        handle = req.handle
        if handle is None and req.prefix is not None and self.puller is not None:
            t_pull = time.time_ns()  # a peer's cached prefix, pulled before the prefill
            moved = await self.puller.take(
                req.request_id, req.prompt_token_ids, req.sampling, req.prefix, req.deadline
            )
            if timeline is not None:
                timeline.add("prefix_pull", t_pull, time.time_ns(), pdserve_kv_blocks=moved)
        if handle is None:
            stream = OutputStream(choices=req.choices, clock=EngineClock(timeline, "compute"))
            self.engine.add_request(EngineRequest.for_leg(req, "full"), stream.sink)
            return stream
        check_handle(req, handle, self.engine)
        if self.transceiver is None:
            raise HandleError("this worker has no transceiver; it cannot accept a handle")
        if self.prefills is not None:  # dial only what discovery lists, never a request's address
            await self.prefills.endpoint(handle)
        t_reserve = time.time_ns()
        dst = await self._reserve(req, handle)
        moved = len(dst.missing_block_ids)
        t_pull = time.time_ns()
        if timeline is not None:  # admit: grammar, the prefill worker's listing
            timeline.add("admit", t_admit, t_reserve)
            timeline.add("reserve", t_reserve, t_pull)
        try:
            t0 = time.perf_counter()
            with tracing.bind(timeline):  # the receiver records the transfer's phases
                first = await self._pull(req, handle, dst)
            if first is not None:
                req = req.model_copy(update={"first_token": first})
            elapsed = time.perf_counter() - t0
            if timeline is not None:
                timeline.add(
                    "kv_pull",
                    t_pull,
                    time.time_ns(),
                    pdserve_kv_blocks=moved,
                    pdserve_kv_bytes=moved * self.engine.layout.block_bytes,
                    pdserve_kv_blocks_skipped=dst.cached_blocks,
                    pdserve_kv_streamed=handle.streamed,
                    pdserve_kv_backend=handle.backend,
                    pdserve_prefill_worker=handle.worker_id,
                )
            log.debug(
                "request %s: pulled %d KV blocks in %.1f ms (%d cached here, not sent)",
                req.request_id,
                moved,
                elapsed * 1e3,
                dst.cached_blocks,
            )
            if self.metrics is not None:
                self.metrics.transfer_seconds.observe(elapsed)
                layout = self.engine.layout
                self.metrics.transfer_bytes.inc(moved * layout.block_bytes)
                self.metrics.transfer_blocks_skipped.inc(dst.cached_blocks)
                if handle.streamed:
                    self.metrics.transfer_streamed.inc()
        except BaseException as exc:
            if self.metrics is not None and not isinstance(exc, asyncio.CancelledError):
                self.metrics.transfer_failures.labels(type(exc).__name__).inc()
            error = self._pull_failed(req.request_id, exc)
            if error is exc:
                raise
            raise error from None
        stream = OutputStream(choices=req.choices, clock=EngineClock(timeline, "first_step"))
        self.engine.add_request(EngineRequest.for_leg(req, "resume"), stream.sink)
        return stream

    async def _pull(
        self, req: GenerationRequest, handle: TransferHandle, dst: Reservation
    ) -> int | None:
        """The KV pull into ``dst`` within the request's deadline; a streamed handle's
        returns the first token (None otherwise)."""
        assert self.transceiver is not None
        timeout = req.deadline - time.time()
        skip = dst.cached_blocks
        if handle.streamed:  # each prefill chunk's blocks as computed, then the token
            pull = self.transceiver.pull_streamed(handle, dst.block_ids, skip_blocks=skip)
            return await asyncio.wait_for(pull, timeout=timeout)
        await asyncio.wait_for(
            self.transceiver.pull(handle, dst.block_ids, skip_blocks=skip), timeout=timeout
        )
        return None

    async def _reserve(self, req: GenerationRequest, handle: TransferHandle) -> Reservation:
        """State 2: the prompt's blocks, waiting while the pool is full (running sequences free
        blocks as they finish) until the lease or the deadline is 1 s from running out. Raises
        QueueFullError (429) then, or at once when ``max_queued_requests`` requests already
        wait; InvalidRequestError / CapacityError (can never fit) from the engine.

        Delta transfer: when the handle's KV layout equals this pool's, the reservation starts
        with the prompt's longest prefix already cached here (an earlier turn of the same
        conversation decoded on this worker); those blocks are not pulled."""
        prompt = list(req.prompt_token_ids)
        reuse = handle.layout == self.engine.layout
        try:
            return self.engine.reserve(req.request_id, prompt, req.sampling, reuse_prefix=reuse)
        except CapacityError:
            if not self.scheduler.evicts:
                raise
        if self.waiting_for_blocks >= self.scheduler.max_queued_requests:
            raise QueueFullError(f"{self.waiting_for_blocks} requests wait for KV blocks here")
        give_up = min(handle.lease_deadline, req.deadline) - 1.0
        self.waiting_for_blocks += 1
        try:
            delay = 0.005
            while time.time() + delay < give_up:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
                try:
                    return self.engine.reserve(
                        req.request_id, prompt, req.sampling, reuse_prefix=reuse
                    )
                except CapacityError:
                    continue
        finally:
            self.waiting_for_blocks -= 1
        raise QueueFullError(
            f"no free KV blocks for request {req.request_id} on this decode worker before its "
            "prefill lease ran out; retry later"
        )

    def _pull_failed(self, request_id: str, exc: BaseException) -> BaseException:
        """Dispose of a failed pull's destination blocks and return the error to raise.

        Refused before any byte was written, or (IntegrityError) checked after every byte had
        landed, or a backend that writes nothing once the pull ended (TCP into a CPU pool):
        nothing more can land, so the blocks go back at once, never used. Anything else
        (deadline, peer gone, cancellation with NIXL/UCX/CUDA staging) may leave a write in
        flight: quarantine them. A deadline becomes DeadlineExceededError.
        """
        settled = isinstance(exc, HandleError | LayoutMismatchError | IntegrityError)
        if settled or (self.transceiver is not None and not self.transceiver.late_writes):
            self.engine.unreserve(request_id)
        else:
            self._quarantine(request_id)
        if isinstance(exc, TimeoutError):
            return DeadlineExceededError(
                f"KV transfer for request {request_id} did not finish before its deadline"
            )
        return exc

    def migrate_all(self) -> int:
        """Drain migration: end every running stream (and any that starts from now on) with
        one in-band error chunk (:data:`DRAINING_ERROR`, on one of its unfinished choices) and
        abort its request in the engine, freeing its blocks, so the router continues it on
        another worker. A stream waiting for its next output wakes at once; the outputs already
        queued for it go out first. Returns how many streams were running. Event loop only."""
        self.draining = True
        for stream, request_id in list(self._streams.items()):
            stream.interrupt()
            self.engine.abort(request_id)
        if self._streams:
            log.info("draining: migrating %d running request(s) elsewhere", len(self._streams))
        return len(self._streams)

    async def chunks(
        self, req: GenerationRequest, stream: OutputStream
    ) -> AsyncIterator[GenerationChunk]:
        """State 4-5: the request's chunks until every choice finished. Aborts the request in
        the engine if the consumer goes away (client disconnect) or the deadline passes, and
        ends it with the draining error after :meth:`migrate_all`. The last chunk carries the
        phases of the stream's timeline (``stream.clock``), which ends here."""
        finished = False
        self._streams[stream] = req.request_id
        if self.draining:
            stream.interrupt()
        clock = stream.clock
        timeline = clock.timeline if clock is not None else None
        error: str | None = None
        try:
            async for out in _until(stream, req.deadline):
                finished = stream.done
                phases: dict[str, float] = {}
                if finished and clock is not None and timeline is not None:
                    clock.finish()
                    phases = timeline.durations()
                    error = out.error
                yield _chunk(req.request_id, out, phases)
        except TimeoutError:
            finished = True
            self.engine.abort(req.request_id)
            error = "deadline exceeded during decode"
            yield GenerationChunk(
                request_id=req.request_id, finish_reason=FinishReason.ERROR, error=error
            )
        except StreamInterrupted:
            finished = True
            self.engine.abort(req.request_id)
            error = _DRAINING_MESSAGE
            yield GenerationChunk(
                request_id=req.request_id,
                index=min(stream.unfinished),
                finish_reason=FinishReason.ERROR,
                error=error,
            )
        finally:
            self._streams.pop(stream, None)
            if not finished:
                self.engine.abort(req.request_id)
                error = "abandoned by the router"
            end_leg(timeline, error)


async def _until(stream: OutputStream, deadline: float) -> AsyncIterator[EngineOutput]:
    """``stream``'s outputs until every choice's final one; TimeoutError past ``deadline``."""
    while not stream.done:
        yield await stream.next(timeout=max(0.0, deadline - time.time()))


def _chunk(request_id: str, out: EngineOutput, phases: dict[str, float]) -> GenerationChunk:
    finish = out.finish_reason
    if out.error is not None:
        finish = FinishReason.ERROR
    return GenerationChunk(
        request_id=request_id,
        index=out.index,
        token_ids=tuple(out.token_ids),
        text=out.text,
        logprobs=tuple(out.logprobs),
        finish_reason=finish,
        error=out.error,
        error_code=out.error_code,
        cached_tokens=out.cached_tokens,
        prompt_logprobs=tuple(out.prompt_logprobs or ()),
        phases=phases,
    )


def add_generate_route(api: APIRouter) -> None:
    """``POST /internal/generate``: NDJSON :class:`GenerationChunk` lines (decode, colocated).
    A request with a handle resumes after a prefill worker's first token (decode only); one
    without runs the whole request here (colocated, or a decode worker prefilling locally)."""

    @api.post("/internal/generate")
    async def generate(req: GenerationRequest, request: Request) -> StreamingResponse:
        worker = service_of(request)
        req = capped(req, worker.cfg.engine.scheduler.max_request_s)
        decode: DecodeHandler = worker.handler
        timeline = leg_timeline(worker.role.value, worker.identity.worker_id, req)
        try:
            stream = await decode.admit(req, timeline)
        except BaseException as exc:
            end_leg(timeline, repr(exc))
            raise

        async def body() -> AsyncIterator[bytes]:
            async for chunk in decode.chunks(req, stream):
                yield chunk.model_dump_json().encode() + b"\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")


class DecodeWorker(TransferWorker):
    """Decode role: pulls the prefill worker's blocks into reserved blocks, streams tokens; a
    request without a handle (the router's local-prefill path) is prefilled here."""

    role: ClassVar[Role] = Role.DECODE

    def __init__(self, **parts: Any) -> None:
        super().__init__(**parts)
        self.handler = DecodeHandler(
            engine=self.engine,
            transceiver=self.transceiver,
            metrics=self.metrics,
            scheduler=self.cfg.engine.scheduler,
            transfer=self.cfg.transfer,
            prefills=self.peers,
            puller=self.puller,
        )

    def on_deregistered(self) -> None:
        """Drain (``worker.migrate_on_drain``): migrate the running streams elsewhere."""
        if self.cfg.worker.migrate_on_drain:
            self.handler.migrate_all()

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        super().add_role_routes(api)  # /internal/kv/lend
        add_generate_route(api)
