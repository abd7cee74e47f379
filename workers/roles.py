"""One class per worker role, each with the parts it needs (no optional fields) and its own
routes; the shared parts are :class:`~pdserve.workers.service.WorkerService`.

========== ======================================== =============================================
role       parts                                    routes (besides the common ones)
========== ======================================== =============================================
prefill    engine, parked-block table, transceiver  ``POST /internal/context``,
                                                    ``POST /internal/release``
decode     engine, transceiver                      ``POST /internal/generate`` (with a handle,
                                                    or without: local prefill)
colocated  engine                                   ``POST /internal/generate`` (no handle)
========== ======================================== =============================================

Decode and colocated workers share one ``/internal/generate`` (:func:`_add_generate_route` over
:class:`~pdserve.workers.decode.DecodeRole`): with a handle the worker pulls the prefill
worker's blocks and resumes; without one the engine prefills the prompt itself (mode ``full``)
and decodes. That is how a decode worker serves the router's *local prefill* path
(conditional disaggregation, :func:`pdserve.router.policy.choose_route`): the same engine call
as a colocated worker's, no second implementation.

A route of another role is not registered: it answers 404. Every ``/internal/*`` route needs the
cluster key's bearer token (the router's :class:`~pdserve.router.client.WorkerClient` sends it;
401 otherwise): the routes are added to the router :func:`~pdserve.workers.app.create_worker_app`
guards with :func:`~pdserve.discovery.registry.internal_route_class`. The request logic lives in
:class:`~pdserve.workers.prefill.PrefillRole` and :class:`~pdserve.workers.decode.DecodeRole`
(their module docstrings give the request lifecycles); the classes here wire them to HTTP.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from pdserve.protocol import (
    ContextRequest,
    ContextResponse,
    GenerationRequest,
    ReleaseRequest,
    Role,
)
from pdserve.workers.decode import DecodeRole
from pdserve.workers.parking import ParkedBlocks
from pdserve.workers.prefill import PrefillRole
from pdserve.workers.prefill_directory import PrefillDirectory
from pdserve.workers.service import (
    RoleSettings,
    WatcherFactory,
    WorkerIdentity,
    WorkerService,
    service_of,
)

if TYPE_CHECKING:
    from pdserve.discovery import Registration
    from pdserve.discovery.events import ParkedCounts
    from pdserve.transfer import Transceiver
    from pdserve.workers.engine_api import WorkerEngine

log = logging.getLogger(__name__)


async def open_transceiver(
    settings: RoleSettings,
    identity: WorkerIdentity,
    engine: WorkerEngine,
    parked: ParkedBlocks | None,
    stack: AsyncExitStack,
) -> Transceiver:
    """Create and start the worker's transceiver over the engine's pool; its close goes onto
    ``stack``. Raises ConfigError (unavailable backend, address in use)."""
    from pdserve.transfer import create_transceiver

    transceiver = create_transceiver(
        settings.transfer,
        pool=engine.kv_cache.pool,
        layout=engine.layout,
        worker_id=identity.worker_id,
        epoch=identity.epoch,
        parked=parked,
        key=settings.cluster_key,  # the transceivers' challenge-response (transfer/auth.py)
        advertise_host=settings.advertise_host,
    )
    stack.push_async_callback(_close_quietly, transceiver)
    await transceiver.start()
    log.info("transceiver: %s on %s", transceiver.backend, transceiver.endpoint)
    return transceiver


async def _close_quietly(transceiver: Transceiver) -> None:
    with contextlib.suppress(Exception):
        await transceiver.close()


class _TransferRole(WorkerService):
    """A role with a transceiver (prefill, decode): built by :meth:`open` with its parts."""

    transceiver: Transceiver

    def communicator(self) -> dict[str, str]:
        return self.transceiver.communicator()


class PrefillWorker(_TransferRole):
    """Prefill role: runs the context phase, parks the blocks under a lease, serves pulls."""

    role: ClassVar[Role] = Role.PREFILL

    def __init__(
        self,
        *,
        settings: RoleSettings,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        registration: Registration,
        parked: ParkedBlocks,
        transceiver: Transceiver,
    ) -> None:
        self.parked = parked
        self.transceiver = transceiver
        super().__init__(
            settings=settings, identity=identity, engine=engine, registration=registration
        )
        self.handler = PrefillRole(
            engine=engine, transceiver=transceiver, parked=parked, worker_id=identity.worker_id
        )

    @classmethod
    async def open_parts(
        cls,
        settings: RoleSettings,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        stack: AsyncExitStack,
        *,
        watcher_factory: WatcherFactory,
    ) -> dict[str, Any]:
        parked = ParkedBlocks(
            epoch=identity.epoch,
            lease_s=settings.lease_s,
            free_blocks=engine.free_parked,
            generations=engine.kv_cache.generations,  # fencing: no reused block is ever sent
            send_grace_s=settings.transfer_timeout_s + 5.0,  # a send outlives no lease by more
        )
        parked.start()
        stack.push_async_callback(parked.close)
        transceiver = await open_transceiver(settings, identity, engine, parked, stack)
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
            req = capped(req, worker.settings.max_request_s)
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


_Leg = TypeVar("_Leg", ContextRequest, GenerationRequest)


def capped(req: _Leg, max_request_s: float) -> _Leg:
    """``req`` with its deadline (wall-clock UNIX seconds, the caller's) capped at now +
    ``max_request_s``: a caller cannot make a worker run a request for longer than that."""
    limit = time.time() + max_request_s
    return req if req.deadline <= limit else req.model_copy(update={"deadline": limit})


def _add_generate_route(api: APIRouter) -> None:
    """``POST /internal/generate``: NDJSON :class:`GenerationChunk` lines (decode, colocated).
    A request with a handle resumes after a prefill worker's first token (decode only); one
    without runs the whole request here (colocated, or a decode worker prefilling locally)."""

    @api.post("/internal/generate")
    async def generate(req: GenerationRequest, request: Request) -> StreamingResponse:
        worker = service_of(request)
        req = capped(req, worker.settings.max_request_s)
        decode: DecodeRole = worker.handler
        stream = await decode.admit(req)

        async def body() -> AsyncIterator[bytes]:
            async for chunk in decode.chunks(req, stream):
                yield chunk.model_dump_json().encode() + b"\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")


def _decode_role(
    settings: RoleSettings,
    engine: WorkerEngine,
    transceiver: Transceiver | None,
    metrics: Any,
    prefills: PrefillDirectory | None = None,
) -> DecodeRole:
    return DecodeRole(
        engine=engine,
        transceiver=transceiver,
        prefills=prefills,
        quarantine_s=settings.transfer_timeout_s,
        metrics=metrics,
        max_queued_requests=settings.max_queued_requests,
        evicts=settings.evicts,
    )


class DecodeWorker(_TransferRole):
    """Decode role: pulls the prefill worker's blocks into reserved blocks, streams tokens; a
    request without a handle (the router's local-prefill path) is prefilled here."""

    role: ClassVar[Role] = Role.DECODE

    def __init__(
        self,
        *,
        settings: RoleSettings,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        registration: Registration,
        transceiver: Transceiver,
        prefills: PrefillDirectory,
    ) -> None:
        self.transceiver = transceiver
        super().__init__(
            settings=settings, identity=identity, engine=engine, registration=registration
        )
        self.handler = _decode_role(settings, engine, transceiver, self.metrics, prefills)

    @classmethod
    async def open_parts(
        cls,
        settings: RoleSettings,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        stack: AsyncExitStack,
        *,
        watcher_factory: WatcherFactory,
    ) -> dict[str, Any]:
        prefills = PrefillDirectory(watcher_factory(settings))
        await prefills.start()
        stack.push_async_callback(prefills.close)
        transceiver = await open_transceiver(settings, identity, engine, None, stack)
        return {"transceiver": transceiver, "prefills": prefills}

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        _add_generate_route(api)


class ColocatedWorker(WorkerService):
    """Colocated baseline: prefill and decode in one engine, no KV transfer."""

    role: ClassVar[Role] = Role.COLOCATED

    def __init__(
        self,
        *,
        settings: RoleSettings,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        registration: Registration,
    ) -> None:
        super().__init__(
            settings=settings, identity=identity, engine=engine, registration=registration
        )
        self.handler = _decode_role(settings, engine, None, self.metrics)

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        _add_generate_route(api)


WORKER_CLASSES: dict[Role, type[WorkerService]] = {
    Role.PREFILL: PrefillWorker,
    Role.DECODE: DecodeWorker,
    Role.COLOCATED: ColocatedWorker,
}
"""The service class of each role."""
