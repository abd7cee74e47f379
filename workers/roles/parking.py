"""Parked KV blocks on the prefill worker: every hold has a lease, every handle is fenced.

After prefill, a request's KV blocks stay allocated in the prefill worker's pool until the decode
worker that pulls them releases them, or until the lease runs out, whichever comes first
(TensorRT-LLM's "context releases KV cache" step; Dynamo's deferred free).

Fencing: a decode worker names the parked blocks by ``(request_id, epoch, lease_id)``
and the block ids of its :class:`~pdserve.protocol.TransferHandle`. The lease id is a secret
(a ``uuid4``, 122 random bits, handed only to the router and the decode worker it picks): it is
compared in constant time and required by every release, and a refusal tells the peer only a
generic reason (never the lease id, block ids or epoch it expected; the worker logs the
details). :meth:`ParkedBlocks.lookup` refuses, with :class:`~pdserve.errors.HandleError`:

- another **epoch** (the worker restarted: its blocks of that incarnation are gone);
- an unknown **request** (never parked, released, or expired);
- another **lease id** (a handle of an earlier park of the same request id): each
  :meth:`~ParkedBlocks.park` issues a fresh ``uuid4`` lease id, binding the handle to that one
  allocation;
- an expired **lease** (wall clock past the deadline);
- a block whose **generation** moved: the KV cache manager bumps a block's generation at every
  allocation (an evicted prefix-cached block's reallocation included) and every return to the
  free list; a cached block keeps it while it waits, evictable, in the LRU or is shared by
  prefix hits (its K/V is unchanged); the generations are recorded at park time and compared at lookup,
  which the sender calls right before it starts the transfer, so a block freed (and perhaps
  reallocated to another request) can never be sent in place of the one the handle named.

(The sender also refuses block ids other than the parked ones, and the decode side refuses an
expired lease, another epoch and block ids outside the prefill pool before asking.)

Lifecycle of one parked request::

    1 PARKED     park() after the engine's prefill output; lease deadline = now + lease_s
    2 SENDING    lookup() by the transceiver (the deadline still applies to later lookups)
    3 RELEASED   release() by the decode side / router, or EXPIRED by the reaper; blocks freed once

A lease that runs out while its blocks are being sent is freed only when the send window
(``send_grace_s`` after the lookup, longer than a send may take) has passed, so the reaper never
returns to the pool a block a transfer is still reading. A release frees at once: the decode side
releases after the bytes arrived, the router after it abandoned the request (then the decode side
discards whatever it received).

Thread-safety: all methods run on the worker's event loop thread. Freeing calls
``free_blocks(request_id)`` (the engine's ``free_parked``), which is itself thread-safe;
``generations`` (the KV cache manager's) is thread-safe too.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.errors import HandleError

log = logging.getLogger(__name__)

_NOT_PARKED = "no KV blocks are parked under this handle (released, expired, or another park)"
"""The one refusal for an unknown request id and a wrong lease id alike: a peer cannot tell
which request ids exist."""

Generations = Callable[[Iterable[int]], tuple[int, ...]]
"""Current generation of each block id (``KVCacheManager.generations``)."""


@dataclass(frozen=True)
class Lease:
    """What :meth:`ParkedBlocks.park` issues: the lease id for the handle and its deadline
    (wall-clock UNIX seconds)."""

    lease_id: str
    deadline: float


@dataclass
class ParkedRequest:
    request_id: str
    lease_id: str
    block_ids: list[int]
    generations: tuple[int, ...] | None  # at park time; None when no generation source
    num_tokens: int
    deadline: float  # wall-clock UNIX seconds
    send_until: float = 0.0  # wall clock; a sender may read the blocks until then


class ParkedBlocks:
    """Lease table of parked requests; implements the transfer package's ``ParkedLookup``.

    Args:
        epoch: this worker's epoch; lookups naming another epoch are refused.
        lease_s: how long (seconds) parked blocks wait for their decode worker.
        free_blocks: called exactly once per parked request to return its blocks to the pool.
        generations: the KV cache manager's block generations (None: no reuse check, for
            tests of the lease logic alone).
        send_grace_s: how long (seconds) after a lookup the blocks may still be read by the
            sender; an expired lease is not freed before that (default: the default transfer
            timeout plus margin).
        clock: wall clock (seconds); injectable for tests.
    """

    def __init__(
        self,
        *,
        epoch: int,
        lease_s: float,
        free_blocks: Callable[[str], None],
        generations: Generations | None = None,
        send_grace_s: float = 35.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.epoch = epoch
        self.lease_s = lease_s
        self.send_grace_s = send_grace_s
        self._free_blocks = free_blocks
        self._generations = generations
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

    def park(self, request_id: str, block_ids: list[int], num_tokens: int) -> Lease:
        """Take ownership of ``block_ids`` under a new lease (records their generations).
        Raises HandleError when ``request_id`` is already parked."""
        if request_id in self._parked:
            raise HandleError(f"request {request_id!r} is already parked")
        gens = self._generations(block_ids) if self._generations is not None else None
        lease = Lease(lease_id=uuid.uuid4().hex, deadline=self._clock() + self.lease_s)
        self._parked[request_id] = ParkedRequest(
            request_id, lease.lease_id, list(block_ids), gens, num_tokens, lease.deadline
        )
        return lease

    def lookup(self, request_id: str, epoch: int, lease_id: str) -> list[int]:
        """Block ids of a parked request, for sending now. Raises HandleError when the epoch is
        not this worker's, the request is unknown (never parked, released, or expired), the
        lease id is not the current park's, the lease ran out, or a block changed hands since
        the park (see the module docstring).

        The lease id is a secret (whoever holds it may read the request's KV, from which the
        prompt can be recovered): it is compared in constant time, and the refusals are generic,
        so a peer learns neither the current lease id, nor the block ids, nor this worker's
        epoch, nor whether the request id exists; the worker's own log has the details."""
        if epoch != self.epoch:
            log.warning(
                "refused a lookup of request %s: it names epoch %d, this worker is epoch %d",
                request_id,
                epoch,
                self.epoch,
            )
            raise HandleError(
                "the handle names another epoch of this prefill worker (it restarted; the KV "
                "blocks are gone)"
            )
        parked = self._find(request_id, lease_id)
        if parked is None:
            raise HandleError(_NOT_PARKED)
        now = self._clock()
        if now > parked.deadline:
            self._expire(parked, now)
            raise HandleError("the lease of the handle's KV blocks expired before the transfer")
        self._check_generations(parked)
        parked.send_until = max(parked.send_until, now + self.send_grace_s)
        return list(parked.block_ids)

    def release(self, request_id: str, lease_id: str) -> bool:
        """Free a parked request's blocks if ``lease_id`` is the current park's (compared in
        constant time; the lease id is what proves the caller was handed the blocks).
        Idempotent: returns False when nothing (or another park) was parked."""
        parked = self._find(request_id, lease_id)
        if parked is None:
            return False
        self._free(parked)
        return True

    def _find(self, request_id: str, lease_id: str) -> ParkedRequest | None:
        """The park of ``request_id`` if ``lease_id`` is its lease (constant-time compare), else
        None (logged with a short prefix of the offered lease id only)."""
        parked = self._parked.get(request_id)
        if parked is not None and hmac.compare_digest(lease_id.encode(), parked.lease_id.encode()):
            return parked
        log.warning(
            "refused request %s under lease %.6s...: %s",
            request_id,
            lease_id,
            "another park holds it" if parked is not None else "nothing is parked for it",
        )
        return None

    def _free(self, parked: ParkedRequest) -> None:
        del self._parked[parked.request_id]
        self._free_blocks(parked.request_id)
        self.released_total += 1

    def reap(self) -> int:
        """Free every request whose lease ran out (and whose send window closed); returns how
        many."""
        now = self._clock()
        expired = [p for p in self._parked.values() if now > p.deadline]
        return sum(self._expire(p, now) for p in expired)

    def start(self, interval_s: float = 0.5) -> None:
        """Start the reaper task on the running event loop."""

        async def _loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                self.reap()

        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(_loop(), name="parked-reaper")

    async def close(self) -> None:
        """Stop the reaper and free everything still parked. Idempotent. (The transceiver is
        closed first, so no send is reading the blocks any more.)"""
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
            self._reaper = None
        for parked in list(self._parked.values()):
            self._free(parked)

    def _check_generations(self, parked: ParkedRequest) -> None:
        if self._generations is None or parked.generations is None:
            return
        now = self._generations(parked.block_ids)
        for block, then, current in zip(parked.block_ids, parked.generations, now, strict=True):
            if then != current:
                log.error(
                    "parked KV block %d of request %s changed hands (generation %d -> %d)",
                    block,
                    parked.request_id,
                    then,
                    current,
                )
                raise HandleError(
                    "a KV block of the handle was freed or reallocated since it was parked; "
                    "refusing to send it"
                )

    def _expire(self, parked: ParkedRequest, now: float) -> bool:
        """Free an expired request unless a send may still read its blocks; True if freed."""
        if now < parked.send_until:
            return False
        if self._parked.pop(parked.request_id, None) is None:
            return False
        self._free_blocks(parked.request_id)
        self.expired_total += 1
        log.warning(
            "lease expired for request %s: freed %d parked KV blocks (no decode worker pulled them)",
            parked.request_id,
            len(parked.block_ids),
        )
        return True
