"""Sender: the prefill side of one transfer connection.

Design origin: the TensorRT-LLM seed's *Sender* (the context side answers the generation side's
control messages by sending the KV cache it asks for).

Lifecycle of a connection and of each request on it::

    0. AUTH        mutual challenge-response on the cluster secret
                   (:func:`pdserve.transfer.connection.auth.accept`, frames <= 64 KiB): its AuthHello
                   within :data:`AUTH_START_S`, its proof and first message within
                   :data:`AUTH_TIMEOUT_S` (both at most the transfer timeout); meanwhile the
                   connection holds an *unproven* slot, which a newer unproven connection may
                   evict (:mod:`pdserve.transfer.connection.admission`), and a proof moves it to a proven
                   one (``on_proven``; past a cap the connection closes). A peer that fails
                   is answered AuthRefused (wrong proof) or nothing (garbage, oversized frame,
                   silence past a deadline), counted and logged (rate-limited) with its
                   address, and disconnected; nothing below happens for it
    1. HANDSHAKE   receive Hello, check it (:class:`LocalSide.accept`), answer HelloAck;
                   a refusal is recorded, answered with ok=False, and closes the connection
                   (a Probe instead of Hello: :func:`pdserve.transfer.bandwidth_probe.serve_probes`)
    2. IDLE        wait for the next message (a connection serves many requests, one at a time);
                   closed after :data:`IDLE_TIMEOUT_S` without one, and a frame once begun must
                   complete within ``control.FRAME_TIMEOUT_S``
    3. LOOKUP      SendBlocks: ``parked.lookup(request_id, epoch, lease_id)`` -> the parked
                   block ids (fencing: epoch, lease id, lease deadline, block generations; then
                   the ids asked for must equal the parked ones after ``skip_blocks``, the
                   leading blocks a delta transfer leaves out); HandleError & co. are answered
                   with TransferFailed and the connection stays
    4. SENDING     (converting formatter: the K/V is first staged in the decode layout)
                   the backend moves the bytes (TCP: streamed inline; NIXL: one WRITE, polled;
                   UCX: one tagged send per segment, polled; input from the receiver meanwhile
                   = Abort or EOF -> the WRITE / the sends are cancelled)
    5. DONE        NIXL, UCX: TransferDone (or TransferFailed); TCP: the stream's announced byte
                   count is the completion, and a stream that broke closes the connection
    5b DIGESTS     if SendBlocks asked (integrity): BlockDigests, the ``SendBlocks.digest`` of
                   each plan segment over the source bytes (xxh3_64; mix64 on the GPU when
                   both pools are on one: :mod:`pdserve.transfer.integrity.digests`),
                   computed where the bytes are touched anyway: on TCP group by group right
                   before the socket reads them, and sent as the trailer of the bytes; on
                   NIXL / UCX once the WRITE is done, right after TransferDone, while the
                   receiver hashes what landed (the parked blocks cannot change meanwhile:
                   fencing). A receiver that gives up before the answer still gets its Abort
                   handshake, and a digest that cannot be computed is a TransferFailed
    6. RELEASE     Release: ``parked.release(request_id, lease_id)`` (idempotent), back to 2
    3s STREAMED    SendBlocks with ``stream`` (a handle published at admission): wait until
                   blocks after ``skip_blocks`` are computed (``wait_streamed``; every block
                   at once when the formatter re-blocks), answer BlocksReady (ids, done, the
                   first token with the last ones), then 4-5b for those blocks; the decode
                   side asks again until done, then releases (6)

Ownership: the parked blocks stay the prefill worker's (and its lease's) until Release; this
module never frees anything else. A decode worker that disappears leaves them to the lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from pdserve.errors import HandleError, TransferError
from pdserve.transfer import wire
from pdserve.transfer.backend import Outbound, Peer
from pdserve.transfer.bandwidth_probe import serve_probes
from pdserve.transfer.connection import auth
from pdserve.transfer.connection.control import Connection
from pdserve.transfer.connection.handshake import LocalSide
from pdserve.transfer.formatter.mapping import Formatter, TransferPlan
from pdserve.transfer.integrity.digests import BlockDigester, encode

log = logging.getLogger(__name__)


IDLE_TIMEOUT_S = 120.0
"""An authenticated connection with no request for this long is closed (the decode side keeps
idle connections for reuse and opens a new one when it finds one closed)."""


AUTH_START_S = 2.0
"""A served connection's first frame (AuthHello) must arrive within this long: a dialler sends
it right after connecting, so only a socket held open for nothing waits longer."""

AUTH_TIMEOUT_S = 5.0
"""The whole authentication (AuthHello, AuthProof and the proven peer's first message) must
complete within this long (one round trip and two HMACs for a real peer)."""


def _proven_always() -> bool:
    return True


class ParkedLookup(Protocol):
    """The prefill worker's parked KV blocks, as the transceiver sees them."""

    def lookup(self, request_id: str, epoch: int, lease_id: str) -> list[int]:
        """Block ids parked for ``request_id`` under ``lease_id``, about to be sent; raises
        HandleError (unknown id, old epoch, another lease, expired lease, a block that changed
        hands since it was parked)."""
        ...

    def release(self, request_id: str, lease_id: str) -> object:
        """Free the parked blocks if ``lease_id`` is their park's; idempotent."""
        ...

    # Streamed handles (optional; a ParkedLookup without it refuses streamed pulls):
    # ``async wait_streamed(request_id, epoch, lease_id, have, *, whole, timeout) ->
    # (block ids, done, first token) | None`` (pdserve.workers.roles.parking.ParkedBlocks).


class Sender:
    """Serves one accepted connection until the peer closes it (see the module lifecycle).

    ``errors`` collects the TransferErrors this side raised (bounded, newest last), for logs and
    tests: a refused handshake raises on the serving side too, and this is where it lands.
    Peers that fail authentication go to ``auth_failures`` instead (an unauthenticated peer
    cannot push the real errors out of ``errors``). ``digester`` computes the block digests a
    receiver asks for (over this worker's pool). ``on_proven`` is called once the peer has
    proven itself and says whether the connection may stay (the transceiver's admission,
    :meth:`pdserve.transfer.connection.admission.ConnectionSlots.promote`; default: always).
    """

    def __init__(
        self,
        local: LocalSide,
        conn: Connection,
        parked: ParkedLookup | None,
        timeout_s: float,
        errors: deque[TransferError],
        digester: BlockDigester,
        auth_failures: auth.AuthFailures,
        on_proven: Callable[[], bool] = _proven_always,
    ):
        self._local = local
        self._on_proven = on_proven
        self._conn = conn
        self._parked = parked
        self._timeout_s = timeout_s
        self._errors = errors
        self._digester = digester
        self._auth_failures = auth_failures
        self._peer_id: str | None = None  # set once the peer proved it holds the secret

    async def serve(self) -> None:
        """Run the connection to its end; never raises for peer failures (they are logged)."""
        try:
            first = await self._authenticate()
            if isinstance(first, wire.Probe):  # `pdserve doctor`: zeros, no Hello, no KV block
                await serve_probes(self._conn, first, self._local)  # raises once it closes
            formatter, peer = await self._handshake(first)
            while True:
                try:
                    async with asyncio.timeout(IDLE_TIMEOUT_S):
                        msg = await self._conn.recv()
                except TimeoutError:
                    log.debug("closing the idle transfer connection from %s", self._conn.peer)
                    return
                if isinstance(msg, wire.SendBlocks) and msg.stream:
                    await self._send_streamed(msg, formatter, peer)
                elif isinstance(msg, wire.SendBlocks):
                    await self._send(msg, formatter, peer)
                elif isinstance(msg, wire.Release):
                    if self._parked is not None:
                        self._parked.release(msg.request_id, msg.lease_id)
                elif isinstance(msg, wire.Abort):
                    pass  # its transfer was already stopped (or done) and answered
                else:
                    raise TransferError(f"unexpected {msg.type!r} from {self._conn.peer}")
        except TransferError as exc:
            if self._peer_id is None:  # raised by auth.accept: counted, logged (rate-limited)
                self._auth_failures.record(self._conn.peer, exc.message)
            elif not self._conn.closed:  # else the peer closed or died: its side reports it
                self._record(exc)
            log.debug("transfer connection from %s ended: %s", self._conn.peer, exc.message)
        except TimeoutError:
            if self._peer_id is None:
                why = (
                    f"no authentication in time (AuthHello within "
                    f"{min(self._timeout_s, AUTH_START_S):.1f} s, all within "
                    f"{self._auth_timeout_s:.1f} s)"
                )
                self._auth_failures.record(self._conn.peer, why)
            else:
                log.warning("no hello from %s within %.1f s", self._conn.peer, self._timeout_s)
        except Exception:  # a bug (e.g. in ParkedLookup) must not kill the accept loop
            log.exception("transfer connection from %s crashed", self._conn.peer)
        finally:
            self._conn.close()

    @property
    def _auth_timeout_s(self) -> float:
        return min(self._timeout_s, AUTH_TIMEOUT_S)

    async def _authenticate(self) -> wire.Message:
        """Step 0, then the first message of the proven peer (Hello or Probe), within
        :data:`AUTH_TIMEOUT_S`. Raises TransferError (``kv_auth_failed`` while ``_peer_id``
        is None; a proven peer past the admission's caps too), TimeoutError."""
        local = self._local
        async with asyncio.timeout(self._auth_timeout_s):
            peer_id = await auth.accept(
                self._conn,
                local.key,
                worker_id=local.worker_id,
                epoch=local.epoch,
                start_timeout_s=min(self._timeout_s, AUTH_START_S),
            )
            if not self._on_proven():
                # Past the proven caps: the dialler's Hello goes unanswered (a plain
                # TransferError there, not retried: it already holds its share of connections).
                self._conn.close()
                raise TransferError("too many connections from this host (or in all)")
            self._peer_id = peer_id
            return await self._conn.recv()

    async def _handshake(self, hello: wire.Message) -> tuple[Formatter, Peer]:
        if not isinstance(hello, wire.Hello):
            raise TransferError(f"expected hello from {self._conn.peer}, got {hello.type!r}")
        assert self._peer_id is not None  # _authenticate returned
        try:
            accepted = self._local.accept(hello, self._peer_id)
        except TransferError as exc:
            self._record(exc)
            await self._conn.send(self._local.ack(exc))
            self._conn.close()
            raise
        await self._conn.send(self._local.ack())
        return accepted

    async def _send(self, msg: wire.SendBlocks, formatter: Formatter, peer: Peer) -> None:
        try:
            src_ids = self._lookup(msg)
        except TransferError as exc:
            self._record(exc)
            await self._fail(msg.transfer_id, exc)
            return
        await self._move(msg, formatter, peer, src_ids, msg.dst_block_ids)

    async def _send_streamed(self, msg: wire.SendBlocks, formatter: Formatter, peer: Peer) -> None:
        """A streamed pull's next step: wait until blocks after ``msg.skip_blocks`` are
        computed (every block at once when the formatter re-blocks), answer BlocksReady with
        them, then move them like a plain SendBlocks does."""
        try:
            ids, done, first = await self._wait_ready(msg, whole=not formatter.block_aligned)
            new = ids[msg.skip_blocks :]
            dst = msg.dst_block_ids
            if formatter.block_aligned:
                dst = dst[: len(new)]
                if len(new) > len(msg.dst_block_ids):
                    raise HandleError("the request holds more KV blocks than the decode side has")
        except TransferError as exc:
            self._record(exc)
            await self._fail(msg.transfer_id, exc)
            return
        ready = wire.BlocksReady(
            transfer_id=msg.transfer_id, src_block_ids=tuple(new), done=done, first_token=first
        )
        await self._conn.send(ready)
        if new:
            await self._move(msg, formatter, peer, new, dst)

    async def _wait_ready(
        self, msg: wire.SendBlocks, *, whole: bool
    ) -> tuple[list[int], bool, int | None]:
        """The parked request's blocks as its prefill computes them (ParkedLookup's
        ``wait_streamed``); checks every second that the decode side still waits (it is
        silent until the answer). Raises HandleError, TransferError."""
        wait = getattr(self._parked, "wait_streamed", None)
        if wait is None:
            raise HandleError(f"worker {self._local.worker_id} publishes no streamed handles")
        while True:
            got = await wait(
                msg.request_id, msg.epoch, msg.lease_id, msg.skip_blocks, whole=whole, timeout=1.0
            )
            if got is not None:
                return got  # type: ignore[no-any-return]
            if self._conn.has_input():
                raise TransferError(f"the decode side gave up on {msg.transfer_id}")

    async def _move(
        self,
        msg: wire.SendBlocks,
        formatter: Formatter,
        peer: Peer,
        src_ids: list[int],
        dst_ids: tuple[int, ...],
    ) -> None:
        """Steps 4-5b for ``src_ids`` -> ``dst_ids``: plan, stage, send, TransferDone,
        digests. Raises TransferError only where the byte stream broke (inline backends)."""
        backend = self._local.backend
        try:
            plan = formatter.plan(src_ids, dst_ids)
            if not backend.inline_bytes and self._conn.has_input():
                raise TransferError(f"the decode side gave up on {msg.transfer_id} already")
            plan = self._stage(formatter, src_ids, dst_ids, plan)
        except TransferError as exc:
            self._record(exc)
            await self._fail(msg.transfer_id, exc)
            return
        outbound: Outbound | None = None
        # Integrity: the source digests are computed where the bytes are touched anyway (TCP:
        # each group right before the socket reads it) or once the WRITE is done, while the
        # receiver hashes what landed; they follow the bytes / TransferDone either way.
        digests = self._digester.at_source(plan, msg.digest) if msg.integrity else None
        try:
            try:
                outbound = backend.start_send(self._conn, plan, peer, msg.transfer_id, digests)
                # The receiver is silent until the answer; input now means Abort or a closed
                # connection: cancel the WRITE so nothing lands in blocks it may reuse.
                await outbound.wait(self._timeout_s, abandoned=self._conn.has_input)
            except TransferError as exc:
                if backend.inline_bytes:
                    raise  # the byte stream is broken mid-way: only closing tells the peer
                self._record(exc)
                await self._fail(msg.transfer_id, exc)
                return
            except BaseException:  # cancelled (transceiver closing): stop writing into the peer
                if outbound is not None:
                    outbound.abort()
                raise
            if not backend.inline_bytes:  # inline bytes complete themselves (count known)
                await self._conn.send(
                    wire.TransferDone(transfer_id=msg.transfer_id, nbytes=plan.nbytes)
                )
            if digests is not None:  # TCP: the bytes' trailer; otherwise after TransferDone
                try:
                    text = encode(digests.finish())
                except TransferError as exc:  # the memory could not be hashed (a device error)
                    self._record(exc)
                    await self._fail(msg.transfer_id, exc)
                    return
                await self._send_digests(msg.transfer_id, text, msg.digest)
        finally:  # nothing reads the staging buffer any more: lend it to the next send
            if plan.source is not None and self._local.staging is not None:
                self._local.staging.release(plan)

    async def _send_digests(
        self, transfer_id: str, digests: str, algorithm: wire.DigestAlgorithm
    ) -> None:
        await self._conn.send(
            wire.BlockDigests(transfer_id=transfer_id, digests=digests, algorithm=algorithm)
        )

    def _stage(
        self,
        formatter: Formatter,
        src_ids: list[int],
        dst_ids: tuple[int, ...],
        plan: TransferPlan,
    ) -> TransferPlan:
        """A converting formatter's plan reads the K/V re-blocked/converted into a staging
        buffer lent by the transceiver's StagingPool (released once the send has ended);
        an identity plan reads the pool itself. Raises TransferError."""
        if not formatter.staged:
            return plan
        if self._local.staging is None:
            raise TransferError(f"worker {self._local.worker_id} cannot stage converted KV bytes")
        return self._local.staging.fill(formatter, src_ids, dst_ids, plan)

    def _lookup(self, msg: wire.SendBlocks) -> list[int]:
        if self._parked is None:
            raise HandleError(f"worker {self._local.worker_id} holds no parked KV blocks")
        # The refusals below go to the peer: generic, never the parked ids, lease or epoch
        # (ParkedBlocks.lookup refuses the same way and logs the details).
        parked = list(self._parked.lookup(msg.request_id, msg.epoch, msg.lease_id))
        block_ids = parked[msg.skip_blocks :]  # delta transfer: the peer holds the rest
        if not block_ids or tuple(block_ids) != msg.src_block_ids:
            log.warning(
                "request %s asked for blocks %s after skipping %d; %s are parked",
                msg.request_id,
                list(msg.src_block_ids),
                msg.skip_blocks,
                parked,
            )
            raise HandleError(
                f"the blocks asked for (after skipping {msg.skip_blocks}) are not the handle's"
            )
        return block_ids

    async def _fail(self, transfer_id: str, exc: TransferError) -> None:
        await self._conn.send(
            wire.TransferFailed(
                transfer_id=transfer_id, code=wire.error_code(exc), message=exc.message
            )
        )

    def _record(self, exc: TransferError) -> None:
        log.warning("KV transfer to %s failed: %s", self._conn.peer, exc.message)
        self._errors.append(exc)
