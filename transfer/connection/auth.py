"""Mutual challenge-response on the cluster secret, first thing on every transfer connection.

Design origin: a closed internal plane (a peer without the cluster secret can neither
ask for blocks, release leases nor receive KV) and the three-pass mutual authentication of
ISO/IEC 9798-4 (MAC-based, a fresh nonce from each side, a different label per direction so
that one side's proof is never valid as the other's). The MAC is
:meth:`pdserve.security.ClusterKey.proof` (HMAC-SHA256 under a key derived from the secret, so
the secret itself never crosses the network); every comparison is constant-time
(:meth:`~pdserve.security.ClusterKey.verify`).

The exchange (frames of :mod:`pdserve.transfer.wire`, each at most
:data:`~pdserve.transfer.wire.PREAUTH_MAX_FRAME_BYTES` until it is over)::

    dialer D (decode worker, doctor)            listener P (the transceiver dialled)
    AuthHello(peer_id=D, nonce=n_d)         ->
                                            <-  AuthChallenge(worker_id=P, epoch=e, nonce=n_p,
                                                  proof_p = proof("transfer prefill",
                                                                  n_d, n_p, P, e, D))
    checks proof_p; else closes: TransferError
    kv_auth_failed, and nothing of D was sent
    AuthProof(proof_d = proof("transfer decode",
                              n_p, n_d, D, P, e))   ->
                                                checks proof_d; else AuthRefused
                                                ("authentication failed") and closes
    then Hello (or Probe): D sends it right behind AuthProof; P reads it only once proof_d
    checked out, and answers HelloAck (or ProbeData), or AuthRefused in its place.

So the listener does nothing stateful for an unproven peer: no formatter negotiation, no NIXL
``add_remote_agent``, no UCX endpoint, no lease lookup or release (those follow the Hello).
An unproven peer can make it allocate one 64 KiB frame at a time, for at most the
authentication deadline (:data:`pdserve.transfer.sender.AUTH_TIMEOUT_S`), in an unproven slot a
newer connection may evict (:mod:`pdserve.transfer.connection.admission`). A peer that fails is counted
and logged with its address (:class:`AuthFailures`, at most one line per 10 s). "prefill" in
the listener's label stands for the listening side (a decode worker answering a probe signs
with it too).

Not covered: the bytes after the handshake are neither encrypted nor MACed (an active attacker
on the path could take over an authenticated TCP connection); the KV data plane is meant for a
private network. One secret per deployment: every holder can act as any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import TransferError
from pdserve.security import ClusterKey, nonce
from pdserve.transfer import wire
from pdserve.transfer.connection.control import Connection

log = logging.getLogger(__name__)

LISTENER_LABEL = "transfer prefill"
"""Proof label of the listening side (the transceiver dialled)."""
DIALER_LABEL = "transfer decode"
"""Proof label of the dialling side (a decode worker pulling, the doctor probing)."""
PROBE_PEER_ID = "pdserve-doctor"
"""The ``peer_id`` a bandwidth probe dials with."""


@dataclass(frozen=True)
class Exchange:
    """What the two proofs of one exchange cover: both identities (``dialer``: its peer id;
    ``listener``: its worker id at ``epoch``) and both 16-byte nonces."""

    dialer: str
    n_d: bytes
    listener: str
    epoch: int
    n_p: bytes

    def _listener_parts(self) -> tuple[bytes | str, ...]:
        return (self.n_d, self.n_p, self.listener, str(self.epoch), self.dialer)

    def _dialer_parts(self) -> tuple[bytes | str, ...]:  # nonces in the other order
        return (self.n_p, self.n_d, self.dialer, self.listener, str(self.epoch))

    def listener_proof(self, key: ClusterKey) -> bytes:
        """``proof_p`` (32 bytes): the listener holds the secret."""
        return key.proof(LISTENER_LABEL, *self._listener_parts())

    def dialer_proof(self, key: ClusterKey) -> bytes:
        """``proof_d`` (32 bytes): the dialer holds the secret. Another label and another
        order than ``proof_p``, so that no listener proof is ever a valid dialer proof."""
        return key.proof(DIALER_LABEL, *self._dialer_parts())

    def listener_proven(self, key: ClusterKey, proof: bytes) -> bool:
        """Whether ``proof`` is :meth:`listener_proof` (constant time)."""
        return key.verify(proof, LISTENER_LABEL, *self._listener_parts())

    def dialer_proven(self, key: ClusterKey, proof: bytes) -> bool:
        """Whether ``proof`` is :meth:`dialer_proof` (constant time)."""
        return key.verify(proof, DIALER_LABEL, *self._dialer_parts())


def check_refused(msg: wire.Message, peer: str) -> None:
    """Raise TransferError ``kv_auth_failed`` if ``msg`` is the listener's AuthRefused (it did
    not accept this side's proof: the two sides hold different cluster secrets)."""
    if isinstance(msg, wire.AuthRefused):
        raise TransferError(
            f"transfer peer {peer} refused this worker's authentication: the two hold "
            "different cluster secrets (security.cluster_secret_file)",
            code=wire.AUTH_FAILED,
        )


async def dial(conn: Connection, key: ClusterKey, peer_id: str) -> wire.AuthChallenge:
    """Dialling side: authenticate the listener on ``conn`` and prove ``peer_id`` to it.

    Returns the verified AuthChallenge (the listener's worker id and epoch, which its proof
    covers); the listener's verdict on this side's proof comes with its next answer (see
    :func:`check_refused`). Raises TransferError ``kv_auth_failed`` (refused, or the listener's
    proof does not verify: then ``conn`` is closed and nothing more was sent), or TransferError
    (connection lost, not a transceiver of this version)."""
    n_d = nonce()
    await conn.send(wire.AuthHello(peer_id=peer_id, nonce=n_d.hex()))
    try:
        msg = await conn.recv(wire.PREAUTH_MAX_FRAME_BYTES)
    except TransferError as exc:
        raise TransferError(
            f"{exc.message} (while authenticating: {conn.peer} closed the connection before "
            "its challenge; it sheds connections past its caps, or is no pdserve transfer "
            "endpoint of this version)",
            code=wire.CONNECTION_SHED,
        ) from exc
    check_refused(msg, conn.peer)
    if not isinstance(msg, wire.AuthChallenge):
        conn.close()
        raise TransferError(
            f"expected auth_challenge from {conn.peer}, got {msg.type!r}", code=wire.AUTH_FAILED
        )
    exchange = Exchange(peer_id, n_d, msg.worker_id, msg.epoch, bytes.fromhex(msg.nonce))
    if not exchange.listener_proven(key, bytes.fromhex(msg.proof)):
        conn.close()
        raise TransferError(
            f"transfer peer {conn.peer} (claiming worker {msg.worker_id!r}) could not prove "
            "that it holds this worker's cluster secret (the two hold different secrets, or it "
            "is no worker of this deployment); nothing was sent to it",
            code=wire.AUTH_FAILED,
        )
    await conn.send(wire.AuthProof(proof=exchange.dialer_proof(key).hex()))
    return msg


async def accept(
    conn: Connection,
    key: ClusterKey,
    *,
    worker_id: str,
    epoch: int,
    start_timeout_s: float | None = None,
) -> str:
    """Listening side: authenticate the dialer on ``conn`` (this side is ``worker_id`` at
    ``epoch``). Returns the dialer's proven ``peer_id``.

    Raises TransferError ``kv_auth_failed`` for anything but a correct proof: a first frame
    that is not AuthHello, a frame over 64 KiB, garbage, a closed connection, a wrong proof
    (then AuthRefused is sent first); ``conn`` is closed then. Raises TimeoutError when the
    AuthHello is not in within ``start_timeout_s`` (None: no limit); the caller bounds the
    whole exchange's time."""
    try:
        async with asyncio.timeout(start_timeout_s):
            hello = await conn.recv(wire.PREAUTH_MAX_FRAME_BYTES)
        if not isinstance(hello, wire.AuthHello):
            raise TransferError(f"expected auth_hello, got {hello.type!r}")
        exchange = Exchange(hello.peer_id, bytes.fromhex(hello.nonce), worker_id, epoch, nonce())
        await conn.send(
            wire.AuthChallenge(
                worker_id=worker_id,
                epoch=epoch,
                nonce=exchange.n_p.hex(),
                proof=exchange.listener_proof(key).hex(),
            )
        )
        answer = await conn.recv(wire.PREAUTH_MAX_FRAME_BYTES)
        if not isinstance(answer, wire.AuthProof):
            raise TransferError(f"expected auth_proof, got {answer.type!r}")
    except TransferError as exc:
        conn.close()
        raise TransferError(f"unauthenticated: {exc.message}", code=wire.AUTH_FAILED) from exc
    if not exchange.dialer_proven(key, bytes.fromhex(answer.proof)):
        await _refuse(conn)
        raise TransferError(
            f"peer claiming to be {hello.peer_id!r} failed authentication (its proof does not "
            "match this worker's cluster secret)",
            code=wire.AUTH_FAILED,
        )
    return hello.peer_id


REFUSAL_DRAIN_S = 1.0
"""After AuthRefused, how long the listener reads (and drops) what the peer had already
pipelined before closing, so that the close does not reset the connection."""


async def _refuse(conn: Connection) -> None:
    """Send AuthRefused, then FIN, then drain the peer's pipelined frames (at most
    :data:`REFUSAL_DRAIN_S` seconds and 4 x 64 KiB) and close. Closing a socket with unread
    input makes the kernel send RST, and a peer that gets RST loses the refusal it had not read
    yet; draining first lets it read AuthRefused and then EOF."""
    with contextlib.suppress(TransferError):
        await conn.send(wire.AuthRefused())
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, TimeoutError):
        conn.sock.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(REFUSAL_DRAIN_S):
            drained = 0
            while drained < 4 * wire.PREAUTH_MAX_FRAME_BYTES:
                data = await loop.sock_recv(conn.sock, 65536)
                if not data:
                    break
                drained += len(data)
    conn.close()


class AuthFailures:
    """The peers one transceiver refused: :attr:`total` counts them; :meth:`record` logs a
    warning naming the peer's address, at most one per ``interval_s`` seconds (a peer without
    the secret can connect in a loop), the next one saying how many went unlogged."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.total = 0
        self._interval_s = interval_s
        self._clock = clock
        self._quiet_until = -math.inf
        self._unlogged = 0

    def record(self, peer: str, why: str) -> None:
        """Count one refused connection from ``peer`` (``host:port``) and maybe log it."""
        self.total += 1
        now = self._clock()
        if now < self._quiet_until:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more refused since the last report)" if self._unlogged else ""
        why = why if len(why) <= 300 else why[:300] + "..."  # it quotes what the peer sent
        log.warning("KV transceiver refused the connection from %s: %s%s", peer, why, more)
        self._unlogged = 0
        self._quiet_until = now + self._interval_s
