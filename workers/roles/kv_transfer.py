"""What the prefill and decode workers share: the transceiver they open over the engine's KV
pool, the base class of a worker that has one, and the deadline cap of every request leg.

The roles' own modules (:mod:`.prefill`, :mod:`.decode`, :mod:`.colocated`) build on it; the
parts every role shares (engine, registration, metrics, common routes) are
:class:`~pdserve.workers.roles.service.WorkerService`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, TypeVar

from pdserve.protocol import ContextRequest, GenerationRequest
from pdserve.workers.roles.parking import ParkedBlocks
from pdserve.workers.roles.service import WorkerIdentity, WorkerService

if TYPE_CHECKING:
    from pdserve.config.loading import WorkerConfig
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


class TransferWorker(WorkerService):
    """A role with a transceiver (prefill, decode): built by :meth:`open` with its parts."""

    transceiver: Transceiver

    def communicator(self) -> dict[str, str]:
        return self.transceiver.communicator()


_Leg = TypeVar("_Leg", ContextRequest, GenerationRequest)


def capped(req: _Leg, max_request_s: float) -> _Leg:
    """``req`` with its deadline (wall-clock UNIX seconds, the caller's) capped at now +
    ``max_request_s``: a caller cannot make a worker run a request for longer than that."""
    limit = time.time() + max_request_s
    return req if req.deadline <= limit else req.model_copy(update={"deadline": limit})
