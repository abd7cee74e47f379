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

Streamed hand-off (a handle published at admission, ``/internal/context/stream``): 0 STREAMING
comes first. :meth:`ParkedBlocks.open_stream` issues the lease id before the prefill starts;
:meth:`~ParkedBlocks.stream_progress` records the blocks each prefill chunk completed (still
the engine's, with their generations then); :meth:`~ParkedBlocks.wait_streamed`, which the
sender calls, returns them as they come; :meth:`~ParkedBlocks.park` with the stream's lease id
takes the blocks over at the end (PARKED, as above) and :meth:`~ParkedBlocks.finish_stream`
records the first token; :meth:`~ParkedBlocks.fail_stream` ends it when the prefill failed
(the waiting sender answers TransferFailed). A block sent while the engine still owned it must
be the one parked at the end, with the generation it had when it was reported (else the last
answer is refused: a preempted prefill's blocks were freed and reused meanwhile).

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
from dataclasses import dataclass, field

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


@dataclass
class _Stream:
    """A prefill in progress whose handle went out at admission (streamed hand-off)."""

    request_id: str
    lease_id: str
    deadline: float  # wall clock: the request's deadline
    ready: list[int] = field(default_factory=list)  # complete blocks, in token order
    generations: tuple[int, ...] = ()  # of ``ready``, when reported
    done: bool = False
    first_token: int | None = None
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        """Wake the waiters (they re-read the state), then arm a fresh event."""
        self.changed.set()
        self.changed = asyncio.Event()


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
        self._streams: dict[str, _Stream] = {}
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
        """Take ownership of ``block_ids`` under a new lease (records their generations); a
        streamed request keeps the lease id :meth:`open_stream` issued. Raises HandleError
        when ``request_id`` is already parked."""
        if request_id in self._parked:
            raise HandleError(f"request {request_id!r} is already parked")
        gens = self._generations(block_ids) if self._generations is not None else None
        stream = self._streams.get(request_id)
        lease_id = stream.lease_id if stream is not None else uuid.uuid4().hex
        lease = Lease(lease_id=lease_id, deadline=self._clock() + self.lease_s)
        self._parked[request_id] = ParkedRequest(
            request_id, lease.lease_id, list(block_ids), gens, num_tokens, lease.deadline
        )
        return lease

    def open_stream(self, request_id: str, deadline: float) -> Lease:
        """Streamed hand-off, at admission: issue the lease id the request's blocks will be
        parked under, valid until ``deadline`` (wall clock, the request's) while the prefill
        runs. Raises HandleError when ``request_id`` is already parked or streaming."""
        if request_id in self._parked or request_id in self._streams:
            raise HandleError(f"request {request_id!r} is already parked")
        lease = Lease(lease_id=uuid.uuid4().hex, deadline=deadline)
        self._streams[request_id] = _Stream(request_id, lease.lease_id, deadline)
        return lease

    def stream_progress(self, request_id: str, ready: list[int]) -> None:
        """Record that ``ready`` (the request's leading blocks, in token order) hold their
        final K/V now (a prefill chunk completed them); wakes the waiting sender."""
        stream = self._streams.get(request_id)
        if stream is None or stream.done or len(ready) <= len(stream.ready):
            return
        gens = self._generations(ready) if self._generations is not None else ()
        stream.ready, stream.generations = list(ready), gens
        stream.wake()

    def finish_stream(self, request_id: str, first_token: int) -> None:
        """The prefill finished and :meth:`park` took the blocks: the sender sends the rest
        and ``first_token``."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.done, stream.first_token = True, first_token
            stream.wake()

    def fail_stream(self, request_id: str, why: str) -> None:
        """The prefill failed, was aborted or needs no decode leg: the waiting sender answers
        TransferFailed (``why``, generic enough for a peer); idempotent. The blocks stay the
        engine's (or, if parked, the park's)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.error = why
            stream.wake()

    async def wait_streamed(
        self,
        request_id: str,
        epoch: int,
        lease_id: str,
        have: int,
        *,
        whole: bool,
        timeout: float,
    ) -> tuple[list[int], bool, int | None] | None:
        """Sender side of a streamed pull: ``(block ids so far, done, first token)`` once more
        than ``have`` blocks are complete (``whole``: once the prefill finished), or None after
        ``timeout`` seconds without news. When done, the ids are the park's (:meth:`lookup`'s
        fencing, and the blocks sent earlier must be parked with the generation they had
        then). Raises HandleError (refusals as :meth:`lookup`'s; the prefill failed; the
        request's deadline passed)."""
        self._check_epoch(request_id, epoch)
        stream = self._streams.get(request_id)
        if stream is None or not hmac.compare_digest(lease_id.encode(), stream.lease_id.encode()):
            log.warning("refused a streamed pull of request %s: no such stream", request_id)
            raise HandleError(_NOT_PARKED)
        if stream.error is None and not stream.done and (whole or len(stream.ready) <= have):
            left = min(timeout, stream.deadline - self._clock())
            if left <= 0:
                raise HandleError("the request's deadline passed before its prefill finished")
            changed = stream.changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return None
        if stream.error is not None:
            raise HandleError(
                f"the prefill of this request ended without KV to send: {stream.error}"
            )
        if stream.done:
            ids = self.lookup(request_id, epoch, lease_id)
            self._check_streamed(stream, ids)
            return ids, True, stream.first_token
        if whole or len(stream.ready) <= have:
            return None
        self._check_ready(stream)
        return list(stream.ready), False, None

    def _check_ready(self, stream: _Stream) -> None:
        if self._generations is not None and self._generations(stream.ready) != stream.generations:
            log.error("a streamed KV block of request %s changed hands", stream.request_id)
            raise HandleError("a KV block of the request was freed before it could be sent")

    def _check_streamed(self, stream: _Stream, parked: list[int]) -> None:
        """The blocks streamed before the park are the park's leading ones, unchanged."""
        sent = stream.ready
        same = parked[: len(sent)] == sent
        if same and self._generations is not None and sent:
            same = self._generations(sent) == stream.generations
        if not same:
            log.error("streamed KV blocks of request %s changed before the park", stream.request_id)
            raise HandleError("KV blocks sent during the prefill were freed before it finished")

    def _check_epoch(self, request_id: str, epoch: int) -> None:
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

    def lookup(self, request_id: str, epoch: int, lease_id: str) -> list[int]:
        """Block ids of a parked request, for sending now. Raises HandleError when the epoch is
        not this worker's, the request is unknown (never parked, released, or expired), the
        lease id is not the current park's, the lease ran out, or a block changed hands since
        the park (see the module docstring).

        The lease id is a secret (whoever holds it may read the request's KV, from which the
        prompt can be recovered): it is compared in constant time, and the refusals are generic,
        so a peer learns neither the current lease id, nor the block ids, nor this worker's
        epoch, nor whether the request id exists; the worker's own log has the details."""
        self._check_epoch(request_id, epoch)
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
        self.fail_stream(parked.request_id, "released")
        self._free_blocks(parked.request_id)
        self.released_total += 1

    def reap(self) -> int:
        """Free every request whose lease ran out (and whose send window closed); returns how
        many."""
        now = self._clock()
        for stream in [s for s in self._streams.values() if not s.done and now > s.deadline]:
            self.fail_stream(stream.request_id, "deadline passed")  # its handler aborts it
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
        for request_id in list(self._streams):
            self.fail_stream(request_id, "worker shutting down")

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
        self.fail_stream(parked.request_id, "lease expired")
        self._free_blocks(parked.request_id)
        self.expired_total += 1
        log.warning(
            "lease expired for request %s: freed %d parked KV blocks (no decode worker pulled them)",
            parked.request_id,
            len(parked.block_ids),
        )
        return True
