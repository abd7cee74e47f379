"""The servers' HTTP protocol closes a connection whose request headers are not complete in
time (:mod:`pdserve.http.uvicorn_protocol`), before any route or API key check runs; bodies,
responses and idle keep-alive connections keep their own bounds. Real uvicorn, real sockets;
the deadline is shortened to :data:`DEADLINE_S` for the test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from pdserve.http.uvicorn_protocol import HEADER_TIMEOUT_S, HeaderDeadlineH11Protocol
from tests.support.servers import bound_socket, uvicorn_started

DEADLINE_S = 0.5


class ShortDeadline(HeaderDeadlineH11Protocol):
    header_timeout_s = DEADLINE_S


def echo_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture
async def port() -> AsyncIterator[int]:
    sock = bound_socket()
    config = uvicorn.Config(
        echo_app(), http=ShortDeadline, timeout_keep_alive=5, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await uvicorn_started(server, task)
    yield int(sock.getsockname()[1])
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    sock.close()


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
