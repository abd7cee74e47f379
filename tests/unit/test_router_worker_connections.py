"""The router keeps its connections to a worker: a finished stream's body is read to its end
(:meth:`pdserve.router.client.GenerationStream.finish`), so the next request reuses the
connection instead of a TCP connect per request. A stream given up early still drops its
connection (the worker aborts the request). Real uvicorn, real sockets, a scripted worker; both
worker clients (pdserve's own and httpx)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from pdserve.config.settings import RouterSettings
from pdserve.protocol import SamplingParams
from pdserve.router.client import WorkerClient
from pdserve.router.router import Router
from pdserve.router.view import WorkerView
from tests.support.fakes import CLUSTER_KEY, MODEL, PROMPT, FakeWatcher, FakeWorker
from tests.support.fakes import decode_worker as decode
from tests.support.servers import bound_socket, uvicorn_started


class Served:
    """A scripted colocated-path worker (a decode worker prefilling locally) behind real
    uvicorn; ``ports`` lists the client port of every request it received."""

    def __init__(self) -> None:
        self.sock = bound_socket()
        port = self.sock.getsockname()[1]
        self.worker: FakeWorker = decode(http_url=f"http://127.0.0.1:{port}")
        self.ports: list[int] = []
        inner = self.worker.app()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                self.ports.append(scope["client"][1])
            await inner(scope, receive, send)

        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        )


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    s = Served()
    task = asyncio.create_task(s.server.serve(sockets=[s.sock]))
    await uvicorn_started(s.server, task)
    yield s
    s.server.should_exit = True
    await asyncio.wait_for(task, 10)
    s.sock.close()


@pytest.fixture(params=["wire", "httpx"])
async def router(served: Served, request: pytest.FixtureRequest) -> AsyncIterator[Router]:
    """A router over the served worker, through each worker client (``router.worker_client``)."""
    watcher = FakeWatcher([served.worker.record()])
    async with httpx.AsyncClient(trust_env=False) as http:
        view = WorkerView(watcher, served_model_name=MODEL)
        view.follow(watcher)
        given = http if request.param == "httpx" else None
        client = WorkerClient(given, key=CLUSTER_KEY, connect_timeout_s=2.0)
        yield Router(view, client, RouterSettings(request_timeout_s=10, migration_limit=0))
        await client.aclose()


async def test_finished_requests_reuse_one_connection(served: Served, router: Router) -> None:
    for i in range(4):
        txn = await router.start(f"r{i}", PROMPT, SamplingParams())
        events = [e async for e in txn.events()]
        await txn.aclose()
        assert "".join(e.text for e in events) == "Hi!\n"
    assert len(served.ports) == 4 and len(set(served.ports)) == 1, served.ports


async def test_a_stream_given_up_early_drops_its_connection(served: Served, router: Router) -> None:
    served.worker.token_delay_s = 0.05  # still streaming when the consumer stops
    for i in range(2):
        txn = await router.start(f"r{i}", PROMPT, SamplingParams())
        await txn.aclose()  # after the first token: abandoned
    assert len(served.ports) == 2 and len(set(served.ports)) == 2, served.ports
