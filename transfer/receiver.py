"""Receiver: the decode side, pulling a prefill worker's parked KV blocks into local blocks.

Design origin: the TensorRT-LLM seed's *Receiver* (bound to the generation side, it tells the
context side which cache it needs) and its workflow steps 3-6.

Lifecycle of one :meth:`Receiver.pull`, all within ``timeout_s``::

    1. CHECK       dst ids vs handle (count), backend of the handle (the layouts are the
                   handshake's and the Formatter's business, not an equality test here)
    2. CONNECT     reuse an idle handshaken connection to ``handle.transfer_endpoint`` or open
                   one and handshake (:meth:`LocalSide.check_ack`); the cached session is
                   dropped when the handle names another epoch (the prefill worker restarted)
    3. REQUEST     SendBlocks(request id, epoch, transfer id, src ids, dst ids)
    4. RECEIVING   backend.receive: TCP bytes land straight in the pool; NIXL polls for the
                   WRITE's notification and TransferDone
    5. RELEASE     Release(request id); the connection goes back to the idle list

Failures raise TransferError, or the prefill side's LayoutMismatchError / HandleError as the
same class; nothing hangs past ``timeout_s``. A clean refusal (HandleError) keeps the connection;
anything else closes it.

Ownership: the caller owns ``dst_block_ids`` (reserved, not used by the engine) before, during
and after the call; after an error their content is undefined. Nothing is written into them
after ``pull`` returns or raises: TCP bytes land only while ``pull`` reads them; with NIXL a
pull that gives up (timeout, cancellation) sends Abort and waits up to 2 s for the prefill
side's answer, after which it writes nothing (the prefill side cancels its WRITE when it sees
Abort or a closed connection). Only a prefill side that neither answers nor dies within those
2 s leaves a risk, which is logged as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field

from pdserve.errors import HandleError, TransferError
from pdserve.protocol import TransferHandle
from pdserve.transfer import wire
from pdserve.transfer.formatter import Formatter
from pdserve.transfer.handshake import LocalSide
from pdserve.transfer.tcp import Connection

log = logging.getLogger(__name__)

MAX_IDLE_PER_PEER = 8
"""Idle handshaken connections kept per prefill endpoint (one per concurrent pull in use)."""


@dataclass
class _Session:
    """A handshaken prefill peer: its identity, the negotiated formatter, idle connections."""

    worker_id: str
    epoch: int
    formatter: Formatter
    idle: list[Connection] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class Receiver:
    """Pulls for one decode transceiver; keeps one :class:`_Session` per prefill endpoint."""

    def __init__(self, local: LocalSide, timeout_s: float):
        self._local = local
        self._timeout_s = timeout_s
        self._sessions: dict[str, _Session] = {}

    async def pull(self, handle: TransferHandle, dst_block_ids: list[int]) -> None:
        """Copy every layer of ``handle.block_ids[i]`` (prefill pool) into
        ``dst_block_ids[i]`` (local pool); returns when the bytes are in place and released."""
        self._check(handle, dst_block_ids)
        try:
            async with asyncio.timeout(self._timeout_s):
                conn, session = await self._checkout(handle)
                await self._transfer(conn, session, handle, dst_block_ids)
        except TimeoutError as exc:
            raise TransferError(
                f"KV transfer of request {handle.request_id} from {handle.transfer_endpoint} "
                f"timed out after {self._timeout_s:.1f} s"
            ) from exc

    def close(self) -> None:
        """Close every idle connection; idempotent."""
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()

    def _check(self, handle: TransferHandle, dst_block_ids: list[int]) -> None:
        if len(dst_block_ids) != len(handle.block_ids):
            raise TransferError(
                f"request {handle.request_id}: {len(dst_block_ids)} destination blocks for "
                f"{len(handle.block_ids)} parked blocks"
            )
        backend = self._local.backend.name
        if handle.backend != backend:
            raise TransferError(
                f"request {handle.request_id} is served over {handle.backend!r}, this worker "
                f"uses {backend!r}; configure both with the same transfer backend",
                code=wire.BACKEND_MISMATCH,
            )

    async def _transfer(
        self,
        conn: Connection,
        session: _Session,
        handle: TransferHandle,
        dst_block_ids: list[int],
    ) -> None:
        try:
            plan = session.formatter.plan(handle.block_ids, dst_block_ids)
        except TransferError:
            self._give_back(session, conn)
            raise
        transfer_id = uuid.uuid4().hex
        try:
            await conn.send(
                wire.SendBlocks(
                    request_id=handle.request_id,
                    epoch=handle.epoch,
                    transfer_id=transfer_id,
                    src_block_ids=handle.block_ids,
                    dst_block_ids=tuple(dst_block_ids),
                )
            )
            await self._local.backend.receive(conn, plan, transfer_id)
        except HandleError:
            self._give_back(session, conn)  # the peer refused cleanly: the stream is intact
            raise
        except BaseException:
            conn.close()  # cancelled or broken mid-conversation: its state is unknown
            raise
        with contextlib.suppress(TransferError):  # the bytes are here; the lease covers a loss
            await conn.send(wire.Release(request_id=handle.request_id))
        self._give_back(session, conn)

    async def _checkout(self, handle: TransferHandle) -> tuple[Connection, _Session]:
        endpoint = handle.transfer_endpoint
        session = self._sessions.get(endpoint)
        if session is not None and (session.worker_id, session.epoch) != (
            handle.worker_id,
            handle.epoch,
        ):
            session = None  # maybe restarted: handshake again to learn who is there now
        while session is not None and session.idle:
            conn = session.idle.pop()
            if not conn.has_input():  # else closed by the peer or out of step
                return conn, session
            conn.close()
        conn = await Connection.open(endpoint, self._timeout_s)
        try:
            await conn.send(self._local.hello())
            ack = await conn.recv()
            if not isinstance(ack, wire.HelloAck):
                raise TransferError(f"expected hello_ack from {endpoint}, got {ack.type!r}")
            formatter = self._local.check_ack(ack)
        except BaseException:
            conn.close()
            raise
        session = self._sessions.get(endpoint)
        if session is None or (session.worker_id, session.epoch) != (ack.worker_id, ack.epoch):
            if session is not None:
                session.close()
            session = self._sessions[endpoint] = _Session(ack.worker_id, ack.epoch, formatter)
        if (ack.worker_id, ack.epoch) != (handle.worker_id, handle.epoch):
            self._give_back(session, conn)
            raise HandleError(
                f"handle of request {handle.request_id} names worker {handle.worker_id} epoch "
                f"{handle.epoch}, but {endpoint} serves {ack.worker_id} epoch {ack.epoch}"
            )
        return conn, session

    def _give_back(self, session: _Session, conn: Connection) -> None:
        if session.closed or conn.closed or len(session.idle) >= MAX_IDLE_PER_PEER:
            conn.close()
        else:
            session.idle.append(conn)
