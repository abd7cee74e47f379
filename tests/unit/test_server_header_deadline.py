"""The servers' HTTP protocol closes a connection whose request headers are not complete in
time (:mod:`pdserve.http.uvicorn_protocol`), before any route or API key check runs; bodies,
responses and idle keep-alive connections keep their own bounds. Real uvicorn, real sockets;
the deadline is shortened to :data:`DEADLINE_S` for the test. Both protocols (httptools, the
default, and h11) are checked; httptools's also bounds the header bytes (431)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from pdserve.http.uvicorn_protocol import (
    HEADER_TIMEOUT_S,
    MAX_HEADER_BYTES,
    HeaderDeadlineH11Protocol,
    HeaderDeadlineHttpToolsProtocol,
    server_protocol,
)
from tests.support.servers import bound_socket, uvicorn_started

DEADLINE_S = 0.5


class ShortDeadlineH11(HeaderDeadlineH11Protocol):
    header_timeout_s = DEADLINE_S


class ShortDeadlineHttpTools(HeaderDeadlineHttpToolsProtocol):
    header_timeout_s = DEADLINE_S


def echo_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    return app


@contextlib.asynccontextmanager
async def serving(protocol: type[asyncio.Protocol]) -> AsyncIterator[int]:
    """The echo app on a real uvicorn speaking ``protocol``; its port."""
    sock = bound_socket()
    config = uvicorn.Config(
        echo_app(), http=protocol, timeout_keep_alive=5, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await uvicorn_started(server, task)
    yield int(sock.getsockname()[1])
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    sock.close()


@pytest.fixture(params=[ShortDeadlineHttpTools, ShortDeadlineH11], ids=["httptools", "h11"])
async def port(request: pytest.FixtureRequest) -> AsyncIterator[int]:
    async with serving(request.param) as p:
        yield p


def request(body: bytes = b"x") -> bytes:
    head = f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    return head + body


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> float:
    """Seconds until the server closes the connection (reading and dropping what it sends)."""
    t0 = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while await reader.read(4096):
            pass
    return time.monotonic() - t0


async def response(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        return await reader.readexactly(length)


def test_the_deadline_is_seconds_not_minutes() -> None:
    assert 1 <= HEADER_TIMEOUT_S <= 60


def test_the_servers_speak_httptools_unless_told_h11() -> None:
    assert server_protocol() is HeaderDeadlineHttpToolsProtocol
    assert server_protocol("h11") is HeaderDeadlineH11Protocol


async def test_headers_past_the_bound_are_refused_with_431() -> None:
    async with serving(ShortDeadlineHttpTools) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\n")
        for i in range(MAX_HEADER_BYTES // 1000 + 2):  # ~1 KB headers, past the bound
            writer.write(f"x-filler-{i}: {'v' * 1000}\r\n".encode())
        writer.write(b"Content-Length: 1\r\n\r\nx")
        async with asyncio.timeout(5):
            answer = await reader.read()  # to the end: the server closes the connection
        writer.close()
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")


async def test_headers_under_the_bound_are_served(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"POST /echo HTTP/1.1\r\nHost: t\r\nx-big: " + b"v" * 12_000 + b"\r\n"
    writer.write(head + b"Content-Length: 2\r\n\r\nab")
    assert await response(reader) == b'{"bytes":2}'
    writer.close()


async def test_headers_trickled_byte_by_byte_are_cut_at_the_deadline(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:
        for byte in request():
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)  # the trickle's pace: a slow client on purpose

    sender = asyncio.create_task(trickle())
    took = await closed_within(reader, DEADLINE_S + 5)
    sender.cancel()
    writer.close()
    assert DEADLINE_S * 0.8 <= took < DEADLINE_S + 2


async def test_a_silent_connection_is_cut_at_the_deadline(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await closed_within(reader, DEADLINE_S + 5) < DEADLINE_S + 2
    writer.close()


async def test_a_slow_body_after_prompt_headers_is_served(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b"y" * 20
    writer.write(request(body)[: -len(body)])  # the headers, complete
    for i in range(len(body)):  # the body over 4 deadlines
        writer.write(body[i : i + 1])
        await asyncio.sleep(DEADLINE_S * 4 / len(body))  # the slow body's pace, on purpose
    assert await response(reader) == b'{"bytes":20}'
    writer.close()


async def test_a_keep_alive_connection_idle_past_the_deadline_still_serves(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request())
    assert await response(reader) == b'{"bytes":1}'
    await asyncio.sleep(DEADLINE_S * 3)  # idle: timeout_keep_alive (5 s) governs, not headers
    writer.write(request(b"ab"))
    assert await response(reader) == b'{"bytes":2}'
    # ... and its next request's headers, begun but never finished, are cut.
    writer.write(b"POST /echo HTTP/1.1\r\nHost:")
    assert await closed_within(reader, DEADLINE_S + 5) < DEADLINE_S + 2
    writer.close()
