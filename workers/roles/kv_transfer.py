"""What the workers with a transceiver share (prefill, decode, colocated): the transceiver they
open over the engine's KV pool with its parked blocks, the discovery view they pull through,
the lending of prefix blocks to peers (:mod:`.lending`), the base class of such a worker, and
the deadline cap of every request leg.

The roles' own modules (:mod:`.prefill`, :mod:`.decode`, :mod:`.colocated`) build on it; the
parts every role shares (engine, registration, metrics, common routes) are
:class:`~pdserve.workers.roles.service.WorkerService`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request

from pdserve.kv_lend import LendRequest, LendResponse
from pdserve.protocol import ContextRequest, GenerationRequest
from pdserve.workers.roles.lending import Lender, PrefixPuller
from pdserve.workers.roles.parking import ParkedBlocks
from pdserve.workers.roles.prefill_directory import PrefillDirectory
from pdserve.workers.roles.service import (
    WatcherFactory,
    WorkerIdentity,
    WorkerService,
    service_of,
)

if TYPE_CHECKING:
    from pdserve.config.loading import WorkerConfig
    from pdserve.discovery import Registration
    from pdserve.transfer import Transceiver
    from pdserve.workers.engine.api import WorkerEngine

log = logging.getLogger(__name__)


async def open_transceiver(
    cfg: WorkerConfig,
    identity: WorkerIdentity,
    engine: WorkerEngine,
    parked: ParkedBlocks | None,
    stack: AsyncExitStack,
) -> Transceiver:
    """Create and start the worker's transceiver over the engine's pool; its close goes onto
    ``stack``. Raises ConfigError (unavailable backend, address in use)."""
    from pdserve.transfer import create_transceiver

    transceiver = create_transceiver(
        cfg.transfer,
        pool=engine.kv_cache.pool,
        layout=engine.layout,
        worker_id=identity.worker_id,
        epoch=identity.epoch,
        parked=parked,
        key=identity.key,  # the transceivers' challenge-response (transfer/connection/auth.py)
        advertise_host=cfg.worker.advertise_host,
    )
    stack.push_async_callback(_close_quietly, transceiver)
    await transceiver.start()
    log.info("transceiver: %s on %s", transceiver.backend, transceiver.endpoint)
    return transceiver


async def _close_quietly(transceiver: Transceiver) -> None:
    with contextlib.suppress(Exception):
        await transceiver.close()


async def open_transfer_parts(
    cfg: WorkerConfig,
    identity: WorkerIdentity,
    engine: WorkerEngine,
    stack: AsyncExitStack,
    watcher_factory: WatcherFactory,
) -> dict[str, Any]:
    """A transfer role's parts, as :class:`TransferWorker`'s constructor keywords (closes on
    ``stack``): the lender, the parked blocks (prefill results and lent prefixes, under
    ``kv_cache.lease_s`` leases), the discovery view its pulls go through, the transceiver."""
    lender = Lender(engine, cfg.engine.kv_cache.lease_s)
    parked = ParkedBlocks(
        epoch=identity.epoch,
        lease_s=cfg.engine.kv_cache.lease_s,
        free_blocks=lender.free,
        generations=engine.kv_cache.generations,  # fencing: no reused block is ever sent
        send_grace_s=cfg.transfer.timeout_s + 5.0,  # a send outlives no lease by more
    )
    parked.start()
    stack.push_async_callback(parked.close)
    peers = PrefillDirectory(watcher_factory(cfg, identity))
    await peers.start()
    stack.push_async_callback(peers.close)
    transceiver = await open_transceiver(cfg, identity, engine, parked, stack)
    return {"parked": parked, "lender": lender, "peers": peers, "transceiver": transceiver}


class TransferWorker(WorkerService):
    """A role with a transceiver (prefill, decode, colocated): built by :meth:`open` with the
    parts :func:`open_transfer_parts` makes; lends prefix blocks (``POST /internal/kv/lend``)
    and pulls lent ones (``puller``)."""

    def __init__(
        self,
        *,
        cfg: WorkerConfig,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        registration: Registration,
        parked: ParkedBlocks,
        lender: Lender,
        peers: PrefillDirectory,
        transceiver: Transceiver,
    ) -> None:
        self.parked = parked
        self.lender = lender
        self.peers = peers
        self.transceiver = transceiver
        super().__init__(cfg=cfg, identity=identity, engine=engine, registration=registration)
        self.metrics.add_kv_copies(transceiver.copies)  # staged / payload bytes
        self.puller = PrefixPuller(
            engine, transceiver, peers, quarantine_s=cfg.transfer.timeout_s, metrics=self.metrics
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
        return await open_transfer_parts(cfg, identity, engine, stack, watcher_factory)

    def communicator(self) -> dict[str, str]:
        return self.transceiver.communicator()

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        @api.post("/internal/kv/lend")
        async def lend(req: LendRequest, request: Request) -> LendResponse:
            """Lease the leading blocks of ``req.block_hashes`` this pool holds (peer prefix
            pull, :mod:`pdserve.workers.roles.lending`)."""
            worker: TransferWorker = service_of(request)
            return worker.lender.lend(
                req, worker.parked, worker.transceiver, worker.identity.worker_id
            )


_Leg = TypeVar("_Leg", ContextRequest, GenerationRequest)


def capped(req: _Leg, max_request_s: float) -> _Leg:
    """``req`` with its deadline (wall-clock UNIX seconds, the caller's) capped at now +
    ``max_request_s``: a caller cannot make a worker run a request for longer than that."""
    limit = time.time() + max_request_s
    return req if req.deadline <= limit else req.model_copy(update={"deadline": limit})
