"""The in-process transfer rig: both sides of a KV transfer as a test's process runs them.

- :class:`LocalPrefill`: a prefill worker's transfer side minus the model: a real
  :class:`~pdserve.workers.kv.manager.KVCacheManager` whose pool holds the pattern
  (:func:`~tests.support.transfer.pattern_blocks`), a real
  :class:`~pdserve.workers.roles.parking.ParkedBlocks` wired to the manager's block generations,
  and a real transceiver serving the parked blocks. :meth:`LocalPrefill.park` returns the handle
  a prefill worker answers with. Levers (none is a production flag): ``skew`` runs the lease
  table's clock ahead (leases expire without waiting), :meth:`LocalPrefill.steal` is an
  ownership bug that hands the parked blocks to another request, :meth:`LocalPrefill.reset`
  starts over between tests. :mod:`tests.support.kv_peer` runs the same side in a process of
  its own.
- :func:`decode_transceiver` / :func:`decode_side`: a decode worker's transceiver over a pool of
  zeros, which pulls land in (:func:`~tests.support.transfer.assert_landed` checks them).
  :func:`assert_pull_fails_fast_when_the_peer_dies` pulls from a process peer that dies.
- :func:`bare_side`: a decode side below the transceiver (pool, backend, handshake), for tests
  that speak the wire protocol themselves.
- :func:`serving_transceiver`: a transceiver that serves no parked blocks (probes, handshakes).

Every side keys with :data:`~tests.support.transfer.TEST_KEY` unless told otherwise; settings
come from :func:`~tests.support.transfer.backend_cfg` (``inproc`` included: the KV bytes copied
between the pools in this process).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import TracebackType
from typing import NamedTuple

import pytest
import torch

from pdserve.config.settings import TransferSettings
from pdserve.errors import TransferError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.security import ClusterKey
from pdserve.transfer import Transceiver, create_transceiver
from pdserve.transfer.backend import open_backend
from pdserve.transfer.connection.handshake import LocalSide
from pdserve.transfer.formatter.mapping import PoolGeometry
from pdserve.workers.kv.manager import KVCacheManager
from pdserve.workers.roles.parking import ParkedBlocks
from tests.support.transfer import (
    BIG,
    BIG_BLOCKS,
    EPOCH,
    LAYOUT,
    NUM_BLOCKS,
    PREFILL_ID,
    TEST_KEY,
    PrefillPeer,
    backend_cfg,
    pattern_pool,
    zeros_pool,
)

Settings = TransferSettings | str
"""Transfer settings, or a backend name for :func:`~tests.support.transfer.backend_cfg`'s."""


def _settings(cfg: Settings) -> TransferSettings:
    return backend_cfg(cfg) if isinstance(cfg, str) else cfg


class LocalPrefill:
    """A prefill worker's transfer side in this process (see the module docstring). Build it on
    the event loop's thread; ``async with`` starts and closes it (or :meth:`start`,
    :meth:`close`)."""

    def __init__(
        self,
        cfg: Settings,
        *,
        layout: KVLayout = LAYOUT,
        num_blocks: int = NUM_BLOCKS,
        worker_id: str = PREFILL_ID,
        epoch: int = EPOCH,
        lease_s: float = 60.0,
        key: ClusterKey = TEST_KEY,
    ) -> None:
        self.layout, self.num_blocks, self.epoch = layout, num_blocks, epoch
        self.skew = 0.0
        """Seconds the lease table's clock runs ahead of ``time.time()``."""
        self.kv = KVCacheManager(layout, num_blocks)
        self.kv.pool.copy_(pattern_pool(layout, num_blocks))
        self.parked = ParkedBlocks(
            epoch=epoch,
            lease_s=lease_s,
            free_blocks=self._free,
            generations=self.kv.generations,
            send_grace_s=0.0,
            clock=lambda: time.time() + self.skew,
        )
        self.transceiver = create_transceiver(
            _settings(cfg),
            pool=self.kv.pool,
            layout=layout,
            worker_id=worker_id,
            epoch=epoch,
            parked=self.parked,
            key=key,
        )
        self.worker_id = worker_id

    def _free(self, request_id: str) -> None:
        self.kv.free(request_id)

    async def start(self) -> None:
        await self.transceiver.start()

    async def close(self) -> None:
        await self.transceiver.close()
        await self.parked.close()

    async def __aenter__(self) -> LocalPrefill:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def park(self, num_tokens: int, request_id: str | None = None) -> TransferHandle:
        """Allocate and park blocks for ``num_tokens`` tokens (of request ``request_id``, a
        fresh id by default); the handle a prefill worker answers with (its lease deadline in
        true time, whatever the skew)."""
        request_id = request_id or f"req-{uuid.uuid4().hex[:8]}"
        blocks = self.kv.allocate(request_id, num_tokens)
        lease = self.parked.park(request_id, blocks, num_tokens)
        return TransferHandle(
            worker_id=self.worker_id,
            epoch=self.epoch,
            request_id=request_id,
            lease_id=lease.lease_id,
            block_ids=tuple(blocks),
            num_tokens=num_tokens,
            lease_deadline=lease.deadline - self.skew,
            layout=self.layout,
            backend=self.transceiver.backend,
            transfer_endpoint=self.transceiver.endpoint,
        )

    def stream(self, num_tokens: int, request_id: str | None = None) -> TransferHandle:
        """A streamed hand-off's start: allocate the prompt's blocks (the engine's while the
        prefill runs) and publish a streamed handle (no block ids); :meth:`stream_step` and
        :meth:`stream_finish` play the prefill's chunks and its end."""
        request_id = request_id or f"req-{uuid.uuid4().hex[:8]}"
        self.kv.allocate(request_id, num_tokens)
        lease = self.parked.open_stream(request_id, time.time() + 60.0)
        return TransferHandle(
            worker_id=self.worker_id,
            epoch=self.epoch,
            request_id=request_id,
            lease_id=lease.lease_id,
            block_ids=(),
            num_tokens=num_tokens,
            lease_deadline=lease.deadline,
            layout=self.layout,
            backend=self.transceiver.backend,
            transfer_endpoint=self.transceiver.endpoint,
            streamed=True,
        )

    def stream_step(self, request_id: str, num_blocks: int) -> list[int]:
        """A prefill chunk completed the request's first ``num_blocks`` blocks; their ids."""
        ready = self.kv.block_table(request_id)[:num_blocks]
        self.parked.stream_progress(request_id, ready)
        return ready

    def stream_finish(self, request_id: str, first_token: int, num_tokens: int) -> list[int]:
        """The prefill finished: park every block (the stream's lease) and publish
        ``first_token``; the block ids."""
        blocks = self.kv.block_table(request_id)
        self.parked.park(request_id, blocks, num_tokens)
        self.parked.finish_stream(request_id, first_token)
        return blocks

    def steal(self, request_id: str) -> list[int]:
        """An ownership bug: free ``request_id``'s parked blocks behind the lease table's back
        and hand every free block (those among them) to another request, which writes -1 into
        them. Returns the stolen block ids."""
        self.kv.free(request_id)
        tokens = self.kv.get_num_free_blocks() * self.layout.tokens_per_block
        stolen = self.kv.allocate(f"thief-{request_id}", tokens)
        self.kv.pool[:, stolen] = -1.0
        return stolen

    async def reset(self) -> None:
        """Start over: nothing parked or allocated, the pattern intact, the true clock, no
        recorded transfer errors or refused connections."""
        await self.parked.close()
        for holder in self.kv.holders():
            self.kv.free(holder)
        self.kv.pool.copy_(pattern_pool(self.layout, self.num_blocks))
        self.skew = 0.0
        self.transceiver.recent_errors.clear()
        self.transceiver.auth_failures.total = 0


class DecodeSide(NamedTuple):
    """A decode worker's transfer side in this process: its started transceiver and the pool
    its pulls land in (zeros until then)."""

    transceiver: Transceiver
    pool: torch.Tensor


async def decode_transceiver(
    cfg: Settings,
    layout: KVLayout = LAYOUT,
    num_blocks: int = NUM_BLOCKS,
    *,
    worker_id: str = "decode-0",
    key: ClusterKey = TEST_KEY,
) -> DecodeSide:
    """A started decode side; the caller closes its transceiver (or uses :func:`decode_side`)."""
    pool = zeros_pool(layout, num_blocks)
    t = create_transceiver(
        _settings(cfg),
        pool=pool,
        layout=layout,
        worker_id=worker_id,
        epoch=1,
        parked=None,
        key=key,
    )
    await t.start()
    return DecodeSide(t, pool)


@asynccontextmanager
async def decode_side(
    cfg: Settings,
    layout: KVLayout = LAYOUT,
    num_blocks: int = NUM_BLOCKS,
    *,
    worker_id: str = "decode-0",
    key: ClusterKey = TEST_KEY,
) -> AsyncIterator[DecodeSide]:
    """:func:`decode_transceiver`, closed on exit."""
    side = await decode_transceiver(cfg, layout, num_blocks, worker_id=worker_id, key=key)
    try:
        yield side
    finally:
        await side.transceiver.close()


async def assert_pull_fails_fast_when_the_peer_dies(
    backend: str, delay: float | str | None
) -> None:
    """A 48 MiB pull from a :class:`~tests.support.transfer.PrefillPeer` that exits ``delay``
    into serving it (None: at once; seconds; ``"mid"``: after half of the bytes, tcp;
    ``"posted"``: once the UCX sends are posted) raises
    TransferError within 5 s."""
    peer = PrefillPeer(backend, layout=BIG, num_blocks=BIG_BLOCKS)
    try:
        async with decode_side(backend, BIG, BIG_BLOCKS, worker_id="decode-1") as (t, _):
            handle = peer.park("d1", list(range(BIG_BLOCKS)))
            peer.call("die", "d1", delay)
            started = time.monotonic()
            with pytest.raises(TransferError, match="closed the connection|lost"):
                await t.pull(handle, list(range(BIG_BLOCKS)))
            assert time.monotonic() - started < 5
    finally:
        peer.stop()


class BareSide(NamedTuple):
    """A decode side below the transceiver: ``local.connect(conn)`` authenticates and says
    Hello, ``local.hello()`` is the Hello alone; ``pool`` (zeros) is what its backend
    registered, untouched unless a peer writes into it."""

    local: LocalSide
    pool: torch.Tensor


@contextmanager
def bare_side(backend: str, *, worker_id: str, key: ClusterKey = TEST_KEY) -> Iterator[BareSide]:
    """A :class:`BareSide` of :data:`~tests.support.transfer.LAYOUT` on ``backend``, without
    any of the transceiver's own checks; its backend is closed on exit."""
    pool = zeros_pool(LAYOUT, NUM_BLOCKS)
    geometry = PoolGeometry.from_pool(pool, LAYOUT)
    agent_name = f"{worker_id}-{uuid.uuid4().hex}"
    opened = open_backend(backend_cfg(backend), pool=pool, geometry=geometry, agent_name=agent_name)
    try:
        yield BareSide(LocalSide(worker_id, 1, LAYOUT, geometry, opened, key=key), pool)
    finally:
        opened.close()


LAYOUT_SMALL = KVLayout(
    model="tiny", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="float32"
)
"""The layout of :func:`serving_transceiver` (4 blocks)."""
SERVING_ID, SERVING_EPOCH = "prefill-doc", 42


@asynccontextmanager
async def serving_transceiver(
    fill: float = 1.0, timeout_s: float = 30.0
) -> AsyncIterator[Transceiver]:
    """A started TCP transceiver ``prefill-doc`` (epoch 42) over 4 blocks of
    :data:`LAYOUT_SMALL` full of ``fill`` (standing for KV data), serving no parked blocks;
    ``timeout_s``: its transfer timeout (the settings' default)."""
    t = create_transceiver(
        backend_cfg("tcp", timeout_s=timeout_s),
        pool=zeros_pool(LAYOUT_SMALL, 4).fill_(fill),
        layout=LAYOUT_SMALL,
        worker_id=SERVING_ID,
        epoch=SERVING_EPOCH,
        parked=None,
        key=TEST_KEY,
    )
    await t.start()
    try:
        yield t
    finally:
        await t.close()
