"""pdserve's HTTP/1.1 client of the worker request plane (pdserve/http/plane_client.py) against
real sockets: scripted asyncio servers that answer well, badly, slowly or not at all."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from pdserve.http.plane_client import (
    MAX_HEAD_BYTES,
    READ_HIGH_WATER,
    PlaneConnectError,
    PlaneError,
    WirePlane,
)
from tests.support.servers import bound_socket

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Scripted:
    """An asyncio server on a free port running ``handler`` per connection; ``peers`` lists the
    client port of each connection, ``bodies`` each request body read by :func:`read_request`."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.bodies: list[bytes] = []
        self.url = ""


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (by its content-length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


OK_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Scripted]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Scripted:
        s = Scripted()

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            s.peers.append(writer.get_extra_info("peername")[1])
            try:
                await handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        sock = bound_socket()
        server = await asyncio.start_server(on_conn, sock=sock)
        servers.append(server)
        s.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return s

    yield start
    for server in servers:
        server.close()


def plane() -> WirePlane:
    return WirePlane({"authorization": "Bearer t", "content-type": "application/json"},
                     keepalive_s=30)  # fmt: skip


async def test_a_streamed_answer_arrives_as_sent_and_its_connection_is_reused(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    second_part = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            assert b"authorization: Bearer t" in head and b"host: 127.0.0.1:" in head
            writer.write(OK_HEAD + b"%x\r\n%s\r\n" % (len(body), body))
            await writer.drain()
            await second_part.wait()
            writer.write(b"5\r\nend!\n\r\n0\r\n\r\n")
            await writer.drain()

    s = await serve(handler)
    p = plane()
    for i in range(3):
        second_part.clear()
        resp = await p.post(f"{s.url}/x", b'{"i":%d}' % i, timeout_s=5, connect_timeout_s=1)
        assert resp.status_code == 200
        parts = resp.aiter_bytes()
        assert await anext(parts) == b'{"i":%d}' % i  # before the rest is sent
        second_part.set()
        assert [b async for b in parts] == [b"end!\n"]
        await resp.aclose()
    assert len(s.peers) == 1 and p.idle_connections() == 1
    await p.aclose()


async def test_a_response_closed_early_drops_its_connection(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK_HEAD + b"3\r\nabc\r\n")  # and never ends
        await writer.drain()
        assert await reader.read() == b""  # the client closed the connection

    s = await serve(handler)
    p = plane()
    for _ in range(2):
        resp = await p.post(f"{s.url}/x", b"{}", timeout_s=5, connect_timeout_s=1)
        assert await anext(resp.aiter_bytes()) == b"abc"
        await resp.aclose()
    assert len(s.peers) == 2 and p.idle_connections() == 0


async def test_connect_failures_and_other_schemes_are_connect_errors() -> None:
    sock = bound_socket()  # bound, never listening: refused
    port = sock.getsockname()[1]
    sock.close()
    p = plane()
    with pytest.raises(PlaneConnectError, match=f"127.0.0.1:{port}"):
        await p.post(f"http://127.0.0.1:{port}/x", b"{}", timeout_s=5, connect_timeout_s=1)
    with pytest.raises(PlaneConnectError, match="http:// only"):
        await p.post("https://127.0.0.1:1/x", b"{}", timeout_s=5, connect_timeout_s=1)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", "closed by the worker"),
        (b"SMTP ready\r\n\r\n", "malformed HTTP response"),
        (b"HTTP/1.1 200 OK\r\nx: " + b"a" * (MAX_HEAD_BYTES + 10), "response head over"),
    ],
    ids=["closed-mid-body", "not-http", "oversized-head"],
)
async def test_broken_answers_are_plane_errors(
    serve: Callable[[Handler], Awaitable[Scripted]], answer: bytes, error: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    s = await serve(handler)
    p = plane()
    with pytest.raises(PlaneError, match=error):
        resp = await p.post(f"{s.url}/x", b"{}", timeout_s=5, connect_timeout_s=1)
        await resp.aread()
    assert p.idle_connections() == 0


async def test_no_head_within_the_timeout_is_a_timeout_and_the_connection_is_dropped(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        assert await reader.read() == b""  # silent until the client gives up and closes

    s = await serve(handler)
    p = plane()
    with pytest.raises(TimeoutError):
        await p.post(f"{s.url}/x", b"{}", timeout_s=0.2, connect_timeout_s=1)
    assert p.idle_connections() == 0


async def test_a_large_body_is_read_whole_through_flow_control(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    big = bytes(range(256)) * (3 * READ_HIGH_WATER // 256)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big) + big)
        await writer.drain()
        await reader.read()

    s = await serve(handler)
    p = plane()
    resp = await p.post(f"{s.url}/x", b"{}", timeout_s=5, connect_timeout_s=1)
    async with asyncio.timeout(5):  # the server writes ahead: reading pauses past the high water
        while not resp._conn._paused:  # type: ignore[attr-defined]
            await asyncio.sleep(0.01)
    assert await resp.aread() == big
    await resp.aclose()
    assert p.idle_connections() == 1


async def test_connections_the_worker_closed_or_asked_to_close_are_not_reused(
    serve: Callable[[Handler], Awaitable[Scripted]],
) -> None:
    close_after = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if close_after.is_set():  # keep-alive answer, then the worker drops the idle connection
            writer.write(OK_HEAD + chunked(b"a"))
            await writer.drain()
        else:  # an answer that asks to close
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 1\r\n\r\nb")
            await writer.drain()

    s = await serve(handler)
    p = plane()
    resp = await p.post(f"{s.url}/x", b"{}", timeout_s=5, connect_timeout_s=1)
    assert await resp.aread() == b"b"
    await resp.aclose()
    assert p.idle_connections() == 0
    close_after.set()
    resp = await p.post(f"{s.url}/x", b"{}", timeout_s=5, connect_timeout_s=1)
    assert await resp.aread() == b"a"
    await resp.aclose()
    async with asyncio.timeout(5):  # the server closes it; the client sees the EOF
        while p.idle_connections():
            await asyncio.sleep(0.01)
    resp = await p.post(f"{s.url}/x", b"{}", timeout_s=5, connect_timeout_s=1)  # a new one
    assert await resp.aread() == b"a"
    await resp.aclose()
    assert len(s.peers) == 3
    await p.aclose()


async def test_an_idle_connection_the_worker_closed_is_not_reused_before_the_loop_sees_it() -> None:
    """The worker's FIN is in the socket but not yet delivered (the loop has not run since): the
    pool checks the socket itself before reuse and opens a new connection. The worker is a
    blocking socket server on a thread, so it closes while the client's loop is held."""
    listener = bound_socket()
    listener.listen()
    peers: list[int] = []

    def serve_two() -> None:
        for _ in range(2):
            conn, (_, port) = listener.accept()
            peers.append(port)
            data = b""
            while not data.endswith(b"{}"):  # the head and the 2-byte body
                data += conn.recv(65536)
            conn.sendall(OK_HEAD + chunked(b"a"))
            conn.close()

    thread = threading.Thread(target=serve_two, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/x"
    p = plane()
    resp = await p.post(url, b"{}", timeout_s=5, connect_timeout_s=1)
    assert await resp.aread() == b"a"
    await resp.aclose()
    (pooled,) = [c for conns in p._idle.values() for c in conns]
    deadline = time.monotonic() + 5
    while not pooled.readable():  # without yielding to the loop: the EOF stays undelivered
        assert time.monotonic() < deadline, "the server never closed the connection"
        time.sleep(0.001)
    assert pooled.error is None  # the loop has not seen the close
    resp = await p.post(url, b"{}", timeout_s=5, connect_timeout_s=1)
    assert await resp.aread() == b"a"
    await resp.aclose()
    thread.join(5)
    assert len(peers) == 2
    listener.close()
