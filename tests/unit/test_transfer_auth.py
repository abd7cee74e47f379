"""The transceivers' challenge-response (:mod:`pdserve.transfer.connection.auth`): the proofs, the frames,
the rate-limited refusal log, and the two sides' behaviour against peers that misbehave, over
real sockets in this process (the process-level tests: tests/integration/test_transfer_auth.py)."""

from __future__ import annotations

import asyncio
import logging

import pydantic
import pytest

from pdserve.errors import TransferError
from pdserve.security import nonce
from pdserve.transfer import wire
from pdserve.transfer.connection import auth
from pdserve.transfer.connection.auth import AuthFailures, Exchange
from pdserve.transfer.connection.control import Connection
from tests.support.servers import wait_until
from tests.support.transfer import OTHER_KEY, TEST_KEY, backend_cfg
from tests.support.transfer_inproc import LAYOUT_SMALL as LAYOUT
from tests.support.transfer_inproc import (
    SERVING_EPOCH,
    SERVING_ID,
    LocalPrefill,
    decode_side,
)
from tests.support.transfer_inproc import serving_transceiver as transceiver


def _exchange(**changes: object) -> Exchange:
    fields: dict[str, object] = {
        "dialer": "decode-0", "n_d": b"d" * 16, "listener": "prefill-0", "epoch": 3,
        "n_p": b"p" * 16,
    }  # fmt: skip
    fields.update(changes)
    return Exchange(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------ proofs and frames


def test_each_side_proves_under_its_own_label_so_no_proof_is_valid_for_the_other_side() -> None:
    ex = _exchange()
    assert ex.listener_proven(TEST_KEY, ex.listener_proof(TEST_KEY))
    assert ex.dialer_proven(TEST_KEY, ex.dialer_proof(TEST_KEY))
    assert not ex.dialer_proven(TEST_KEY, ex.listener_proof(TEST_KEY)), "reflection"
    assert not ex.listener_proven(TEST_KEY, ex.dialer_proof(TEST_KEY))
    # same nonces in swapped roles: still no reflection
    swapped = _exchange(n_d=ex.n_p, n_p=ex.n_d)
    assert not ex.dialer_proven(TEST_KEY, swapped.listener_proof(TEST_KEY))


@pytest.mark.parametrize(
    "change",
    [
        {"n_d": b"x" * 16},
        {"n_p": b"x" * 16},
        {"dialer": "decode-1"},
        {"listener": "prefill-1"},
        {"epoch": 4},
    ],
)
def test_proofs_cover_both_nonces_and_both_identities(change: dict[str, object]) -> None:
    ex, other = _exchange(), _exchange(**change)
    assert not other.listener_proven(TEST_KEY, ex.listener_proof(TEST_KEY))
    assert not other.dialer_proven(TEST_KEY, ex.dialer_proof(TEST_KEY))


def test_a_proof_under_another_secret_does_not_verify() -> None:
    ex = _exchange()
    assert not ex.listener_proven(TEST_KEY, ex.listener_proof(OTHER_KEY))
    assert not ex.dialer_proven(TEST_KEY, ex.dialer_proof(OTHER_KEY))


@pytest.mark.parametrize("bad", ["", "00" * 15, "zz" * 16, "AA" * 16, "00" * 17])
def test_auth_frames_take_only_lowercase_hex_nonces_of_16_bytes(bad: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        wire.AuthHello(peer_id="d", nonce=bad)


def test_refusal_frame_carries_nothing_but_the_fact() -> None:
    assert wire.AuthRefused().model_dump() == {
        "type": "auth_refused", "code": "kv_auth_failed", "message": "authentication failed"
    }  # fmt: skip
    with pytest.raises(pydantic.ValidationError):
        wire.AuthRefused(message="wrong secret for worker prefill-0")


def test_frame_limit_before_authentication_is_64_kib() -> None:
    header = wire.HEADER.pack(wire.PREAUTH_MAX_FRAME_BYTES + 1)
    assert wire.frame_length(header) == wire.PREAUTH_MAX_FRAME_BYTES + 1  # after: allowed
    with pytest.raises(TransferError, match="exceeds 65536"):
        wire.frame_length(header, wire.PREAUTH_MAX_FRAME_BYTES)


# ------------------------------------------------------------------ refusal log


def test_refusals_are_counted_and_logged_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    failures = AuthFailures(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="pdserve.transfer.connection.auth"):
        for i in range(5):
            failures.record(f"10.0.0.9:{4000 + i}", "wrong proof")
        now[0] += 10.0
        failures.record("10.0.0.9:5000", "wrong proof")
    assert failures.total == 6
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "10.0.0.9:4000" in lines[0] and "more refused" not in lines[0]
    assert "10.0.0.9:5000" in lines[1] and "(4 more refused since the last report)" in lines[1]


# ------------------------------------------------------------------ against real sockets


async def test_dialer_facing_a_listener_without_the_secret_sends_nothing_after_its_hello() -> None:
    """A fake listener answers with a proof it cannot have made; the dialer refuses it and
    closes: after AuthHello the listener receives nothing (no proof, no Hello)."""
    received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = await reader.readexactly(wire.HEADER.size)
        hello = wire.decode(await reader.readexactly(wire.frame_length(header)))
        assert isinstance(hello, wire.AuthHello)
        forged = wire.AuthChallenge(
            worker_id="prefill-x", epoch=1, nonce=nonce().hex(), proof="ab" * 32
        )
        writer.write(wire.encode(forged))
        received.set_result(await reader.read())  # everything until the dialer closes
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await Connection.open(f"127.0.0.1:{port}", 5.0)
        with pytest.raises(TransferError, match="could not prove") as err:
            await auth.dial(conn, TEST_KEY, "decode-0")
        assert err.value.code == "kv_auth_failed" and conn.closed
        assert await asyncio.wait_for(received, 5.0) == b""
    finally:
        server.close()
        await server.wait_closed()


async def test_silent_peer_is_disconnected_after_the_timeout_and_counted() -> None:
    async with transceiver(timeout_s=0.3) as t:
        host, port = t.endpoint.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed, nothing said
        writer.close()
        await wait_until(lambda: t.auth_failures.total == 1, 5.0, what="the refusal counted")


async def test_after_authentication_a_hello_may_exceed_the_pre_authentication_limit() -> None:
    """64 KiB bounds unauthenticated peers only: a proven peer's Hello (NIXL metadata can be
    large) is read up to the normal frame limit."""
    async with transceiver() as t:
        conn = await Connection.open(t.endpoint, 5.0)
        try:
            challenge = await auth.dial(conn, TEST_KEY, "decode-0")
            assert (challenge.worker_id, challenge.epoch) == (SERVING_ID, SERVING_EPOCH)
            hello = wire.Hello(
                worker_id="decode-0", epoch=1, layout=LAYOUT, backend="tcp", num_blocks=4,
                ucx=wire.UcxPeerInfo(address_b64="A" * (wire.PREAUTH_MAX_FRAME_BYTES + 1)),
            )  # fmt: skip
            await conn.send(hello)
            ack = await conn.recv()
        finally:
            conn.close()
        assert isinstance(ack, wire.HelloAck) and ack.ok, ack
        assert t.auth_failures.total == 0


async def test_hello_naming_another_worker_than_the_authenticated_one_is_refused() -> None:
    async with transceiver() as t:
        conn = await Connection.open(t.endpoint, 5.0)
        try:
            await auth.dial(conn, TEST_KEY, "decode-0")
            await conn.send(
                wire.Hello(
                    worker_id="decode-9", epoch=1, layout=LAYOUT, backend="tcp", num_blocks=4
                )
            )
            ack = await conn.recv()
        finally:
            conn.close()
    assert isinstance(ack, wire.HelloAck) and not ack.ok
    assert ack.message is not None and "authenticated as 'decode-0'" in ack.message


async def test_authentication_runs_once_per_connection_not_per_pull(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-request conversation is what it was: a second pull on the cached connection
    sends SendBlocks and Release only."""
    sent: list[str] = []
    original = Connection.send

    async def spy(self: Connection, msg: wire._Wire) -> None:
        sent.append(getattr(msg, "type", "?"))
        await original(self, msg)

    cfg = backend_cfg("tcp", integrity=False)
    async with LocalPrefill(cfg) as prefill, decode_side(cfg) as (decode, _):
        first_handle = prefill.park(2 * prefill.layout.tokens_per_block)
        second_handle = prefill.park(2 * prefill.layout.tokens_per_block)
        monkeypatch.setattr(Connection, "send", spy)
        await decode.pull(first_handle, [2, 3])
        first = list(sent)
        sent.clear()
        await decode.pull(second_handle, [0, 1])
        second = list(sent)
    handshake = ["auth_hello", "auth_challenge", "auth_proof", "hello", "hello_ack"]
    assert first == [*handshake, "send_blocks", "release"], first  # both sides' control frames
    assert second == ["send_blocks", "release"], second  # (BlockData goes with the bytes)
