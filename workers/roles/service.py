"""What every worker role shares: its settings, identity, lifecycle, registration and the common
routes (``/health``, ``/ready``, ``/load``, ``/metrics``).

The roles themselves (:mod:`pdserve.workers.roles`: one module per role) subclass :class:`WorkerService`, build
their parts in :meth:`WorkerService.open` and add their own ``/internal/*`` routes; a route that
does not belong to a role is not registered at all (404). The ``/internal/*`` routes are the
internal plane: they answer only the router, which sends the cluster key's bearer token
(401 otherwise); ``/health``, ``/ready``, ``/load`` and ``/metrics`` stay open for probes and
scrapers.

Lifecycle of one service (start -> serve -> drain -> cleanup; cleanup is idempotent)::

    1 START    load the engine (in a thread), build the role's parts (parked-block table,
               transceiver), register the worker record under a lease, start the load refresh;
               every part pushes its cleanup onto the lifespan's exit stack as it is built
    2 SERVE    ready: ``/ready`` is 200; the record's load is refreshed every second
    3 DRAIN    :meth:`WorkerService.drain`: deregister, ``/ready`` 503 (decode and colocated:
               end the running streams, which the router migrates, unless
               ``worker.migrate_on_drain`` is off), wait until idle
    4 CLEANUP  the exit stack unwinds in reverse: refresh task, registration, transceiver,
               parked blocks, engine

Config: every part reads the :class:`~pdserve.config.loading.WorkerConfig` it is handed, whole (the
service keeps it as :attr:`WorkerService.cfg`); derived values are properties of its sections
(``cfg.engine.scheduler.evicts``, ``cfg.worker.advertised_host``). A setting read by a role is
one declaration in :mod:`pdserve.config.settings` and one read such as ``self.cfg.engine.kv_cache.lease_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.observability.prometheus import CONTENT_TYPE
from pdserve.protocol import Role, WorkerLoad, WorkerRecord
from pdserve.workers.roles.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from pdserve.config.loading import WorkerConfig
    from pdserve.discovery import Registration, Watcher
    from pdserve.discovery.load_events import EventPublisher, ParkedCounts
    from pdserve.security import ClusterKey
    from pdserve.workers.engine.api import EngineFactory, WorkerEngine

log = logging.getLogger(__name__)

FATAL: list[str] = []
"""Why this worker process stopped itself (:func:`stop_worker`); empty while it may serve."""


def stop_worker(reason: str) -> None:
    """Stop this worker process because a part it cannot serve without failed (a tensor
    parallel rank died): record ``reason`` in :data:`FATAL` and send the process SIGTERM (the
    usual drain, short since every step now fails at once; ``run_worker`` then exits non-zero
    and the supervisor or orchestrator restarts the worker). Callable from any thread."""
    log.critical("stopping this worker: %s", reason)
    FATAL.append(reason)
    os.kill(os.getpid(), signal.SIGTERM)


RegistrationFactory = Callable[["WorkerConfig", "WorkerIdentity"], "Registration"]
"""``(cfg, identity) -> Registration`` (not yet started): the default opens the backend of
``cfg.control_plane``, signing with ``identity.key``."""
WatcherFactory = Callable[["WorkerConfig", "WorkerIdentity"], "Watcher"]
"""``(cfg, identity) -> Watcher``: a worker's own (not yet started) view of discovery."""


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this worker is to the rest of the system, and the key it proves it with.

    ``worker_id``: the config's ``worker.worker_id`` (resolved when the config is built);
    ``http_url``: the request-plane base URL peers dial; ``key``: the internal plane's key
    (guards ``/internal/*``, signs the discovery record, answers the transceivers'
    challenge-response), read once from the security section; ``epoch`` (nanoseconds since the
    UNIX epoch at start) tells incarnations of one ``worker_id`` apart (fencing).
    """

    worker_id: str
    http_url: str
    key: ClusterKey = field(repr=False)
    epoch: int = field(default_factory=time.time_ns)


def default_watcher(cfg: WorkerConfig, identity: WorkerIdentity) -> Watcher:
    """A watcher of ``cfg.control_plane`` (the router's registry polled over HTTP, etcd or
    NATS), keeping the records signed with ``identity.key``."""
    from pdserve.discovery import open_watcher

    return open_watcher(cfg.control_plane, key=identity.key, discovery=cfg.discovery)


def default_registration(cfg: WorkerConfig, identity: WorkerIdentity) -> Registration:
    """The discovery backend ``cfg.control_plane`` names (imported on first use), signing with
    ``identity.key``, with the discovery section's TTL and TLS settings."""
    from pdserve.discovery import open_registration

    return open_registration(
        cfg.control_plane,
        ttl_s=cfg.discovery.registration_ttl_s,
        key=identity.key,
        discovery=cfg.discovery,
    )


class WorkerService:
    """One running worker: engine, registration, load refresh and the common routes.

    Subclasses set :attr:`role`, build their parts in :meth:`open` (a classmethod: every
    field is set when the instance exists, none is optional) and add their routes in
    :meth:`add_role_routes`. Thread-safety: the event loop's thread only.
    """

    role: ClassVar[Role]

    def __init__(
        self,
        *,
        cfg: WorkerConfig,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        registration: Registration,
    ) -> None:
        self.cfg = cfg
        self.identity = identity
        self.engine = engine
        self.registration = registration
        self.events: EventPublisher | None = None  # load / KV events: NATS discovery only
        self.ready = False
        self.metrics = WorkerMetrics(
            self.role.value,
            load=self.load,
            lease_expired=self.leases_expired,
            prefix_cache=lambda: self.engine.kv_cache.prefix_stats(),
            kv_tiers=lambda: self.engine.kv_connector_stats(),
        )

    # -- what a role adds --------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        cfg: WorkerConfig,
        identity: WorkerIdentity,
        stack: AsyncExitStack,
        *,
        engine_factory: EngineFactory,
        registration_factory: RegistrationFactory = default_registration,
        watcher_factory: WatcherFactory = default_watcher,
    ) -> WorkerService:
        """Lifecycle step 1 for this role; cleanups go onto ``stack``. Returns the service,
        registered and ready. ``watcher_factory``: this worker's own view of discovery (a
        decode worker's :class:`~pdserve.workers.roles.prefill_directory.PrefillDirectory`). Raises
        ConfigError & co. (the stack then undoes what was built)."""
        engine = await load_engine(cfg, identity, stack, engine_factory)
        parts = await cls.open_parts(cfg, identity, engine, stack, watcher_factory=watcher_factory)
        registration = registration_factory(cfg, identity)
        service = cls(cfg=cfg, identity=identity, engine=engine, registration=registration, **parts)
        await service.serve(stack)
        return service

    @classmethod
    async def open_parts(
        cls,
        cfg: WorkerConfig,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        stack: AsyncExitStack,
        *,
        watcher_factory: WatcherFactory,
    ) -> dict[str, Any]:
        """The role's parts beyond the engine, as constructor keywords (cleanups on
        ``stack``); none here."""
        return {}

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        """Register this role's ``/internal/*`` routes on ``api``, a router whose routes need
        the cluster token (none here)."""

    def communicator(self) -> dict[str, str]:
        """The record's communicator handle (transfer roles: backend and endpoint)."""
        return {}

    def parked_count(self) -> int:
        """Requests whose KV blocks wait here for a decode worker (prefill only)."""
        return 0

    def leases_expired(self) -> int:
        """Parked leases expired so far (prefill only)."""
        return 0

    def kv_counts(self) -> ParkedCounts | None:
        """The parked-block counters for KV events (prefill only)."""
        return None

    # -- common parts ------------------------------------------------------------------------

    def load(self) -> WorkerLoad:
        """The engine's load with this worker's parked count."""
        return self.engine.load().model_copy(update={"parked": self.parked_count()})

    def record(self) -> WorkerRecord:
        """The discovery record for the current load."""
        return WorkerRecord(
            role=self.role,
            worker_id=self.identity.worker_id,
            epoch=self.identity.epoch,
            model=self.cfg.engine.served_model_name,
            http_url=self.identity.http_url,
            communicator=self.communicator(),
            layout=self.engine.layout,
            load=self.load(),
        )

    async def serve(self, stack: AsyncExitStack) -> None:
        """Register, start the load refresh and the KV cache events
        (:mod:`pdserve.workers.kv.cache_events`), turn ready (the end of lifecycle step 1)."""
        from pdserve.discovery.load_events import event_publisher
        from pdserve.workers.kv.cache_events import open_kv_events

        stack.push_async_callback(self.deregister)
        await self.registration.start(self.record())
        self.events = event_publisher(self.registration)
        kv_events = await open_kv_events(
            kv_cache=self.engine.kv_cache,
            connector=getattr(self.engine, "connector", None),
            registration=self.registration,
            worker_id=self.identity.worker_id,
            epoch=self.identity.epoch,
            key=self.identity.key,  # signs the events as the registration signs the record
            settings=self.cfg.discovery,
            stack=stack,
        )
        if kv_events is not None:
            self.metrics.add_kv_events(kv_events.counts)
        if self.cfg.engine.kv_cache.zmq_events is not None:  # vLLM's format, for its indexers
            from pdserve.workers.kv.zmq_events import open_zmq_events

            open_zmq_events(self.engine.kv_cache, self.cfg.engine.kv_cache.zmq_events, stack)
        task = asyncio.create_task(self._refresh_load(), name="load-refresh")
        stack.push_async_callback(_cancel, task)
        self.ready = True
        log.info("%s %s ready at %s", self.role, self.identity.worker_id, self.identity.http_url)

    async def deregister(self) -> None:
        """Remove the record (the router stops routing here); idempotent."""
        self.ready = False
        with contextlib.suppress(Exception):
            await self.registration.close()

    def busy(self) -> int:
        """Requests that run, wait or are parked here."""
        load = self.load()
        return load.running + load.waiting + load.parked

    def on_deregistered(self) -> None:
        """Called by :meth:`drain` right after deregistering (nothing here; decode and
        colocated workers migrate their running streams)."""

    async def drain(self, timeout_s: float) -> None:
        """Lifecycle step 3: deregister, turn ``/ready`` 503, :meth:`on_deregistered`, then
        wait until nothing runs, waits or is parked here, at most ``timeout_s`` seconds (parked
        blocks are pulled by their decode worker or expire within the lease). The HTTP server
        keeps serving meanwhile, so in-flight streams finish (or end with the draining error,
        which the router migrates) and pulls of parked blocks succeed."""
        await self.deregister()
        self.on_deregistered()
        deadline = time.monotonic() + timeout_s
        busy = self.busy()
        while busy and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            busy = self.busy()
        log.info(
            "%s %s drained%s",
            self.role,
            self.identity.worker_id,
            f"; {busy} request(s) still in flight after {timeout_s:.0f} s" if busy else "",
        )

    async def _refresh_load(self, interval_s: float = 1.0) -> None:
        last: WorkerLoad | None = None
        while True:
            await asyncio.sleep(interval_s)
            load = self.load()
            if load != last and self.ready:
                with contextlib.suppress(Exception):
                    await self.registration.update(self.record())
                last = load
            if self.events is not None:  # every tick: fresher than the record's refresh
                await self.events.publish(load, self.kv_counts())

    @staticmethod
    def add_common_routes(app: FastAPI, current: Callable[[], WorkerService]) -> None:
        """``/health``, ``/ready``, ``/load``, ``/metrics`` on ``app``; ``current()`` is the
        running service."""

        @app.get("/health")
        async def health() -> dict[str, Any]:
            s = current()
            return {
                "status": "ok",
                "role": s.role.value,
                "worker_id": s.identity.worker_id,
                "epoch": s.identity.epoch,
            }

        @app.get("/metrics")
        async def metrics() -> Response:
            """Prometheus text format: KV blocks, batch, leases, KV transfers."""
            return Response(current().metrics.render(), media_type=CONTENT_TYPE)

        @app.get("/ready")
        async def ready() -> JSONResponse:
            from pdserve.discovery import RegistrationState

            s = current()
            registered = s.registration.state is RegistrationState.REGISTERED
            if not (s.ready and registered):
                body = {"ready": False, "loaded": s.ready, "registered": registered}
                return JSONResponse(body, status_code=503)
            return JSONResponse({"ready": True, "worker_id": s.identity.worker_id})

        @app.get("/load")
        async def load() -> WorkerLoad:
            return current().load()


def service_of(request: Request) -> Any:
    """The running service of the app serving ``request`` (set by the lifespan)."""
    return request.app.state.worker


async def load_engine(
    cfg: WorkerConfig,
    identity: WorkerIdentity,
    stack: AsyncExitStack,
    engine_factory: EngineFactory,
) -> WorkerEngine:
    """Build (in a thread: it loads the model) and start the engine; its shutdown goes onto
    ``stack``."""
    log.info(
        "%s %s (epoch %d): loading %s",
        cfg.role,
        identity.worker_id,
        identity.epoch,
        cfg.engine.model_path,
    )
    t0 = time.perf_counter()
    engine = await asyncio.to_thread(engine_factory, cfg.engine)
    stack.push_async_callback(asyncio.to_thread, engine.shutdown)
    ranks = getattr(getattr(engine, "runner", None), "ranks", None)  # tensor parallel only
    if ranks is not None:
        ranks.on_death = stop_worker
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
    return engine


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
