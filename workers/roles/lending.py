"""Peer prefix pull: the KV blocks of a prompt's prefix travel from a worker that holds them to
the worker that prefills the prompt, over the transfer plane, instead of being recomputed.

The same machinery as the prefill hand-off (the seed's Transceiver, leases, epochs, digests),
pointed at a prefix cache instead of a finished prefill; vLLM's P2P KV connectors, LMCache's
peer sharing and Dynamo's KV-aware router solve the same problem. The flow:

1. The router's KV index shows worker X holding, in its device pool, more of the prompt's
   leading blocks than the worker S that will prefill it, by at least
   ``router.peer_pull_min_tokens`` (the decision and its cost model:
   :mod:`pdserve.router.peer_pull`).
2. Router -> X, ``POST /internal/kv/lend`` (:class:`~pdserve.kv_lend.LendRequest`, the
   prompt's block hashes): :meth:`Lender.lend` pins the leading run X's pool holds
   (:meth:`~pdserve.workers.engine.scheduler.Scheduler.lend`) and parks it exactly as a
   prefill result is parked (:class:`~pdserve.workers.roles.parking.ParkedBlocks`: a fresh
   lease id, the epoch, generation fencing), answering the
   :class:`~pdserve.protocol.TransferHandle`.
3. Router -> S: the leg's request carries the handle as ``prefix``. :meth:`PrefixPuller.take`
   checks that discovery lists X at that epoch and endpoint
   (:class:`~pdserve.workers.roles.prefill_directory.PrefillDirectory`, any role), reserves
   blocks for the prefix here (starting with what this pool caches already: those are not
   sent), pulls the rest, and adopts them
   (:meth:`~pdserve.workers.engine.scheduler.Scheduler.adopt`): their full blocks join this
   worker's prefix cache under the same hashes. The request is then admitted as any other; the
   prefix is a cache hit (``usage.prompt_tokens_details.cached_tokens`` counts it).
4. X unpins the blocks when the pull releases them, or when the lease runs out.

Anything that fails in 2 or 3 (X gone or restarted, the blocks evicted, the lease expired, a
refused handle, a timeout, a digest mismatch, no free blocks here) costs the recompute of the
prefix, never the request: it is logged and counted
(``pdserve_kv_peer_prefix_pulls_total{outcome}``).

Thread-safety: the worker's event loop thread; the scheduler calls are thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pdserve.errors import (
    CapacityError,
    HandleError,
    IntegrityError,
    InvalidRequestError,
    LayoutMismatchError,
    PdserveError,
)
from pdserve.kv_lend import LendRequest, LendResponse
from pdserve.protocol import Role, SamplingParams, TransferHandle

if TYPE_CHECKING:
    from pdserve.transfer import Transceiver
    from pdserve.workers.engine.api import WorkerEngine
    from pdserve.workers.roles.parking import ParkedBlocks
    from pdserve.workers.roles.prefill_directory import PrefillDirectory
    from pdserve.workers.roles.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)

LEND_PREFIX = "lend:"
"""How a lent prefix's park is named (``lend:`` + the router's lend id): never a request id a
worker runs (those are the router's ids, which carry no colon prefix of this kind)."""

ANY_ROLE = (Role.PREFILL, Role.DECODE, Role.COLOCATED)
"""The roles a prefix may be pulled from: every worker with a transceiver lends."""


class Lender:
    """The lending side: pins and parks the prefix blocks a :class:`LendRequest` names.

    ``engine``: this worker's (its scheduler pins the blocks); ``lease_s``: the longest a lent
    prefix stays pinned (the request's deadline may end it sooner). :meth:`free` is the
    ``free_blocks`` of the worker's :class:`ParkedBlocks`: a lent park is unpinned, any other
    (a prefill result) goes to ``engine.free_parked``."""

    def __init__(self, engine: WorkerEngine, lease_s: float) -> None:
        self.engine = engine
        self.lease_s = lease_s
        self.lent = 0
        self._holding: set[str] = set()

    def free(self, park_id: str) -> None:
        """Release a park's blocks: a lend's references, or a prefill result's blocks."""
        if park_id in self._holding:
            self._holding.discard(park_id)
            self.engine.scheduler.end_lend(park_id)
        else:
            self.engine.free_parked(park_id)

    def lend(
        self, req: LendRequest, parked: ParkedBlocks, transceiver: Transceiver, worker_id: str
    ) -> LendResponse:
        """Pin the leading run of ``req.block_hashes`` this pool holds and park it under a
        lease (until ``req.deadline`` or ``lease_s`` from now, whichever is sooner); the
        handle, or no handle when nothing is held. Raises InvalidRequestError when the lend
        id is in use or the deadline has passed."""
        park_id = LEND_PREFIX + req.request_id
        if park_id in self._holding:
            raise InvalidRequestError(f"lend {req.request_id!r} is already held")
        if req.deadline <= time.time():
            raise InvalidRequestError(f"lend {req.request_id!r} arrived after its deadline")
        block_ids = self.engine.scheduler.lend(park_id, list(req.block_hashes))
        if not block_ids:
            return LendResponse()
        self._holding.add(park_id)
        tokens = len(block_ids) * self.engine.layout.tokens_per_block
        lease = parked.park(park_id, block_ids, tokens)
        deadline = min(lease.deadline, req.deadline)
        self.lent += 1
        return LendResponse(
            handle=TransferHandle(
                worker_id=worker_id,
                epoch=parked.epoch,
                request_id=park_id,
                lease_id=lease.lease_id,
                block_ids=tuple(block_ids),
                num_tokens=tokens,
                lease_deadline=deadline,
                layout=self.engine.layout,
                backend=transceiver.backend,
                transfer_endpoint=transceiver.endpoint,
            )
        )


class PrefixPuller:
    """The pulling side: brings a lent prefix into this worker's prefix cache before the
    prefill (:meth:`take`).

    ``transceiver``: this worker's; ``peers``: the workers discovery lists (a handle naming
    another is refused before any connection); ``quarantine_s``: how long the blocks of a pull
    that failed mid-flight stay reserved (a remote write may still land in them; the transfer
    timeout). ``metrics``: counts each outcome."""

    def __init__(
        self,
        engine: WorkerEngine,
        transceiver: Transceiver,
        peers: PrefillDirectory,
        *,
        quarantine_s: float,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.transceiver = transceiver
        self.peers = peers
        self.quarantine_s = quarantine_s
        self.metrics = metrics

    async def take(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        sampling: SamplingParams,
        handle: TransferHandle,
        deadline: float,
    ) -> int:
        """Pull the prefix ``handle`` leases (the first ``handle.num_tokens`` tokens of
        ``prompt``) into this worker's prefix cache; returns the blocks moved (0: nothing was
        needed, or the pull failed: the prefill computes those tokens). Never raises but
        CancelledError (the request went away; the blocks are disposed of first)."""
        tokens = handle.num_tokens
        if handle.streamed or tokens >= len(prompt):
            return self._count("refused", 0)
        pull_id = f"{request_id}:prefix"
        try:
            await self.peers.endpoint(handle, ANY_ROLE)
            dst = self.engine.reserve(
                pull_id,
                list(prompt[:tokens]),
                SamplingParams(max_tokens=2, cache_salt=sampling.cache_salt),
                reuse_prefix=handle.layout == self.engine.layout,
            )
        except (HandleError, CapacityError, InvalidRequestError) as exc:
            log.info("request %s: no peer prefix pull: %s", request_id, exc)
            return self._count("refused", 0)
        moved = len(dst.missing_block_ids)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(
                self.transceiver.pull(handle, dst.block_ids, skip_blocks=dst.cached_blocks),
                timeout=max(deadline - time.time(), 0.001),
            )
        except (PdserveError, TimeoutError, OSError, asyncio.CancelledError) as exc:
            self._dispose(pull_id, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            log.warning(
                "request %s: peer prefix pull from %s failed (%s); computing those %d tokens",
                request_id,
                handle.worker_id,
                exc,
                tokens,
            )
            return self._count("failed", 0)
        self.engine.scheduler.adopt(pull_id)
        if self.metrics is not None:
            self.metrics.peer_prefix_seconds.observe(time.perf_counter() - t0)
        log.debug(
            "request %s: pulled %d prefix KV blocks from %s in %.1f ms (%d cached here)",
            request_id,
            moved,
            handle.worker_id,
            (time.perf_counter() - t0) * 1e3,
            dst.cached_blocks,
        )
        return self._count("pulled", moved)

    def _dispose(self, pull_id: str, exc: BaseException) -> None:
        """A failed pull's blocks: back at once when nothing more can land in them (refused
        before any byte, all bytes checked, or a backend that writes nothing after the pull
        ended), else after ``quarantine_s``."""
        settled = isinstance(exc, HandleError | LayoutMismatchError | IntegrityError)
        if settled or not self.transceiver.late_writes:
            self.engine.unreserve(pull_id)
            return
        asyncio.get_running_loop().call_later(self.quarantine_s, self.engine.unreserve, pull_id)

    def _count(self, outcome: str, blocks: int) -> int:
        if self.metrics is not None:
            self.metrics.peer_prefix_pulls.labels(outcome).inc()
            self.metrics.peer_prefix_blocks.inc(blocks)
        return blocks
