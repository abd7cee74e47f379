"""Prefill (context) role: run the context phase, park the KV blocks, answer with a handle.

:class:`PrefillWorker` is the process (its parts and routes: ``POST /internal/context``,
``POST /internal/release``); :class:`PrefillHandler` is the request logic below.

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
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import APIRouter, Request

from pdserve.errors import DeadlineExceededError, WorkerError
from pdserve.protocol import ContextRequest, ContextResponse, ReleaseRequest, Role, TransferHandle
from pdserve.workers.engine.requests import EngineRequest
from pdserve.workers.roles.bridge import OutputStream
from pdserve.workers.roles.parking import ParkedBlocks
from pdserve.workers.roles.service import WatcherFactory, WorkerIdentity, service_of
from pdserve.workers.roles.transfer_worker import TransferWorker, capped, open_transceiver

if TYPE_CHECKING:
    from pdserve.config import WorkerConfig
    from pdserve.discovery import Registration
    from pdserve.discovery.events import ParkedCounts
    from pdserve.transfer import Transceiver
    from pdserve.workers.engine.api import WorkerEngine

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
    ) -> None:
        self.engine = engine
        self.transceiver = transceiver
        self.parked = parked
        self.worker_id = worker_id

    async def context(self, req: ContextRequest) -> ContextResponse:
        """Run prefill for ``req``. Raises DeadlineExceededError, InvalidRequestError (from the
        engine's validation), CapacityError, or WorkerError when the engine fails the request."""
        remaining = req.deadline - time.time()
        if remaining <= 0:
            raise DeadlineExceededError(f"request {req.request_id} arrived after its deadline")
        if req.sampling.structured is not None:  # compiled off the event loop and engine step
            await asyncio.to_thread(self.engine.prepare_grammar, req.sampling)
        stream = OutputStream(single=True)
        self.engine.add_request(EngineRequest.for_leg(req, "prefill"), stream.sink)
        try:
            out = await stream.next(timeout=remaining)
        except TimeoutError:
            self.engine.abort(req.request_id)
            raise DeadlineExceededError(
                f"prefill of request {req.request_id} did not finish before its deadline"
            ) from None
        if out.error is not None:
            raise WorkerError(f"prefill failed for request {req.request_id}: {out.error}")
        handle = None if out.parked_block_ids is None else self._park(req, out.parked_block_ids)
        return ContextResponse(
            request_id=req.request_id,
            first_token=out.token_ids[0],
            text=out.text,
            logprob=out.logprobs[0] if out.logprobs else None,
            finish_reason=out.finish_reason,
            handle=handle,
            cached_tokens=out.cached_tokens or 0,
            prompt_logprobs=tuple(out.prompt_logprobs or ()),
        )

    def _park(self, req: ContextRequest, block_ids: list[int]) -> TransferHandle:
        """Park ``block_ids`` under a new lease; the handle a decode worker pulls them with."""
        lease = self.parked.park(req.request_id, block_ids, len(req.prompt_token_ids))
        handle = TransferHandle(
            worker_id=self.worker_id,
            epoch=self.parked.epoch,
            request_id=req.request_id,
            lease_id=lease.lease_id,
            block_ids=tuple(block_ids),
            num_tokens=len(req.prompt_token_ids),
            lease_deadline=lease.deadline,
            layout=self.engine.layout,
            backend=self.transceiver.backend,
            transfer_endpoint=self.transceiver.endpoint,
        )
        log.debug(
            "request %s parked %d KV blocks until %.1f",
            req.request_id,
            len(handle.block_ids),
            lease.deadline,
        )
        return handle

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

    def __init__(
        self,
        *,
        cfg: WorkerConfig,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        registration: Registration,
        parked: ParkedBlocks,
        transceiver: Transceiver,
    ) -> None:
        self.parked = parked
        self.transceiver = transceiver
        super().__init__(cfg=cfg, identity=identity, engine=engine, registration=registration)
        self.metrics.add_kv_copies(transceiver.copies)  # staged / payload bytes
        self.handler = PrefillHandler(
            engine=engine, transceiver=transceiver, parked=parked, worker_id=identity.worker_id
        )

    @classmethod
    async def open_parts(
        cls,
        cfg: WorkerConfig,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        stack: AsyncExitStack,
        *,
        watcher_factory: WatcherFactory,
    ) -> dict[str, Any]:
        parked = ParkedBlocks(
            epoch=identity.epoch,
            lease_s=cfg.engine.kv_cache.lease_s,
            free_blocks=engine.free_parked,
            generations=engine.kv_cache.generations,  # fencing: no reused block is ever sent
            send_grace_s=cfg.transfer.timeout_s + 5.0,  # a send outlives no lease by more
        )
        parked.start()
        stack.push_async_callback(parked.close)
        transceiver = await open_transceiver(cfg, identity, engine, parked, stack)
        return {"parked": parked, "transceiver": transceiver}

    def parked_count(self) -> int:
        return len(self.parked)

    def leases_expired(self) -> int:
        return self.parked.expired_total

    def kv_counts(self) -> ParkedCounts | None:
        return self.parked

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
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

        @api.post("/internal/release")
        async def release(req: ReleaseRequest, request: Request) -> dict[str, bool]:
            worker: PrefillWorker = service_of(request)
            return {"released": worker.handler.release(req.request_id, req.epoch, req.lease_id)}
