"""Parked KV blocks on the prefill worker: every hold has a lease.

After prefill, a request's KV blocks stay allocated in the prefill worker's pool until the decode
worker that pulls them releases them, or until the lease runs out, whichever comes first
(TensorRT-LLM's "context releases KV cache" step; Dynamo's deferred free). A decode worker names
the parked request by ``(request_id, epoch)``; an unknown id, another epoch or an expired lease
is refused with :class:`~pdserve.errors.HandleError`.

Lifecycle of one parked request::

    1 PARKED     park() after the engine's prefill output; lease deadline = now + lease_s
    2 SENDING    lookup() by the transceiver (the deadline still applies)
    3 RELEASED   release() by the decode side / router, or EXPIRED by the reaper; blocks freed once

Thread-safety: all methods run on the worker's event loop thread. Freeing calls
``free_blocks(request_id)`` (the engine's ``free_parked``), which is itself thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import HandleError

log = logging.getLogger(__name__)


@dataclass
class ParkedRequest:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    deadline: float  # wall-clock UNIX seconds
    sending: bool = False


class ParkedBlocks:
    """Lease table of parked requests; implements the transfer package's ``ParkedLookup``.

    Args:
        epoch: this worker's epoch; lookups naming another epoch are refused.
        lease_s: how long (seconds) parked blocks wait for their decode worker.
        free_blocks: called exactly once per parked request to return its blocks to the pool.
        clock: wall clock (seconds); injectable for tests.
    """

    def __init__(
        self,
        *,
        epoch: int,
        lease_s: float,
        free_blocks: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.epoch = epoch
        self.lease_s = lease_s
        self._free_blocks = free_blocks
        self._clock = clock
        self._parked: dict[str, ParkedRequest] = {}
        self._reaper: asyncio.Task[None] | None = None
        self.expired_total = 0
        self.released_total = 0

    def __len__(self) -> int:
        return len(self._parked)

    @property
    def num_blocks(self) -> int:
        """Blocks currently held under a lease."""
        return sum(len(p.block_ids) for p in self._parked.values())

    def park(self, request_id: str, block_ids: list[int], num_tokens: int) -> float:
        """Take ownership of ``block_ids`` under a new lease; returns the deadline (UNIX s)."""
        if request_id in self._parked:
            raise HandleError(f"request {request_id!r} is already parked")
        deadline = self._clock() + self.lease_s
        self._parked[request_id] = ParkedRequest(request_id, list(block_ids), num_tokens, deadline)
        return deadline

    def lookup(self, request_id: str, epoch: int) -> list[int]:
        """Block ids of a parked request, for sending. Raises HandleError when the epoch is not
        this worker's, the id is unknown (never parked, released, or expired), or the lease ran out.
        """
        if epoch != self.epoch:
            raise HandleError(
                f"handle for request {request_id!r} names epoch {epoch}, but this prefill worker "
                f"is epoch {self.epoch} (it restarted; the KV blocks are gone)"
            )
        parked = self._parked.get(request_id)
        if parked is None:
            raise HandleError(
                f"request {request_id!r} has no parked KV blocks (released or expired)"
            )
        if self._clock() > parked.deadline:
            self._expire(parked)
            raise HandleError(f"lease of request {request_id!r} expired before the transfer")
        parked.sending = True
        return list(parked.block_ids)

    def release(self, request_id: str) -> bool:
        """Free a parked request's blocks. Idempotent: returns False when nothing was parked."""
        parked = self._parked.pop(request_id, None)
        if parked is None:
            return False
        self._free_blocks(request_id)
        self.released_total += 1
        return True

    def _expire(self, parked: ParkedRequest) -> None:
        if self._parked.pop(parked.request_id, None) is not None:
            self._free_blocks(parked.request_id)
            self.expired_total += 1
            log.warning(
                "lease expired for request %s: freed %d parked KV blocks (no decode worker pulled them)",
                parked.request_id,
                len(parked.block_ids),
            )

    def reap(self) -> int:
        """Free every request whose lease ran out; returns how many."""
        now = self._clock()
        expired = [p for p in self._parked.values() if now > p.deadline]
        for p in expired:
            self._expire(p)
        return len(expired)

    def start(self, interval_s: float = 0.5) -> None:
        """Start the reaper task on the running event loop."""

        async def _loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                self.reap()

        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(_loop(), name="parked-reaper")

    async def close(self) -> None:
        """Stop the reaper and free everything still parked. Idempotent."""
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
            self._reaper = None
        for request_id in list(self._parked):
            self.release(request_id)
