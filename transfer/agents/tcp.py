"""The TCP transfer backend: the KV bytes streamed on the control connection.

The dependency-free fallback. Every transceiver already holds one
:class:`~pdserve.transfer.connection.control.Connection` per peer request for its control messages; this
backend also streams the KV bytes on it, straight from and into the pool memory::

    P: BlockData(nbytes) | seg 0 bytes | seg 1 bytes | ... | [BlockDigests]   (one stream)
    D: recv header       | recvmsg_into(pool[dst seg 0], pool[dst seg 1], ...) until nbytes

With integrity on, the sender hashes each group of about 256 KiB of segments right before the
socket reads it and the receiver right after the socket wrote it (the bytes are in the CPU's
cache then), and the digests trail the bytes.

The announced byte count is the completion (no TransferDone on this backend); a sender that
fails mid-stream closes the connection, which the receiver sees as EOF -> TransferError. A CUDA
pool cannot be a socket buffer: its bytes go through one pinned host buffer per request
(:mod:`pdserve.transfer.formatter.hoststage`), on the same stream format. Why raw sockets, and the
thread-safety rules: :mod:`pdserve.transfer.connection.control`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import torch

from pdserve.config.settings import TransferSettings
from pdserve.errors import ConfigError, TransferError
from pdserve.transfer import wire
from pdserve.transfer.backend import Backend, Digests, Outbound, Peer, TransferState
from pdserve.transfer.connection.control import Connection
from pdserve.transfer.formatter.copies import SEND, SOCKET
from pdserve.transfer.formatter.hoststage import HostStage, byte_view
from pdserve.transfer.formatter.mapping import PoolGeometry, TransferPlan, pool_bytes
from pdserve.transfer.integrity.digests import digest_groups


class _StreamSend(Outbound):
    """The bytes of one request, written on the connection by :meth:`wait` itself.

    No task: the stream is the sender's only business until it ends, and a task would add an
    event-loop hop at its start and at its end (tens of microseconds of a small request's
    fixed cost). A receiver that stops reading surfaces as a send error, so ``abandoned`` is
    not needed; the stream closes the connection when it breaks or is cancelled mid-way."""

    def __init__(self, stream: Coroutine[Any, Any, None]):
        self._stream = stream
        self._state = TransferState.RUNNING

    def poll(self) -> TransferState:
        return self._state

    def abort(self) -> None:
        if self._state is TransferState.RUNNING:
            self._stream.close()  # not started, or ended by an exception: nothing runs on
            self._state = TransferState.FAILED
            self.failure = "aborted"

    async def wait(self, timeout: float, abandoned: Callable[[], bool] | None = None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._stream
        except TimeoutError as exc:
            self._state = TransferState.FAILED
            self.failure = "timed out"
            raise TransferError(f"KV send did not complete within {timeout:.1f} s") from exc
        except BaseException as exc:
            self._state = TransferState.FAILED
            self.failure = repr(exc)
            raise
        self._state = TransferState.DONE


class TcpBackend(Backend):
    """KV bytes streamed on the control connection, zero-copy on both ends for CPU pools.

    One request = one BlockData header + ``plan.nbytes`` raw bytes, the segments in plan order
    (``num_layers * num_runs`` sendall/recv_into calls). A CUDA pool (or staging buffer) is
    staged through one pinned host buffer per request (:mod:`pdserve.transfer.formatter.hoststage`):
    the sender gathers the segments into it, then streams it; the receiver fills it from the
    stream, then scatters it into the pool. The stream is the same either way, so CPU and CUDA
    workers pair freely. Raises ConfigError for a pool on another device type.
    """

    name = "tcp"
    inline_bytes = True

    @property
    def late_writes(self) -> bool:
        """CPU pool: ``recvmsg_into`` runs only inside :meth:`receive`, so nothing lands once it
        ended. CUDA pool: the host-to-pool scatter runs on a side stream and may be queued."""
        return self._stage is not None

    def __init__(
        self, *, cfg: TransferSettings, pool: torch.Tensor, geometry: PoolGeometry, agent_name: str
    ):
        self._stage: HostStage | None = None
        if pool.device.type == "cuda":
            self._stage = HostStage(pool.device)
            self._pool = byte_view(pool)
        elif pool.device.type != "cpu":
            raise ConfigError(
                f"the tcp transfer backend moves KV from CPU or CUDA pools, not {pool.device}"
            )
        else:
            self._bytes = pool_bytes(pool)

    def start_send(
        self,
        conn: Connection,
        plan: TransferPlan,
        peer: Peer,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> Outbound:
        header = wire.BlockData(transfer_id=transfer_id, nbytes=plan.nbytes)
        self.copies.sent(plan.nbytes)
        self.copies.copied(SEND, SOCKET, plan.nbytes)  # sendmsg -> kernel -> recvmsg_into
        if self._stage is not None:  # the digests are finished by the sender, after the stream
            return _StreamSend(self._send_staged(conn, plan, header))
        src = self._bytes if plan.source is None else pool_bytes(plan.source)  # staged bytes
        return _StreamSend(self._send(conn, src, plan, header, digests))

    @staticmethod
    async def _send(
        conn: Connection,
        src: memoryview,
        plan: TransferPlan,
        header: wire.BlockData,
        digests: Digests | None,
    ) -> None:
        """CPU source: the header, then the segments straight from ``src``; with integrity
        on, each group of about 256 KiB is hashed right before the socket reads it (in cache)."""
        if digests is None:
            await conn.send_segments(src, plan.src_offsets, plan.lengths, header)
            return
        start = 0
        for stop in digest_groups(plan.lengths):
            digests.update(stop)
            await conn.send_segments(
                src,
                plan.src_offsets[start:stop],
                plan.lengths[start:stop],
                header if start == 0 else None,
            )
            start = stop

    async def _send_staged(
        self, conn: Connection, plan: TransferPlan, header: wire.BlockData
    ) -> None:
        """CUDA source: gather the segments into pinned host memory, then stream it."""
        assert self._stage is not None
        src = self._pool if plan.source is None else byte_view(plan.source)
        host, copied = self._stage.gather(src, plan.src_offsets, plan.lengths, self.copies)
        await self._stage.wait(copied)
        whole = np.array([0, plan.nbytes], dtype=np.int64)
        await conn.send_segments(pool_bytes(host), whole[:1], whole[1:], header)

    async def receive(
        self,
        conn: Connection,
        plan: TransferPlan,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> None:
        self.copies.received(plan.nbytes)  # the socket copy is counted by the sender
        msg = await conn.recv()
        if not isinstance(msg, wire.BlockData):
            wire.expect_done(msg, transfer_id)  # raises the peer's error
            raise TransferError(f"transfer {transfer_id} completed without data")
        if msg.transfer_id != transfer_id or msg.nbytes != plan.nbytes:
            raise TransferError(
                f"peer {conn.peer} announced {msg.nbytes} bytes for {msg.transfer_id}, "
                f"expected {plan.nbytes} for {transfer_id}"
            )
        # The announced byte count is the completion: a sender that fails mid-way closes.
        if self._stage is None:
            await self._receive_into_pool(conn, plan, digests)
            return
        host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
        whole = np.array([0, plan.nbytes], dtype=np.int64)
        await conn.recv_segments(pool_bytes(host), whole[:1], whole[1:])
        await self._stage.wait(
            self._stage.scatter(host, self._pool, plan.dst_offsets, plan.lengths, self.copies)
        )

    async def _receive_into_pool(
        self, conn: Connection, plan: TransferPlan, digests: Digests | None
    ) -> None:
        """CPU pool: the segments straight into the pool; with integrity on, each group of
        about 256 KiB is hashed right after the socket wrote it (in cache)."""
        if digests is None:
            await conn.recv_segments(self._bytes, plan.dst_offsets, plan.lengths)
            return
        start = 0
        for stop in digest_groups(plan.lengths):
            await conn.recv_segments(
                self._bytes, plan.dst_offsets[start:stop], plan.lengths[start:stop]
            )
            digests.update(stop)
            start = stop
