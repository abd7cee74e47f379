"""A hostile peer against a prefill worker's transceiver (issue 13), between real processes.

The prefill side is a real transceiver with the real KV cache manager and lease table in a
spawned process (:mod:`tests.support.kv_peer`); the attacker is this process, speaking the
wire protocol on bare sockets (with or without the cluster secret: a peer that holds it may still
be a compromised worker). For every attack the worker refuses, its resident memory stays within a
bound far below what the attack asked for (measured from ``/proc``), a correct decode worker's
pull completes during or right after the attack, and nothing the attacker receives names a lease
id or the parked block ids.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pdserve.protocol import PROTOCOL_VERSION
from pdserve.transfer import wire
from pdserve.transfer.connection.admission import MAX_UNPROVEN_PER_HOST
from pdserve.transfer.connection.auth import dial
from pdserve.transfer.connection.control import FRAME_TIMEOUT_S, Connection, split_endpoint
from pdserve.transfer.sender import AUTH_START_S
from tests.support.kv_peer import PrefillProcess
from tests.support.servers import wait_until
from tests.support.transfer import LAYOUT, TEST_KEY, assert_landed
from tests.support.transfer_inproc import DecodeSide, bare_side, decode_side

pytestmark = pytest.mark.timeout(120)

ATTACKER_HOST = "127.0.0.2"  # loopback too, but another peer address than the decode worker's
MIB = 1 << 20


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillProcess]:
    peer = PrefillProcess("tcp")
    yield peer
    peer.stop()


@pytest.fixture(autouse=True)
def _fresh_prefill(prefill: PrefillProcess) -> None:
    prefill.call("reset")


@pytest.fixture
async def decode() -> AsyncIterator[DecodeSide]:
    async with decode_side("tcp", worker_id="decode-ok") as side:
        yield side


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Memory of process ``pid`` in MiB: resident (``VmRSS``) or, ``field="VmSize"``, all it
    mapped (a large zeroed buffer is mapped at once but resident only once written)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for pid {pid}")


def unread_bytes(endpoint: str, conns: list[Connection]) -> int | None:
    """Bytes the worker at ``endpoint`` has yet to read from ``conns`` (the receive queues of
    its ends, from ``/proc/net/tcp``); None while it has not accepted all of them. Only
    established sockets count: an earlier test's connection that the worker closed may linger
    in TIME_WAIT with a client port the kernel gave one of ``conns`` again."""
    port = split_endpoint(endpoint)[1]
    ours = {conn.sock.getsockname()[1] for conn in conns}
    found, queued = 0, 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, local, remote, state, queues, *_ = line.split()
        if state != "01":  # TCP_ESTABLISHED
            continue
        if int(local.rsplit(":", 1)[1], 16) == port and int(remote.rsplit(":", 1)[1], 16) in ours:
            found += 1
            queued += int(queues.split(":")[1], 16)
    return queued if found == len(conns) else None


async def pull_completes(prefill: PrefillProcess, decode: DecodeSide) -> str:
    """A correct decode worker's pull of freshly parked blocks lands intact; returns its lease
    id (so a test can check the attacker never saw it)."""
    t, pool = decode
    handle = prefill.park(8, f"ok-{uuid.uuid4().hex[:6]}")
    await t.pull(handle, [3, 4])
    assert_landed(pool, handle.block_ids, [3, 4])
    return handle.lease_id


async def attacker(endpoint: str) -> Connection:
    """A TCP connection to ``endpoint`` from :data:`ATTACKER_HOST`."""
    host, port = split_endpoint(endpoint)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((ATTACKER_HOST, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return Connection(sock, endpoint)


async def authenticated(endpoint: str) -> Connection:
    """An attacker that holds the cluster secret (a compromised worker): proven, no Hello yet."""
    conn = await attacker(endpoint)
    await dial(conn, TEST_KEY, "decode-hostile")
    return conn


async def read_until_closed(conn: Connection, timeout_s: float) -> bytes:
    """Everything the worker sends until it closes the connection (AssertionError if it stays
    open past ``timeout_s``)."""
    loop, got = asyncio.get_running_loop(), bytearray()
    async with asyncio.timeout(timeout_s):
        while chunk := await loop.sock_recv(conn.sock, 65536):
            got += chunk
    conn.close()
    return bytes(got)


def frame(payload: dict[str, object]) -> bytes:
    """A frame of raw JSON, as pydantic would refuse to build it."""
    body = json.dumps(payload).encode()
    return wire.HEADER.pack(len(body)) + body


async def test_frame_headers_announcing_16_mib_allocate_nothing_up_front(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    """Authenticated peers announce 16 MiB control frames and send 100 bytes of each: the
    worker buffers what arrived, not what was announced, and drops each connection once the
    frame has not completed within the frame timeout."""
    before = rss_mib(prefill.pid, "VmSize")
    conns = [await authenticated(prefill.endpoint) for _ in range(40)]  # 640 MiB announced
    for conn in conns:
        conn.sock.send(wire.HEADER.pack(wire.MAX_FRAME_BYTES) + b"{" + b" " * 99)
    await wait_until(
        lambda: unread_bytes(prefill.endpoint, conns) == 0,
        10.0,
        what="the worker to read every byte sent (where it would allocate up front)",
    )
    grown = rss_mib(prefill.pid, "VmSize") - before
    lease = await pull_completes(prefill, decode)
    t0 = time.monotonic()
    answers = await asyncio.gather(*(read_until_closed(c, FRAME_TIMEOUT_S + 10) for c in conns))
    assert time.monotonic() - t0 < FRAME_TIMEOUT_S + 10
    assert grown < 64, f"{grown:.0f} MiB for 640 MiB of announced frames"
    assert all(lease.encode() not in a for a in answers)
    await pull_completes(prefill, decode)


async def test_a_thousand_connections_from_one_host_are_capped(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    """Beyond MAX_UNPROVEN_PER_HOST unauthenticated connections from one address, the worker
    evicts the oldest (before reading a byte of it); the rest close at the authentication
    start deadline; a decode worker at another address is served."""
    before = rss_mib(prefill.pid)
    conns = await asyncio.gather(*(attacker(prefill.endpoint) for _ in range(1000)))
    try:
        lease = await pull_completes(prefill, decode)  # during the flood
        state = prefill.wait_state(
            lambda s: s.auth_failures >= 1000 - MAX_UNPROVEN_PER_HOST, timeout=60
        )  # generous: a burst past the listen backlog waits for the kernel's SYN-ACK retries
        assert state.lookups == 1 and state.peers_added == 1, "only the decode worker got in"
        grown = rss_mib(prefill.pid) - before
        assert grown < 64, f"{grown:.0f} MiB for 1000 connections"
        prefill.wait_state(lambda s: s.auth_failures == 1000, timeout=AUTH_START_S + 10)
    finally:
        for conn in conns:
            conn.close()
    assert lease


def still_open(conn: Connection) -> bool:
    """Whether the worker has not closed ``conn`` (no EOF or reset waiting to be read)."""
    try:
        return conn.sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


async def test_a_silent_flood_from_the_decode_workers_own_address_does_not_starve_it(
    prefill: PrefillProcess,
) -> None:
    """300 connections that never authenticate, from the address the decode worker dials
    from: they hold at most MAX_UNPROVEN_PER_HOST unproven slots (older ones are evicted), none
    outlives the authentication start deadline, and every pull the decode worker makes
    meanwhile (each on a new connection from the same address) completes."""
    host, port = split_endpoint(prefill.endpoint)
    loop = asyncio.get_running_loop()

    async def silent() -> Connection:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))  # from 127.0.0.1, as the decode worker
        return Connection(sock, prefill.endpoint)

    flood = [await silent() for _ in range(300)]
    try:
        leases = []
        for _ in range(3):
            # A decode transceiver of its own each time: every pull dials into the flood.
            async with decode_side("tcp", worker_id="decode-ok") as decode:
                leases.append(await pull_completes(prefill, decode))
            flood += [await silent() for _ in range(100)]
        prefill.wait_state(lambda s: s.auth_failures >= len(flood) - MAX_UNPROVEN_PER_HOST)
        # The evictions' closes reach this side well before the held ones' 2 s deadline.
        await wait_until(
            lambda: sum(still_open(c) for c in flood) <= MAX_UNPROVEN_PER_HOST,
            1.0,
            what=lambda: f"{sum(still_open(c) for c in flood)} unauthenticated sockets held",
        )
        prefill.wait_state(lambda s: s.auth_failures >= len(flood), timeout=AUTH_START_S + 10)
        assert not any(still_open(c) for c in flood)
        assert len(set(leases)) == 3
    finally:
        for conn in flood:
            conn.close()


async def test_a_hello_with_an_absurd_layout_is_refused_before_any_allocation(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    """A proven peer says it has 2**20 tokens per block (a converting formatter would stage
    tens of GB for it) or 2**40 blocks: the Hello fails validation, the connection closes."""
    before = rss_mib(prefill.pid)
    hello = {
        "type": "hello", "protocol_version": PROTOCOL_VERSION, "worker_id": "decode-hostile",
        "epoch": 1, "layout": {**LAYOUT.model_dump(), "tokens_per_block": 1 << 20},
        "backend": "tcp", "num_blocks": 4,
    }  # fmt: skip
    for absurd in (hello, {**hello, "layout": LAYOUT.model_dump(), "num_blocks": 1 << 40}):
        conn = await authenticated(prefill.endpoint)
        conn.sock.send(frame(absurd))
        assert await read_until_closed(conn, 10) == b""
    errors = prefill.wait_state(lambda s: len(s.errors) == 2).errors
    assert "tokens_per_block" in errors[0][1] and "num_blocks" in errors[1][1], errors
    assert rss_mib(prefill.pid) - before < 64
    state = prefill.state()
    assert state.peers_added == 0 and state.lookups == 0
    await pull_completes(prefill, decode)


async def test_a_probe_before_the_handshake_gets_no_byte(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    conn = await attacker(prefill.endpoint)
    conn.sock.send(wire.encode(wire.Probe(nbytes=wire.PROBE_MAX_BYTES)))
    assert await read_until_closed(conn, 15) == b""
    prefill.wait_state(lambda s: s.auth_failures == 1)
    await pull_completes(prefill, decode)


async def test_a_release_without_the_lease_frees_nothing_and_leaks_nothing(
    prefill: PrefillProcess, decode: DecodeSide
) -> None:
    """A proven peer past the handshake knows a parked request's id (ids are logged) but not
    its lease: a Release with a guessed lease id frees nothing, one without a lease id is
    malformed (the connection closes), and the parked blocks still reach their decode worker."""
    t, pool = decode
    handle = prefill.park(8, "victim")
    with bare_side("tcp", worker_id="decode-hostile") as (local, _):
        conn = await attacker(prefill.endpoint)
        try:
            await local.connect(conn)
            await conn.send(wire.Release(request_id="victim", lease_id=uuid.uuid4().hex))
            await conn.send(
                wire.SendBlocks(
                    request_id="victim", epoch=handle.epoch, lease_id=uuid.uuid4().hex,
                    transfer_id="t-guess", src_block_ids=handle.block_ids, dst_block_ids=(0, 1),
                )
            )  # fmt: skip
            refusal = await conn.recv()
            assert isinstance(refusal, wire.TransferFailed) and refusal.code == "kv_handle_invalid"
            conn.sock.send(frame({"type": "release", "request_id": "victim"}))
            received = refusal.model_dump_json().encode() + await read_until_closed(conn, 10)
        finally:
            conn.close()
    assert handle.lease_id.encode() not in received
    assert json.dumps(list(handle.block_ids)).encode() not in received
    assert prefill.state().parked == 1, "the victim's blocks are still parked"
    await t.pull(handle, [5, 6])
    assert_landed(pool, handle.block_ids, [5, 6])
