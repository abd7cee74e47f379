"""Worker process: the request-plane HTTP app around one role's service.

Lifecycle (start -> serve -> drain -> cleanup; cleanup is idempotent)::

    1 START    load the model and allocate the KV pool (engine thread starts), start the
               transceiver, register the worker record (role, id, epoch, endpoints, communicator
               handle, KV layout, load) under a lease
    2 SERVE    /internal/* requests; the record's load is refreshed every second; /ready is 200
    3 DRAIN    on SIGTERM/SIGINT: deregister first (the router stops routing here), /ready is
               503, keep serving until nothing runs, waits or is parked (at most lease + 5 s);
               a second signal skips the wait
    4 CLEANUP  close the transceiver, free parked blocks, stop the engine

The role's worker class (:data:`WORKER_CLASSES`: :mod:`.prefill`, :mod:`.decode`,
:mod:`.colocated`, one module per role) builds its parts and registers its own routes: ``POST
/internal/context`` and ``/internal/release`` (prefill), ``POST /internal/generate`` (decode,
colocated); every role serves ``GET /health``, ``GET /ready``,
``GET /load`` and ``GET /metrics`` (:mod:`pdserve.workers.roles.service`). A route of another role
answers 404. The ``/internal/*`` routes need ``Authorization: Bearer`` with the cluster key's
token (401 ``unauthorized`` otherwise, checked before the body is read); the others stay open
for probes and scrapers. Errors are mapped by the handlers the router uses too
(:func:`pdserve.http.error_responses.install_error_handlers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from types import FrameType
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.config.hosts import listening_socket, url_host
from pdserve.discovery.registry import internal_route_class
from pdserve.http.error_responses import install_error_handlers
from pdserve.http.keepalive import WORKER_KEEPALIVE_S
from pdserve.protocol import PROTOCOL_HEADER, PROTOCOL_VERSION, Role
from pdserve.security import ClusterKey
from pdserve.workers.engine.api import default_engine_factory
from pdserve.workers.roles import service
from pdserve.workers.roles.colocated import ColocatedWorker
from pdserve.workers.roles.decode import DecodeWorker
from pdserve.workers.roles.prefill import PrefillWorker
from pdserve.workers.roles.service import (
    RegistrationFactory,
    WatcherFactory,
    WorkerIdentity,
    WorkerService,
    default_registration,
    default_watcher,
)

if TYPE_CHECKING:
    from pdserve.config.loading import WorkerConfig
    from pdserve.workers.engine.api import EngineFactory

log = logging.getLogger(__name__)

WORKER_CLASSES: dict[Role, type[WorkerService]] = {
    Role.PREFILL: PrefillWorker,
    Role.DECODE: DecodeWorker,
    Role.COLOCATED: ColocatedWorker,
}
"""The worker class of each role."""


async def drain(service: WorkerService, timeout_s: float) -> None:
    """Lifecycle step 3 (:meth:`WorkerService.drain`)."""
    await service.drain(timeout_s)


def create_worker_app(
    cfg: WorkerConfig,
    *,
    http_url: str,
    cluster_key: ClusterKey | None = None,
    engine_factory: EngineFactory | None = None,
    registration_factory: RegistrationFactory | None = None,
    watcher_factory: WatcherFactory | None = None,
) -> FastAPI:
    """Build a worker app for ``cfg``'s role. ``http_url`` is the request-plane base URL other
    processes use to reach this worker (it goes into the discovery record). ``cluster_key``:
    the internal plane's key; default ``ClusterKey.from_settings(cfg.security)``, which raises
    :class:`~pdserve.errors.ConfigError` when no cluster secret is configured or readable.
    ``engine_factory`` (default: the real engine), ``registration_factory`` and
    ``watcher_factory`` (default: the discovery URL's backend) let tests run a worker on fakes.
    The running service is ``app.state.worker`` while the lifespan runs."""
    key = cluster_key or ClusterKey.from_settings(cfg.security)  # ConfigError: no secret
    identity = WorkerIdentity(worker_id=cfg.worker_id, http_url=http_url, key=key)
    service_cls = WORKER_CLASSES[Role(cfg.role)]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            app.state.worker = await service_cls.open(
                cfg,
                identity,
                stack,
                engine_factory=engine_factory or default_engine_factory,
                registration_factory=registration_factory or default_registration,
                watcher_factory=watcher_factory or default_watcher,
            )
            yield
        log.info("%s %s stopped", cfg.role, identity.worker_id)

    app = FastAPI(title=f"pdserve {cfg.role} worker", lifespan=lifespan)
    install_error_handlers(app)

    app.add_middleware(_ProtocolHeader)

    WorkerService.add_common_routes(app, lambda: app.state.worker)
    internal = APIRouter(route_class=internal_route_class(key))
    service_cls.add_role_routes(internal)
    app.include_router(internal)
    return app


class _ProtocolHeader:
    """Pure ASGI middleware: every HTTP response carries ``x-pdserve-protocol``. (Not
    Starlette's ``BaseHTTPMiddleware``, which wraps ``receive``: a route could then no longer
    see its caller hang up, which the prefill route checks before it keeps parked blocks.)"""

    _HEADER = (PROTOCOL_HEADER.encode(), str(PROTOCOL_VERSION).encode())

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._HEADER]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def bind_socket(host: str, port: int) -> socket.socket:
    """The request-plane socket, bound and listening up front
    (:func:`~pdserve.config.hosts.listening_socket`) so that port 0 resolves to a real port that can
    go into the discovery record before the server starts, and stays this worker's while the
    model loads (connections wait in the backlog until uvicorn accepts them).

    TCP_NODELAY is set on it (accepted connections inherit it). asyncio sets it only on sockets
    whose ``proto`` is ``IPPROTO_TCP``, which a plain ``socket.socket()`` is not: without it, a
    response's second small write can wait for the peer's delayed ACK, 40 ms on Linux (``pdserve
    bench router``: a scripted worker's 16-token stream to an httpx client took 44 ms, 1.4 ms
    with it; the stack's own TTFT did not move, 141.9 vs 142.5 ms p50, as the router's
    connections happened not to meet the stall). Raises OSError."""
    sock = listening_socket(host, port, nodelay=True)
    sock.set_inheritable(True)
    return sock


def run_worker(cfg: WorkerConfig, *, log_level: str = "info") -> None:
    """Serve a worker until SIGINT/SIGTERM (blocking)."""
    import uvicorn

    from pdserve.http.uvicorn_protocol import server_protocol
    from pdserve.observability.logs import uvicorn_log_config

    sock = bind_socket(cfg.worker.host, cfg.worker.port)
    port = sock.getsockname()[1]
    app = create_worker_app(cfg, http_url=f"http://{url_host(cfg.worker.advertised_host)}:{port}")

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM/SIGINT drains (:func:`drain`, at most the lease + 5 s) before
        uvicorn's own shutdown; a second signal stops at once. Orchestrators' grace periods
        must exceed ``lease_s + 10`` s (drain, then 5 s for open connections)."""

        draining: object | None = None
        loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            worker = getattr(app.state, "worker", None)
            started = worker is not None and worker.ready
            if self.draining is not None or self.loop is None or not started:
                super().handle_exit(sig, frame)
                return
            log.info("signal %d: draining before shutdown (a second signal stops at once)", sig)
            self.draining = asyncio.run_coroutine_threadsafe(
                self._drain_then_exit(sig, frame), self.loop
            )

        async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
            try:
                await drain(app.state.worker, timeout_s=cfg.engine.kv_cache.lease_s + 5.0)
            finally:
                super().handle_exit(sig, frame)

    server = DrainingServer(
        uvicorn.Config(
            app,
            log_level=log_level,
            log_config=uvicorn_log_config(),
            timeout_graceful_shutdown=5,
            timeout_keep_alive=int(WORKER_KEEPALIVE_S),  # > the router's keep-alive
            access_log=False,
            http=server_protocol(),  # httptools; request headers within 10 s
            loop="asyncio",  # the engine's threads and the transfer backends are tested on it
        )
    )
    server.run(sockets=[sock])
    if service.FATAL:  # stopped itself: exit non-zero so that the restart is visible
        raise SystemExit(f"worker stopped: {service.FATAL[0]}")
