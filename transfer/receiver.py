"""Receiver: the decode side, pulling a prefill worker's parked KV blocks into local blocks.

Design origin: the TensorRT-LLM seed's *Receiver* (bound to the generation side, it tells the
context side which cache it needs) and its workflow steps 3-6.

Lifecycle of one :meth:`Receiver.pull`, all within ``timeout_s``::

    1. CHECK       dst ids vs handle (ceil(num_tokens / local tpb) of them), backend of the
                   handle (the layouts are the handshake's and the Formatter's business),
                   lease deadline not passed (fencing: refused before asking)
    2. CONNECT     reuse an idle handshaken connection to ``handle.transfer_endpoint`` or open
                   one (dialled again if the listener shed it before its challenge),
                   authenticate both ways on the cluster secret (a prefill side that
                   cannot prove it holds it gets nothing, not even the Hello: TransferError
                   ``kv_auth_failed``) and handshake (:meth:`LocalSide.connect`; once per
                   connection, never per request); the cached session is
                   dropped when the handle names another epoch (the prefill worker restarted),
                   and a handle whose epoch is not the one the handshake found is refused;
                   so are source block ids outside the prefill pool (its Hello geometry)
    3. REQUEST     SendBlocks(request id, epoch, lease id, transfer id, src ids, dst ids,
                   integrity = whether this side checks digests, skip_blocks = leading blocks
                   this side's prefix cache already holds: delta transfer, equal layouts only)
    4. RECEIVING   backend.receive: TCP bytes land straight in the pool; NIXL polls for the
                   WRITE's notification and TransferDone; UCX polls its tagged receives
                   (posted into the pool) and awaits TransferDone
    4b VERIFY      integrity on: the landed bytes' digests (TCP: computed group by group as
                   they land; otherwise right after TransferDone, while the sender hashes its
                   source), then BlockDigests (the trailer of the bytes on TCP, right after
                   TransferDone otherwise), compared
                   (:class:`~pdserve.transfer.integrity.digests.BlockDigester`); a
                   mismatch raises IntegrityError naming the blocks, closes the connection and
                   sends no Release
    5. RELEASE     Release(request id, lease id); the connection goes back to the idle list

Failures raise TransferError, or the prefill side's LayoutMismatchError / HandleError as the
same class, or IntegrityError (this side's digest check); nothing hangs past ``timeout_s``. A
clean refusal (HandleError) keeps the connection; anything else closes it.

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
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.errors import HandleError, TransferError
from pdserve.observability import tracing
from pdserve.protocol import TransferHandle
from pdserve.transfer import wire
from pdserve.transfer.connection.control import Connection
from pdserve.transfer.connection.handshake import LocalSide
from pdserve.transfer.formatter.mapping import Formatter, TransferPlan
from pdserve.transfer.integrity.digests import BlockDigester, SegmentDigests, choose_algorithm

log = logging.getLogger(__name__)

MAX_IDLE_PER_PEER = 8
"""Idle handshaken connections kept per prefill endpoint (one per concurrent pull in use)."""

SHED_RETRIES = 3
"""Dials again after a prefill side shed a new connection before authenticating it."""
SHED_BACKOFF_S = 0.05
"""Wait before the k-th new dial: k times this (seconds)."""


@dataclass
class _Session:
    """A handshaken prefill peer: its identity, the negotiated formatter, idle connections."""

    worker_id: str
    epoch: int
    formatter: Formatter
    peer_blocks: int  # blocks in the prefill pool (its HelloAck): valid source ids lie below
    digest: str  # the block digest asked for (integrity.choose_algorithm of both pools)
    idle: list[Connection] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class Receiver:
    """Pulls for one decode transceiver; keeps one :class:`_Session` per prefill endpoint.

    ``digester``: checks the block digests of every pull (None: integrity off, no digests
    asked for)."""

    def __init__(self, local: LocalSide, timeout_s: float, digester: BlockDigester | None = None):
        self._local = local
        self._timeout_s = timeout_s
        self._digester = digester
        self._sessions: dict[str, _Session] = {}

    async def pull(
        self, handle: TransferHandle, dst_block_ids: list[int], *, skip_blocks: int = 0
    ) -> None:
        """Copy the K/V of ``handle.num_tokens`` tokens held by ``handle.block_ids`` (prefill
        pool, in token order) into ``dst_block_ids`` (local pool, in token order: as many
        blocks as the tokens need at the local tokens per block), every layer; equal layouts
        map ``block_ids[i]`` to ``dst_block_ids[i]``. Returns when the bytes are in place and
        released.

        Delta transfer: ``skip_blocks`` leading blocks already hold their K/V here (a prefix
        cache hit); only ``block_ids[skip_blocks:]`` move, into ``dst_block_ids[skip_blocks:]``.
        Needs equal layouts (TransferError otherwise) and leaves at least one block to move."""
        self._check(handle, dst_block_ids, skip_blocks)
        try:
            async with asyncio.timeout(self._timeout_s):
                with tracing.phase("kv_handshake", pdserve_kv_peer=handle.transfer_endpoint):
                    conn, session = await self._checkout(handle)
                await self._transfer(conn, session, handle, dst_block_ids, skip_blocks)
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

    def _check(
        self,
        handle: TransferHandle,
        dst_block_ids: list[int],
        skip_blocks: int,
        *,
        streamed: bool = False,
    ) -> None:
        if handle.streamed != streamed:
            raise TransferError(
                f"request {handle.request_id}: a {'streamed' if handle.streamed else 'whole'} "
                f"handle needs {'pull_streamed' if handle.streamed else 'pull'}"
            )
        parked = -(-handle.num_tokens // handle.layout.tokens_per_block)
        if skip_blocks and (handle.layout != self._local.layout or not 0 < skip_blocks < parked):
            raise TransferError(
                f"request {handle.request_id}: a delta transfer skipping {skip_blocks} of "
                f"{parked} blocks needs equal KV layouts and one block to move"
            )
        tpb = self._local.layout.tokens_per_block  # may differ from the handle's (formatter)
        needed = -(-handle.num_tokens // tpb)
        if len(dst_block_ids) != needed:
            raise TransferError(
                f"request {handle.request_id}: {len(dst_block_ids)} destination blocks for "
                f"{handle.num_tokens} tokens in {len(handle.block_ids)} parked blocks "
                f"({needed} needed at {tpb} tokens/block)"
            )
        backend = self._local.backend.name
        if handle.backend != backend:
            raise TransferError(
                f"request {handle.request_id} is served over {handle.backend!r}, this worker "
                f"uses {backend!r}; configure both with the same transfer backend",
                code=wire.BACKEND_MISMATCH,
            )
        if handle.lease_remaining() <= 0:
            raise HandleError(
                f"lease of request {handle.request_id} on {handle.worker_id} expired "
                f"{-handle.lease_remaining():.1f} s ago; its KV blocks are gone"
            )

    async def pull_streamed(
        self, handle: TransferHandle, dst_block_ids: list[int], *, skip_blocks: int = 0
    ) -> int:
        """The streamed hand-off (``handle.streamed``: published at admission, no block ids):
        receive the prompt's K/V into ``dst_block_ids`` (as :meth:`pull`) one prefill chunk
        at a time, as the prefill worker computes it, and return the first token it sampled.
        The whole pull may last until the handle's lease deadline (the request's deadline);
        each chunk's bytes move as a plain pull's do (digests checked per chunk). A prefill
        that fails midway ends the pull with its TransferFailed (HandleError). Raises as
        :meth:`pull`."""
        self._check(handle, dst_block_ids, skip_blocks, streamed=True)
        limit = max(self._timeout_s, handle.lease_remaining())
        try:
            async with asyncio.timeout(limit):
                with tracing.phase("kv_handshake", pdserve_kv_peer=handle.transfer_endpoint):
                    conn, session = await self._checkout(handle)
                return await self._stream(conn, session, handle, dst_block_ids, skip_blocks)
        except TimeoutError as exc:
            raise TransferError(
                f"streamed KV transfer of request {handle.request_id} from "
                f"{handle.transfer_endpoint} timed out after {limit:.1f} s"
            ) from exc

    async def _stream(
        self,
        conn: Connection,
        session: _Session,
        handle: TransferHandle,
        dst_block_ids: list[int],
        have: int,
    ) -> int:
        """Ask for the next computed blocks until the prefill is done (see
        :meth:`pull_streamed`); returns the first token."""
        aligned = session.formatter.block_aligned
        with self._conversation(session, conn):
            while True:
                transfer_id = uuid.uuid4().hex
                ask = self._ask(session, handle, transfer_id, (), dst_block_ids[have:], have)
                await conn.send(ask)
                msg = await conn.recv()
                if not isinstance(msg, wire.BlocksReady) or msg.transfer_id != transfer_id:
                    wire.expect_done(msg, transfer_id)  # raises the peer's TransferFailed
                    raise TransferError(f"{conn.peer} answered a streamed pull with {msg.type}")
                src = msg.src_block_ids
                if src:
                    try:
                        _check_source_ids(handle, session.peer_blocks, src)
                    except HandleError as exc:  # the peer's bytes follow: close, not reuse
                        raise TransferError(exc.message) from exc
                    dst = dst_block_ids[have : have + len(src)] if aligned else dst_block_ids
                    plan = session.formatter.plan(src, dst)
                    await self._receive(conn, session, plan, transfer_id, handle, src, dst)
                    have += len(dst)
                if msg.done:
                    if have != len(dst_block_ids) or msg.first_token is None:
                        raise TransferError(
                            f"streamed KV of request {handle.request_id} ended with {have} of "
                            f"{len(dst_block_ids)} blocks"
                        )
                    first = msg.first_token
                    break
        await self._release(conn, session, handle)
        return first

    def _ask(
        self,
        session: _Session,
        handle: TransferHandle,
        transfer_id: str,
        src_ids: tuple[int, ...],
        dst_ids: list[int],
        skip_blocks: int,
    ) -> wire.SendBlocks:
        return wire.SendBlocks(
            request_id=handle.request_id,
            epoch=handle.epoch,
            lease_id=handle.lease_id,
            transfer_id=transfer_id,
            src_block_ids=src_ids,
            dst_block_ids=tuple(dst_ids),
            integrity=self._digester is not None,
            digest=session.digest,  # one of integrity.ALGORITHMS
            skip_blocks=skip_blocks,
            stream=handle.streamed,
        )

    async def _transfer(
        self,
        conn: Connection,
        session: _Session,
        handle: TransferHandle,
        dst_block_ids: list[int],
        skip_blocks: int,
    ) -> None:
        src_ids = handle.block_ids[skip_blocks:]
        dst_block_ids = dst_block_ids[skip_blocks:]
        try:
            _check_source_ids(handle, session.peer_blocks, handle.block_ids)
            plan = session.formatter.plan(src_ids, dst_block_ids)
        except TransferError:
            self._give_back(session, conn)
            raise
        transfer_id = uuid.uuid4().hex
        with self._conversation(session, conn):
            ask = self._ask(session, handle, transfer_id, src_ids, dst_block_ids, skip_blocks)
            await conn.send(ask)
            await self._receive(conn, session, plan, transfer_id, handle, src_ids, dst_block_ids)
        await self._release(conn, session, handle)

    @contextlib.contextmanager
    def _conversation(self, session: _Session, conn: Connection) -> Iterator[None]:
        """One request's exchange on ``conn``: a clean refusal by the peer (HandleError) leaves
        the stream intact and the connection goes back to the idle list; anything else
        (cancelled, broken mid-conversation) leaves its state unknown and closes it."""
        try:
            yield
        except HandleError:
            self._give_back(session, conn)
            raise
        except BaseException:
            conn.close()
            raise

    async def _receive(
        self,
        conn: Connection,
        session: _Session,
        plan: TransferPlan,
        transfer_id: str,
        handle: TransferHandle,
        src_ids: tuple[int, ...],
        dst_block_ids: list[int],
    ) -> None:
        """Steps 4-4b for one asked transfer: the bytes, then (integrity on) the digests."""
        digest = session.digest
        landed = None if self._digester is None else self._digester.landed(plan, digest)
        with tracing.phase("kv_wire", pdserve_kv_blocks=len(src_ids)):
            await self._local.backend.receive(conn, plan, transfer_id, landed)
        if self._digester is not None and landed is not None:
            # TCP hashed the bytes as they landed; NIXL / UCX hash them now, while the
            # sender hashes its source: both before the sender's digests are read.
            with tracing.phase("kv_integrity"):
                landed.finish()
                digests = await self._digests(conn, transfer_id, digest)  # trailer / after Done
                self._verify(self._digester, digests, plan, handle, src_ids, dst_block_ids, landed)

    async def _release(self, conn: Connection, session: _Session, handle: TransferHandle) -> None:
        with tracing.phase("kv_release"), contextlib.suppress(TransferError):
            # the bytes are here; the lease covers a loss
            await conn.send(wire.Release(request_id=handle.request_id, lease_id=handle.lease_id))
        self._give_back(session, conn)

    async def _digests(self, conn: Connection, transfer_id: str, algorithm: str) -> str:
        """The sender's BlockDigests of ``transfer_id`` (ahead of inline bytes, after
        TransferDone otherwise), in the ``algorithm`` asked for. Raises the peer's refusal
        (TransferFailed) or TransferError."""
        msg = await conn.recv()
        if isinstance(msg, wire.BlockDigests) and msg.transfer_id == transfer_id:
            if msg.algorithm != algorithm:
                raise TransferError(
                    f"transfer {transfer_id} from {conn.peer}: {msg.algorithm} block digests, "
                    f"{algorithm} asked for"
                )
            return msg.digests
        wire.expect_done(msg, transfer_id)  # raises the peer's error for TransferFailed
        raise TransferError(f"transfer {transfer_id} from {conn.peer} came without block digests")

    def _verify(
        self,
        digester: BlockDigester,
        digests: str,
        plan: TransferPlan,
        handle: TransferHandle,
        src_ids: tuple[int, ...],
        dst_block_ids: list[int],
        landed: SegmentDigests,
    ) -> None:
        """Step 4b: every byte of ``plan`` has landed (the backend returned) and ``landed``
        holds its digests; compare them with the sender's. Raises IntegrityError (naming the
        blocks) or TransferError."""
        one_to_one = handle.layout.tokens_per_block == self._local.layout.tokens_per_block
        digester.check(  # the message names prefill blocks only where blocks map one to one
            plan,
            digests,
            request_id=handle.request_id,
            geometry=self._local.geometry,
            block_map=dict(zip(dst_block_ids, src_ids, strict=True)) if one_to_one else {},
            landed=landed,
        )

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
        conn, ack, formatter = await self._dial(endpoint)
        session = self._sessions.get(endpoint)
        if session is None or (session.worker_id, session.epoch) != (ack.worker_id, ack.epoch):
            if session is not None:
                session.close()
            digest = choose_algorithm(
                self._local.pool_device, ack.pool_device, self._local.layout, ack.layout
            )
            session = self._sessions[endpoint] = _Session(
                ack.worker_id, ack.epoch, formatter, ack.num_blocks, digest
            )
        if (ack.worker_id, ack.epoch) != (handle.worker_id, handle.epoch):
            self._give_back(session, conn)
            raise HandleError(
                f"handle of request {handle.request_id} names worker {handle.worker_id} epoch "
                f"{handle.epoch}, but {endpoint} serves {ack.worker_id} epoch {ack.epoch}"
            )
        return conn, session

    async def _dial(self, endpoint: str) -> tuple[Connection, wire.HelloAck, Formatter]:
        """Open, authenticate and handshake a new connection to ``endpoint``. A connection
        the listener shed before its challenge (admission: a flood of unauthenticated
        connections evicted this one, :mod:`pdserve.transfer.connection.admission`) is dialled again, up
        to :data:`SHED_RETRIES` times with a short backoff. Raises TransferError,
        LayoutMismatchError."""
        for attempt in range(SHED_RETRIES + 1):
            conn = await Connection.open(endpoint, self._timeout_s)
            try:
                ack, formatter = await self._local.connect(conn)  # authenticates both ways
                return conn, ack, formatter
            except TransferError as exc:
                conn.close()
                if exc.code != wire.CONNECTION_SHED or attempt == SHED_RETRIES:
                    raise
                log.info("%s shed a new transfer connection; dialling again", endpoint)
            except BaseException:
                conn.close()
                raise
            await asyncio.sleep(SHED_BACKOFF_S * (attempt + 1))
        raise AssertionError("unreachable")  # the last attempt returned or raised

    def _give_back(self, session: _Session, conn: Connection) -> None:
        if session.closed or conn.closed or len(session.idle) >= MAX_IDLE_PER_PEER:
            conn.close()
        else:
            session.idle.append(conn)


def _check_source_ids(handle: TransferHandle, peer_blocks: int, ids: tuple[int, ...]) -> None:
    """Refuse (HandleError) source block ids the prefill pool cannot hold, before asking."""
    if not ids or min(ids) < 0 or max(ids) >= peer_blocks:
        raise HandleError(
            f"handle of request {handle.request_id} names KV blocks {list(ids)}, but the pool "
            f"of {handle.worker_id} has blocks 0..{peer_blocks - 1}"
        )
