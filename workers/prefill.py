"""Prefill (context) role: run the context phase, park the KV blocks, answer with a handle.

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

import logging
import time
from typing import TYPE_CHECKING

from pdserve.errors import DeadlineExceededError, WorkerError
from pdserve.protocol import ContextRequest, ContextResponse, TransferHandle
from pdserve.workers.bridge import OutputStream
from pdserve.workers.parking import ParkedBlocks
from pdserve.workers.requests import EngineRequest

if TYPE_CHECKING:
    from pdserve.transfer import Transceiver
    from pdserve.workers.engine_api import WorkerEngine

log = logging.getLogger(__name__)


class PrefillRole:
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
