"""Worker process: the request-plane HTTP app around an engine, a transceiver and a registration.

Lifecycle (start -> serve -> drain -> cleanup; cleanup is idempotent)::

    1 START    load the model and allocate the KV pool (engine thread starts), start the
               transceiver, register the worker record (role, id, epoch, endpoints, communicator
               handle, KV layout, load) under a lease
    2 SERVE    /internal/* requests; the record's load is refreshed every second; /ready is 200
    3 DRAIN    on SIGTERM/SIGINT: deregister first (the router stops routing here), /ready is
               503, keep serving until nothing runs, waits or is parked (at most lease + 5 s);
               a second signal skips the wait
    4 CLEANUP  close the transceiver, free parked blocks, stop the engine

Routes: ``POST /internal/context`` and ``/internal/release`` (prefill), ``POST
/internal/generate`` (decode, colocated), ``GET /health``, ``GET /ready``, ``GET /load``,
``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.config import WorkerConfig, advertised_host, url_host
from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.metrics import CONTENT_TYPE, WorkerMetrics
from pdserve.protocol import (
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    WORKER_KEEPALIVE_S,
    ContextRequest,
    ContextResponse,
    GenerationRequest,
    ReleaseRequest,
    Role,
    WorkerLoad,
    WorkerRecord,
)
from pdserve.server.errors import error_response

if TYPE_CHECKING:
    from pdserve.discovery import Registration
    from pdserve.discovery.events import EventPublisher
    from pdserve.transfer import Transceiver
    from pdserve.workers.decode import DecodeRole
    from pdserve.workers.engine import Engine
    from pdserve.workers.parking import ParkedBlocks
    from pdserve.workers.prefill import PrefillRole

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    """Everything the lifespan owns; one per app (no module-level state)."""

    cfg: WorkerConfig
    http_url: str
    worker_id: str
    epoch: int = field(default_factory=time.time_ns)
    ready: bool = False
    engine: Engine | None = None
    transceiver: Transceiver | None = None
    parked: ParkedBlocks | None = None
    prefill: PrefillRole | None = None
    decode: DecodeRole | None = None
    registration: Registration | None = None
    events: EventPublisher | None = None  # load / KV events, NATS discovery only
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    metrics: WorkerMetrics | None = None

    def load(self) -> WorkerLoad:
        assert self.engine is not None
        load = self.engine.load()
        parked = len(self.parked) if self.parked is not None else 0
        return load.model_copy(update={"parked": parked})

    def record(self) -> WorkerRecord:
        assert self.engine is not None
        return WorkerRecord(
            role=Role(self.cfg.role),
            worker_id=self.worker_id,
            epoch=self.epoch,
            model=self.cfg.engine.served_model_name,
            http_url=self.http_url,
            communicator=self.transceiver.communicator() if self.transceiver else {},
            layout=self.engine.layout,
            load=self.load(),
        )


async def _start(state: WorkerState) -> None:
    from pdserve.discovery import open_registration
    from pdserve.discovery.events import event_publisher
    from pdserve.transfer import create_transceiver
    from pdserve.workers.decode import DecodeRole
    from pdserve.workers.engine import Engine
    from pdserve.workers.parking import ParkedBlocks
    from pdserve.workers.prefill import PrefillRole

    cfg = state.cfg
    log.info(
        "%s %s (epoch %d): loading %s",
        cfg.role,
        state.worker_id,
        state.epoch,
        cfg.engine.model_path,
    )
    t0 = time.perf_counter()
    engine = await asyncio.to_thread(Engine, cfg.engine)
    state.engine = engine
    engine.start()
    pool = engine.kv_cache.pool
    log.info(
        "model loaded in %.1f s; KV pool %d blocks x %d tokens (%.1f MiB, %s)",
        time.perf_counter() - t0,
        engine.kv_cache.get_max_resource_count(),
        engine.layout.tokens_per_block,
        pool.numel() * pool.element_size() / 2**20,
        engine.layout.dtype,
    )
    if cfg.role == "prefill":
        state.parked = ParkedBlocks(
            epoch=state.epoch,
            lease_s=cfg.lease_s,
            free_blocks=engine.free_parked,
            generations=engine.kv_cache.generations,  # fencing: no reused block is ever sent
            send_grace_s=cfg.transfer.timeout_s + 5.0,  # a send outlives no lease by more
        )
        state.parked.start()
    if cfg.role in ("prefill", "decode"):
        state.transceiver = create_transceiver(
            cfg.transfer,
            pool=pool,
            layout=engine.layout,
            worker_id=state.worker_id,
            epoch=state.epoch,
            parked=state.parked,
        )
        await state.transceiver.start()
        log.info("transceiver: %s on %s", state.transceiver.backend, state.transceiver.endpoint)
    if cfg.role == "prefill":
        assert state.transceiver is not None and state.parked is not None
        state.prefill = PrefillRole(
            engine=engine,
            transceiver=state.transceiver,
            parked=state.parked,
            worker_id=state.worker_id,
        )
    else:
        state.decode = DecodeRole(
            engine=engine,
            transceiver=state.transceiver,
            quarantine_s=cfg.transfer.timeout_s,
            metrics=state.metrics,
        )
    state.registration = open_registration(cfg.discovery, ttl_s=cfg.registration_ttl_s)
    await state.registration.start(state.record())
    state.events = event_publisher(state.registration)
    state.tasks.append(asyncio.create_task(_refresh_load(state), name="load-refresh"))
    state.ready = True
    log.info("%s %s ready at %s", cfg.role, state.worker_id, state.http_url)


async def _refresh_load(state: WorkerState, interval_s: float = 1.0) -> None:
    last: WorkerLoad | None = None
    while True:
        await asyncio.sleep(interval_s)
        load = state.load()
        if load != last and state.registration is not None:
            with contextlib.suppress(Exception):
                await state.registration.update(state.record())
            last = load
        if state.events is not None:  # every tick: fresher than the record's refresh
            await state.events.publish(load, state.parked)


async def drain(state: WorkerState, timeout_s: float) -> None:
    """Lifecycle step 3: deregister (the router stops routing here), turn ``/ready`` 503, then
    wait until nothing runs, waits or is parked here, at most ``timeout_s`` seconds (parked
    blocks are pulled by their decode worker or expire within the lease). The HTTP server keeps
    serving meanwhile, so in-flight streams finish and pulls of parked blocks succeed."""
    state.ready = False
    if state.registration is not None:
        with contextlib.suppress(Exception):
            await state.registration.close()
        state.registration = None
    deadline = time.monotonic() + timeout_s
    busy = None
    while state.engine is not None and time.monotonic() < deadline:
        load = state.load()
        busy = load.running + load.waiting + load.parked
        if busy == 0:
            break
        await asyncio.sleep(0.1)
    log.info(
        "%s %s drained%s",
        state.cfg.role,
        state.worker_id,
        f"; {busy} request(s) still in flight after {timeout_s:.0f} s" if busy else "",
    )


async def _stop(state: WorkerState) -> None:
    """Drain and clean up; safe to call on a partly started state and more than once."""
    state.ready = False
    for task in state.tasks:
        task.cancel()
    state.tasks.clear()
    if state.registration is not None:
        with contextlib.suppress(Exception):
            await state.registration.close()
        state.registration = None
    if state.transceiver is not None:
        with contextlib.suppress(Exception):
            await state.transceiver.close()
        state.transceiver = None
    if state.parked is not None:
        await state.parked.close()
    if state.engine is not None:
        await asyncio.to_thread(state.engine.shutdown)
        state.engine = None
    log.info("%s %s stopped", state.cfg.role, state.worker_id)


def create_worker_app(cfg: WorkerConfig, *, http_url: str) -> FastAPI:
    """Build a worker app. ``http_url`` is the request-plane base URL other processes use to
    reach this worker (it goes into the discovery record)."""
    worker_id = cfg.worker_id or f"{cfg.role}-{uuid.uuid4().hex[:8]}"
    state = WorkerState(cfg=cfg, http_url=http_url, worker_id=worker_id)
    state.metrics = WorkerMetrics(
        cfg.role,
        load=lambda: state.load() if state.engine is not None else None,
        lease_expired=lambda: state.parked.expired_total if state.parked is not None else 0,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await _start(state)
            yield
        finally:
            await _stop(state)

    app = FastAPI(title=f"pdserve {cfg.role} worker", lifespan=lifespan)
    app.state.worker = state

    @app.exception_handler(PdserveError)
    async def _pdserve_error(_: Request, exc: PdserveError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequestError(f"malformed worker request: {exc.errors()}"))

    @app.middleware("http")
    async def _protocol_header(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers[PROTOCOL_HEADER] = str(PROTOCOL_VERSION)
        return response

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "role": cfg.role, "worker_id": worker_id, "epoch": state.epoch}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format: KV blocks, batch, leases, KV transfers."""
        assert state.metrics is not None
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        from pdserve.discovery import RegistrationState

        registered = (
            state.registration is not None
            and state.registration.state is RegistrationState.REGISTERED
        )
        if not (state.ready and registered):
            return JSONResponse(
                {"ready": False, "loaded": state.ready, "registered": registered}, status_code=503
            )
        return JSONResponse({"ready": True, "worker_id": worker_id})

    @app.get("/load")
    async def load() -> WorkerLoad:
        return state.load()

    @app.post("/internal/context")
    async def context(req: ContextRequest) -> ContextResponse:
        if state.prefill is None:
            raise InvalidRequestError(f"this is a {cfg.role} worker; /internal/context is prefill")
        return await state.prefill.context(req)

    @app.post("/internal/release")
    async def release(req: ReleaseRequest) -> dict[str, bool]:
        if state.prefill is None:
            raise InvalidRequestError(f"this is a {cfg.role} worker; /internal/release is prefill")
        return {"released": state.prefill.release(req.request_id, req.epoch, req.lease_id)}

    @app.post("/internal/generate")
    async def generate(req: GenerationRequest) -> StreamingResponse:
        if state.decode is None:
            raise InvalidRequestError(f"this is a {cfg.role} worker; /internal/generate is decode")
        decode = state.decode
        stream = await decode.admit(req)

        async def body() -> AsyncIterator[bytes]:
            async for chunk in decode.chunks(req, stream):
                yield chunk.model_dump_json().encode() + b"\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the request-plane listening socket up front so port 0 resolves to a real port that
    can go into the discovery record before the server starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_worker(cfg: WorkerConfig, *, log_level: str = "info") -> None:
    """Serve a worker until SIGINT/SIGTERM (blocking)."""
    import uvicorn

    sock = bind_socket(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    advertise = advertised_host(cfg.host, cfg.advertise_host)
    app = create_worker_app(cfg, http_url=f"http://{url_host(advertise)}:{port}")

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
            if self.draining is not None or self.loop is None or not app.state.worker.ready:
                super().handle_exit(sig, frame)
                return
            log.info("signal %d: draining before shutdown (a second signal stops at once)", sig)
            self.draining = asyncio.run_coroutine_threadsafe(  # type: ignore[assignment]
                self._drain_then_exit(sig, frame), self.loop
            )

        async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
            try:
                await drain(app.state.worker, timeout_s=cfg.lease_s + 5.0)
            finally:
                super().handle_exit(sig, frame)

    server = DrainingServer(
        uvicorn.Config(
            app,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=int(WORKER_KEEPALIVE_S),  # > the router's keep-alive
            access_log=False,
        )
    )
    server.run(sockets=[sock])
