"""The transceiver plane is closed: only a peer that proves it holds the cluster secret gets
anything, on every backend, between real processes.

The prefill side is a real transceiver with the real KV cache manager and lease table in a
spawned process (:mod:`tests.support.kv_peer`, which counts backend peers added, lease
lookups and refused connections); the decode side is this process's real transceiver, or a bare
connection speaking the wire protocol where a test plays an impostor. A refused peer raises
TransferError ``kv_auth_failed`` on its side, and the prefill side adds no backend peer, looks
up no lease, releases nothing, and serves a correct peer right afterwards.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from pdserve.errors import TransferError
from pdserve.security import nonce
from pdserve.transfer import wire
from pdserve.transfer.connection.auth import Exchange
from pdserve.transfer.connection.control import Connection, split_endpoint
from tests.support.kv_peer import PeerState, PrefillProcess
from tests.support.transfer import OTHER_KEY, OTHER_SECRET, TEST_KEY, assert_landed
from tests.support.transfer_inproc import DecodeSide, bare_side, decode_side

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def prefill(prefill_process: PrefillProcess) -> PrefillProcess:
    return prefill_process.reset()  # nothing parked, no counts, no recorded errors


@pytest.fixture
async def decode(prefill: PrefillProcess) -> AsyncIterator[DecodeSide]:
    async with decode_side(prefill.backend, worker_id="decode-a") as side:
        yield side


def _untouched(state: PeerState, parked: int) -> None:
    """Nothing stateful happened on the prefill side for the refused peer(s)."""
    assert state.peers_added == 0, "a backend peer (NIXL agent / UCX endpoint) was added"
    assert state.lookups == 0, "a lease was looked up"
    assert state.parked == parked, "a parked lease was released or freed"
    assert state.errors == [], "an unauthenticated peer must not fill the recent errors"


async def _served_afterwards(prefill: PrefillProcess, decode: DecodeSide) -> None:
    """The prefill worker still serves a peer that holds the secret."""
    t, pool = decode
    parked = prefill.state().parked
    handle = prefill.park(num_tokens=4)
    await t.pull(handle, [5])
    assert_landed(pool, handle.block_ids, [5])
    state = prefill.wait_state(lambda s: s.parked == parked)  # released
    assert state.peers_added == 1 and state.lookups == 1


async def test_decode_with_another_secret_is_refused_and_touches_nothing(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    handle = prefill.park(num_tokens=4)
    impostor = decode_side(prefill.backend, worker_id="decode-impostor", key=OTHER_KEY)
    async with impostor as (t, pool):
        with pytest.raises(TransferError, match="could not prove") as err:
            await t.pull(handle, [3])
        assert err.value.code == "kv_auth_failed"
    state = prefill.wait_state(lambda s: s.auth_failures == 1)
    _untouched(state, parked=1)
    assert not pool.any()
    await _served_afterwards(prefill, decode)


async def test_wrong_proof_gets_a_bare_refusal_and_the_pipelined_requests_are_ignored(
    prefill: PrefillProcess,
) -> None:
    """An impostor that skips the check of the prefill proof and answers with a proof under
    another secret, followed at once by Hello, SendBlocks and Release (as a real decode side
    pipelines its Hello): AuthRefused carrying nothing else, then EOF; none of it is served."""
    handle = prefill.park(num_tokens=4)
    with bare_side(prefill.backend, worker_id="decode-imp", key=OTHER_KEY) as (local, pool):
        conn = await Connection.open(prefill.endpoint, 10.0)
        try:
            n_d = nonce()
            await conn.send(wire.AuthHello(peer_id="decode-imp", nonce=n_d.hex()))
            challenge = await conn.recv()
            assert isinstance(challenge, wire.AuthChallenge)
            assert challenge.worker_id == "prefill-fenced"
            exchange = Exchange(
                "decode-imp", n_d, challenge.worker_id, challenge.epoch,
                bytes.fromhex(challenge.nonce),
            )  # fmt: skip
            await conn.send(wire.AuthProof(proof=exchange.dialer_proof(OTHER_KEY).hex()))
            await conn.send(local.hello())
            await conn.send(
                wire.SendBlocks(
                    request_id=handle.request_id, epoch=handle.epoch, lease_id=handle.lease_id,
                    transfer_id="t-imp", src_block_ids=handle.block_ids, dst_block_ids=(0,),
                )
            )  # fmt: skip
            await conn.send(wire.Release(request_id=handle.request_id, lease_id=handle.lease_id))
            refusal = await conn.recv()
            assert refusal == wire.AuthRefused()
            assert refusal.model_dump() == {
                "type": "auth_refused", "code": "kv_auth_failed", "message": "authentication failed"
            }  # fmt: skip
            with pytest.raises(TransferError, match="closed the connection"):
                await conn.recv()  # EOF, not a reset: the listener drained the pipelined frames
        finally:
            conn.close()
    state = prefill.wait_state(lambda s: s.auth_failures == 1)
    _untouched(state, parked=1)
    assert not pool.any()


async def test_replayed_proof_of_an_earlier_connection_is_refused(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    """Nonces from both sides: a proof seen on the wire is worthless on a new connection, even
    with the same dialer nonce."""
    conn = await Connection.open(prefill.endpoint, 10.0)
    n_d = nonce()
    try:  # an honest exchange, recorded
        await conn.send(wire.AuthHello(peer_id="decode-a", nonce=n_d.hex()))
        first = await conn.recv()
        assert isinstance(first, wire.AuthChallenge)
        ex = Exchange("decode-a", n_d, first.worker_id, first.epoch, bytes.fromhex(first.nonce))
        recorded = ex.dialer_proof(TEST_KEY).hex()
    finally:
        conn.close()
    prefill.wait_state(lambda s: s.auth_failures == 1)  # it left before proving: counted
    conn = await Connection.open(prefill.endpoint, 10.0)
    try:
        await conn.send(wire.AuthHello(peer_id="decode-a", nonce=n_d.hex()))
        second = await conn.recv()
        assert isinstance(second, wire.AuthChallenge) and second.nonce != first.nonce
        await conn.send(wire.AuthProof(proof=recorded))
        assert isinstance(await conn.recv(), wire.AuthRefused)
        reflected = wire.AuthProof(proof=second.proof)  # the prefill's own proof, sent back
    finally:
        conn.close()
    conn = await Connection.open(prefill.endpoint, 10.0)
    try:
        await conn.send(wire.AuthHello(peer_id="decode-a", nonce=n_d.hex()))
        await conn.recv()
        await conn.send(reflected)
        assert isinstance(await conn.recv(), wire.AuthRefused)
    finally:
        conn.close()
    _untouched(prefill.wait_state(lambda s: s.auth_failures == 3), parked=0)
    await _served_afterwards(prefill, decode)


async def test_prefill_with_another_secret_is_detected_by_the_decode_side(
    prefill: PrefillProcess,
) -> None:
    """The decode side checks the prefill proof first: against a prefill worker of another
    deployment it raises kv_auth_failed and sends neither its proof nor its Hello (so no
    NIXL metadata or UCX address reaches it)."""
    other = PrefillProcess(prefill.backend, secret=OTHER_SECRET)
    try:
        async with decode_side(prefill.backend, worker_id="decode-a") as (t, pool):
            handle = other.park(num_tokens=4)
            with pytest.raises(TransferError, match="could not prove") as err:
                await t.pull(handle, [3])
            assert err.value.code == "kv_auth_failed"
            state = other.wait_state(lambda s: s.auth_failures == 1)
            _untouched(state, parked=1)
            assert not pool.any()
    finally:
        other.stop()


def _raw(endpoint: str) -> socket.socket:
    host, port = split_endpoint(endpoint)
    sock = socket.create_connection((host, port), timeout=10.0)
    return sock


def _closed_by_peer(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes (a reset counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.mark.parametrize(
    "first_bytes",
    [
        pytest.param(wire.HEADER.pack(wire.PREAUTH_MAX_FRAME_BYTES + 1), id="oversized-header"),
        pytest.param(wire.HEADER.pack(16) + b"\xff" * 16, id="garbage-payload"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http-request"),
        pytest.param(wire.encode(wire.Probe(nbytes=1 << 20)), id="probe-before-auth"),
    ],
)
async def test_garbage_or_an_oversized_frame_before_authentication_is_disconnected(
    prefill: PrefillProcess, decode: DecodeSide, first_bytes: bytes
) -> None:
    """The connection is closed without an answer; an oversized header is refused on sight,
    before its payload (never sent here) is read or allocated."""
    sock = await asyncio.to_thread(_raw, prefill.endpoint)
    try:
        sock.sendall(first_bytes)
        assert await asyncio.to_thread(_closed_by_peer, sock) == b""
    finally:
        sock.close()
    _untouched(prefill.wait_state(lambda s: s.auth_failures == 1), parked=0)
    await _served_afterwards(prefill, decode)


async def test_hello_before_authentication_is_disconnected_and_adds_no_peer(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    """The previous protocol's first message (Hello, carrying a NIXL agent / UCX address) is
    not read as one before authentication: no backend peer is prepared for it."""
    with bare_side(prefill.backend, worker_id="decode-old") as (local, _):
        sock = await asyncio.to_thread(_raw, prefill.endpoint)
        try:
            sock.sendall(wire.encode(local.hello()))
            assert await asyncio.to_thread(_closed_by_peer, sock) == b""
        finally:
            sock.close()
    _untouched(prefill.wait_state(lambda s: s.auth_failures == 1), parked=0)
    await _served_afterwards(prefill, decode)
