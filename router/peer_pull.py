"""Peer prefix pull, the router's half: whether a prompt's prefix should travel from another
worker to the one that prefills it, and asking the holder to lend it (the workers' half:
:mod:`pdserve.workers.roles.lending`).

The decision (:meth:`PeerPull.plan`), after the policy chose the route:

- The *puller* is the worker that prefills the prompt: the prefill worker on the
  disaggregated path, else the worker that streams (local prefill, colocated).
- What it has: the leading prompt blocks the KV index (:mod:`pdserve.router.kv_index`) says
  it holds in any medium (its own host, disk and remote tiers load those).
- Each other worker of the model whose blocks hash alike (same model, KV dtype and tokens per
  block), whose layout maps to the puller's and that serves the same transfer backend is a
  *lender* candidate, credited with its **device** run only (the leading blocks in its KV pool:
  a lend pins pool blocks; tier blocks are not lent).
- The best candidate lends when its run exceeds what the puller has by at least
  ``router.peer_pull_min_tokens`` tokens (0: never).

Why a token threshold and no per-request cost model: measured on 2 CPU cores
(``pdserve bench kv-peer``, docs/benchmarks.md "Peer prefix pull"), the pull's fixed cost
(this lend call, the transfer connection, the reservation) is a few milliseconds and each
16-token block moves in a small fraction of the time its prefill takes, so any gain of a
few blocks pays; the threshold keeps tiny gains (whose fixed cost dominates) from making calls.

The lend is best effort: a lender that holds nothing any more (evicted since its KV events),
answers late (``LEND_TIMEOUT_S``) or fails leaves the request to compute its prefix. The
lease is the lender's (``kv_cache.lease_s``, at most the request's deadline); the puller's
pull releases it, and an abandoned one expires.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.kv_lend import LendRequest
from pdserve.protocol import TransferHandle, WorkerRecord
from pdserve.router.kv_index import KVIndex, PromptHashes

if TYPE_CHECKING:
    from pdserve.router.client import WorkerClient
    from pdserve.router.router_metrics import RouterMetrics
    from pdserve.router.view import Candidates

LEND_TIMEOUT_S = 1.0
"""The longest the router waits for a lend answer (seconds): a lend is a table lookup on the
lender, answered in about a millisecond; one that takes longer is skipped (recompute)."""


@dataclass(frozen=True)
class LendPlan:
    """The peer prefix pull for one request: ``lender`` holds ``blocks`` leading prompt blocks
    in its pool, ``have`` of which the puller holds already; ``hashes`` are those blocks'."""

    lender: WorkerRecord
    blocks: int
    have: int
    hashes: tuple[int, ...]


class PeerPull:
    """Plans and asks for peer prefix pulls (module docstring). ``index``: the router's KV
    index; ``client``: the worker request plane; ``min_tokens``: ``router.peer_pull_min_tokens``
    (0: off)."""

    def __init__(
        self,
        index: KVIndex | None,
        client: WorkerClient,
        min_tokens: int,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.index = index
        self.client = client
        self.min_tokens = min_tokens
        self.metrics = metrics

    def plan(
        self, cands: Candidates, puller: WorkerRecord, prompt: PromptHashes
    ) -> LendPlan | None:
        """The best lender for ``puller``'s prefill of ``prompt``, or None (off, no index, no
        worker holds enough more)."""
        index = self.index
        if index is None or self.min_tokens <= 0:
            return None
        layout = puller.layout
        hashes = prompt.for_layout(layout)
        if not hashes:
            return None
        have = len(index.overlap_media(puller.worker_id, puller.epoch, hashes))
        best: tuple[int, WorkerRecord] | None = None
        for state in (*cands.prefill, *cands.decode, *cands.colocated):
            w = state.record
            if w.worker_id == puller.worker_id or not _lends_to(w, puller):
                continue
            run = _device_run(index.overlap_media(w.worker_id, w.epoch, hashes))
            if best is None or run > best[0]:
                best = (run, w)
        if best is None or (best[0] - have) * layout.tokens_per_block < self.min_tokens:
            return None
        run, lender = best
        return LendPlan(lender, run, have, tuple(hashes[:run]))

    async def lend(self, plan: LendPlan, deadline: float) -> TransferHandle | None:
        """Ask ``plan.lender`` for the lease (best effort, at most :data:`LEND_TIMEOUT_S`):
        the handle to put in the prefilling leg's ``prefix``, or None."""
        req = LendRequest(request_id=uuid.uuid4().hex, block_hashes=plan.hashes, deadline=deadline)
        timeout = max(min(LEND_TIMEOUT_S, deadline - time.time()), 0.001)
        handle = await self.client.lend(plan.lender, req, timeout)
        if self.metrics is not None:
            self.metrics.peer_lends.labels("lent" if handle is not None else "none").inc()
        return handle


def _device_run(media: Sequence[str]) -> int:
    """The leading blocks held in the pool itself."""
    run = 0
    for medium in media:
        if medium != "device":
            break
        run += 1
    return run


def _lends_to(lender: WorkerRecord, puller: WorkerRecord) -> bool:
    """Whether ``puller`` can take ``lender``'s blocks as its own prefix: the same block hashes
    (model, KV dtype, tokens per block), a layout the formatter maps, the same transfer
    backend, both with a transceiver."""
    a, b = lender.layout, puller.layout
    same_hashes = (a.model, a.dtype, a.tokens_per_block) == (b.model, b.dtype, b.tokens_per_block)
    backend = lender.communicator.get("backend")
    return (
        same_hashes
        and a.can_map_to(b)
        and backend is not None
        and backend == puller.communicator.get("backend")
        and bool(lender.communicator.get("endpoint"))
    )
