"""The TCP Connection over real sockets in one process: frames, scatter-gather segments, EOF."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from pdserve.errors import TransferError
from pdserve.transfer import wire
from pdserve.transfer.connection.control import (
    KEEPALIVE_IDLE_S,
    KEEPALIVE_PROBES,
    Connection,
    split_endpoint,
    tune,
)


async def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a, "a"), Connection(b, "b")


async def test_frames_arrive_whole_and_in_order():
    a, b = await _pair()
    msgs = [wire.Release(request_id=f"r{i}", lease_id="l") for i in range(50)]
    for m in msgs:
        await a.send(m)
    assert [await b.recv() for _ in msgs] == msgs
    a.close()
    b.close()


async def test_segments_scatter_into_their_offsets_across_partial_reads():
    a, b = await _pair()
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size=16 << 20, dtype=np.uint8)  # far more than a socket buffer
    dst = np.zeros_like(src)
    lengths = np.full(64, 96 << 10, dtype=np.int64)
    src_off = rng.permutation(160)[:64].astype(np.int64) * (100 << 10)
    dst_off = rng.permutation(160)[:64].astype(np.int64) * (100 << 10)
    header = wire.BlockData(transfer_id="t", nbytes=int(lengths.sum()))

    async def receive() -> wire.Message:
        msg = await b.recv()
        await b.recv_segments(memoryview(dst), dst_off, lengths)
        return msg

    got, _ = await asyncio.gather(
        receive(), a.send_segments(memoryview(src), src_off, lengths, header)
    )
    assert got == header
    for s, d, n in zip(src_off, dst_off, lengths, strict=True):
        assert np.array_equal(dst[d : d + n], src[s : s + n])
    mask = np.ones(dst.size, dtype=bool)
    for d, n in zip(dst_off, lengths, strict=True):
        mask[d : d + n] = False
    assert not dst[mask].any()
    a.close()
    b.close()


async def test_peer_closing_mid_stream_is_a_transfer_error_and_closes():
    a, b = await _pair()
    await a._sendall(b"x" * 1000)
    a.close()
    dst = bytearray(4000)
    with pytest.raises(TransferError, match="closed the connection \\(1000 of 4000 bytes"):
        await b.recv_segments(memoryview(dst), np.array([0]), np.array([4000]))
    assert b.closed


async def test_idle_connection_has_input_once_the_peer_sends_or_closes():
    a, b = await _pair()
    assert not b.has_input()
    await a.send(wire.Release(request_id="r", lease_id="l"))
    assert b.has_input()
    assert await b.recv() == wire.Release(request_id="r", lease_id="l")
    assert not b.has_input()
    a.close()
    assert b.has_input()
    b.close()


async def test_unreachable_endpoint_is_a_transfer_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        with pytest.raises(TransferError, match="unreachable"):
            await Connection.open(f"127.0.0.1:{port}", timeout=2.0)


@pytest.mark.parametrize(
    ("endpoint", "parsed"), [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9", ("::1", 9))]
)
def test_endpoints_split_into_host_and_port(endpoint, parsed):
    assert split_endpoint(endpoint) == parsed


def test_endpoint_without_port_is_refused():
    with pytest.raises(TransferError, match="host:port"):
        split_endpoint("localhost")


def test_transfer_sockets_detect_a_silent_peer_with_tcp_keepalive() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        tune(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
