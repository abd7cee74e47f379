"""The embedded registry: worker records held in the router process, served over HTTP.

The router creates one :class:`EmbeddedRegistry`, mounts :meth:`EmbeddedRegistry.api_router` at
its root and calls :meth:`EmbeddedRegistry.start` / :meth:`EmbeddedRegistry.close` from its
lifespan. Workers register with :class:`pdserve.discovery.http.HttpRegistration`:

- ``PUT /registry/workers/{worker_id}`` body :class:`RegisterBody` -> :class:`RegisterReply`
  (upsert; also the refresh). 400 if the path and record ids differ; 409 if the record's epoch
  is lower than the live record's (a stale incarnation must not replace its successor).
- ``DELETE /registry/workers/{worker_id}`` -> ``{"removed": bool}``
- ``GET /registry/workers`` -> :class:`WorkerList` (live records only)
- ``GET /registry/workers/{worker_id}`` -> ``WorkerRecord`` or 404
- ``POST /registry/kvcache/{worker_id}`` body :class:`~pdserve.discovery.kvcache.KVCacheEvent`
  -> :class:`~pdserve.discovery.kvcache.KVEventAck`: a worker's KV cache events, handed to the
  subscribers of :meth:`EmbeddedRegistry.subscribe_kv_events` (the router's KV index); the ack
  asks for a snapshot when a subscriber wants one. 400 if the path and event ids differ.

Every route is internal: it needs ``Authorization: Bearer <ClusterKey.http_token>`` (the token
derived from the cluster secret), checked before anything else, including the body; without it
the answer is 401 ``unauthorized`` and the registry is untouched (reads too: a worker's record
holds its endpoints and NIXL agent metadata). A PUT's record must also carry a valid signature
(:meth:`WorkerRecord.signed`), else 401. The routes stay out of the app's ``/openapi.json``.
:func:`internal_route_class` guards the workers' ``/internal/*`` routes the same way.

A record lapses ``ttl_s`` seconds after its last PUT. Lapsed records are dropped lazily on every
read and by a sweep task every ``sweep_interval_s``; subscribers get a delete for each.

Router replicas (``pdserve up --routers N``, ``router.registry_store``): with a
:class:`~pdserve.discovery.registry_store.RegistryStore`, every PUT, DELETE and KV event is
written to that SQLite file as well as applied here, and the sync task applies what the other
replicas wrote (every ``sync_interval_s``), so a worker registered with any replica is in every
replica's view and its KV events reach every replica's index. A replica whose KV index wants a
snapshot of a worker records the want in the store; whichever replica takes that worker's next
event asks for the snapshot in its ack.

:class:`EmbeddedWatcher` is the router's :class:`Watcher` over its own registry (no HTTP).

Async-safety: one event loop (the router's); not thread-safe. Expiry uses ``time.monotonic()``:
the wire carries durations, and the shared store's deadlines are read by processes of one host,
which share that clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import fastapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from pdserve.discovery.kvcache import KVCacheEvent, KVEventAck, KVEventHandler
from pdserve.discovery.records import RecordTable, Subscriber, Watcher
from pdserve.discovery.registry_store import Change, RegistryStore
from pdserve.discovery.retry import cancel_task
from pdserve.discovery.url import check_ttl
from pdserve.errors import AuthenticationError
from pdserve.protocol import WorkerRecord

if TYPE_CHECKING:
    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)

MAX_TTL_S = 3600.0


def internal_route_class(key: ClusterKey) -> type[APIRoute]:
    """An ``APIRoute`` class (for ``APIRouter(route_class=...)``) whose routes answer only
    requests with ``Authorization: Bearer <key.http_token>``; any other raises
    :class:`AuthenticationError` (401 through the app's error handlers) before the body is
    read or validated. The comparison is constant-time; the token is never logged."""

    class InternalRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def checked(request: Request) -> Response:
                if not key.check_http(request.headers.get("authorization")):
                    raise AuthenticationError(
                        f"{request.url.path} is internal: it needs 'Authorization: Bearer' "
                        "with the token derived from the cluster secret"
                    )
                return await handler(request)

            return checked

    return InternalRoute


class RegisterBody(BaseModel):
    """Body of ``PUT /registry/workers/{worker_id}``; ``ttl_s`` defaults to the registry's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    record: WorkerRecord
    ttl_s: float | None = Field(default=None, gt=0, le=MAX_TTL_S, description="seconds")


class RegisterReply(BaseModel):
    """``created`` is true when no live record existed (first registration, or the record had
    lapsed / the router restarted), so the worker can log a re-registration."""

    model_config = ConfigDict(frozen=True)

    worker_id: str
    ttl_s: float
    created: bool


class WorkerList(BaseModel):
    model_config = ConfigDict(frozen=True)

    workers: list[WorkerRecord]


class EmbeddedRegistry:
    """Worker records with per-record TTLs, hosted by the router.

    ``ttl_s`` (seconds) applies to PUTs that carry none; ``sweep_interval_s`` (seconds, default
    ``min(1, ttl_s / 4)``) is how often the sweep task drops lapsed records. ``key`` (the
    cluster key) guards the HTTP routes and verifies every record's signature. ``store``: the
    SQLite store shared with the other router replicas of this host (module docstring), which
    the registry opens in :meth:`start` and closes in :meth:`close`; ``sync_interval_s``
    (seconds) is how often it reads what the other replicas wrote.
    """

    def __init__(
        self,
        *,
        ttl_s: float,
        key: ClusterKey,
        sweep_interval_s: float | None = None,
        store: RegistryStore | None = None,
        sync_interval_s: float = 0.05,
    ) -> None:
        self.ttl_s = check_ttl(ttl_s)
        self.sweep_interval_s = check_ttl(sweep_interval_s or min(1.0, self.ttl_s / 4))
        self.key = key
        self.view = RecordTable(key=key)
        self.store = store
        self.sync_interval_s = sync_interval_s
        self._expires_at: dict[str, float] = {}  # worker_id -> monotonic deadline
        self._sweeper: asyncio.Task[None] | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._kv_handlers: list[KVEventHandler] = []
        self._seq = 0  # the store's change log, read up to here
        # worker id -> seq of this replica's last write about it: an earlier change by another
        # replica that this one reads later must not undo it (the log's order decides)
        self._own_seq: dict[str, int] = {}
        self._store_open = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the sweep task (idempotent; without it, expiry happens only on reads); with a
        store, open it, load its live records and start the sync task. Raises
        ``sqlite3.Error`` when the store cannot be opened."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep_loop(), name="registry-sweep")
        if self.store is not None and (self._syncer is None or self._syncer.done()):
            if not self._store_open:
                await self.store.call(self.store.open)
                self._store_open = True
                await self._reload()
                logger.info(
                    "embedded registry shared through %s (%d live records)",
                    self.store.path,
                    len(self.view),
                )
            self._syncer = asyncio.create_task(self._sync_loop(), name="registry-sync")

    async def close(self) -> None:
        """Stop the sweep and sync tasks and close the store; idempotent. Records stay
        readable."""
        for task in (self._sweeper, self._syncer):
            await cancel_task(task)
        self._sweeper = self._syncer = None
        if self.store is not None:
            self._store_open = False
            await asyncio.to_thread(self.store.shutdown)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self.expire()

    # -- the shared store --------------------------------------------------------------------

    async def _reload(self) -> None:
        """Make the view the store's live records (at start, and after falling behind the
        store's trimmed log)."""
        assert self.store is not None
        loaded = await self.store.call(self.store.load)
        records = {}
        for body, expires_at in loaded.records:
            record = WorkerRecord.model_validate_json(body)
            records[record.worker_id] = record
            self._expires_at[record.worker_id] = expires_at
        for gone in [w for w in self._expires_at if w not in records]:
            del self._expires_at[gone]
        self.view.replace_all(records.values(), "not in the shared registry store")
        self._seq = loaded.seq

    async def _sync_loop(self) -> None:
        assert self.store is not None
        trim_every = max(1, round(5.0 / self.sync_interval_s))
        rounds = 0
        while True:
            await asyncio.sleep(self.sync_interval_s)
            rounds += 1
            try:
                await self.sync()
                if rounds % trim_every == 0:
                    await self.store.call(self.store.trim)
            except Exception:  # a locked or unwritable store: the next round tries again
                logger.exception("reading the shared registry store %s failed", self.store.path)

    async def sync(self) -> int:
        """Apply the changes the other replicas wrote since the last call; return how many
        (no-op without a store)."""
        if self.store is None or not self._store_open:
            return 0
        store = self.store
        changes = await store.call(lambda: store.changes_after(self._seq))
        if changes is None:
            logger.warning("fell behind the shared registry store's log; reloading its records")
            await self._reload()
            return 0
        for change in changes:
            self._seq = change.seq
            if change.origin != store.origin:
                await self._apply(change)
        return len(changes)

    async def _apply(self, change: Change) -> None:
        if change.kind != "kv" and change.seq < self._own_seq.get(change.worker_id, 0):
            return  # older than this replica's own write about the worker, applied already
        if change.kind == "put" and change.body is not None and change.expires_at is not None:
            record = WorkerRecord.model_validate_json(change.body)
            if self.view.put(record):
                self._expires_at[record.worker_id] = change.expires_at
        elif change.kind == "delete":
            self._expires_at.pop(change.worker_id, None)
            self.view.delete(change.worker_id, "deregistered")
        elif change.kind == "kv" and change.body is not None:
            event = KVCacheEvent.model_validate_json(change.body)
            if self._hand_out(event) and self.store is not None:
                store = self.store
                await store.call(lambda: store.want_snapshot(event.worker_id))

    # -- records -----------------------------------------------------------------------------

    def put(self, record: WorkerRecord, ttl_s: float | None = None) -> bool:
        """Insert or refresh ``record`` for ``ttl_s`` seconds; return True if it was not live.

        Raises ``ValueError`` if ``record.epoch`` is lower than the live record's epoch and
        :class:`AuthenticationError` if its signature does not verify (nothing changes).
        """
        self.expire()
        ttl = check_ttl(ttl_s) if ttl_s is not None else self.ttl_s
        old = self.view.get(record.worker_id)
        if old is not None and record.epoch < old.epoch:
            raise ValueError(
                f"worker {record.worker_id!r}: epoch {record.epoch} is older than the "
                f"registered epoch {old.epoch}"
            )
        if not self.view.put(record):
            raise AuthenticationError(
                f"the record of worker {record.worker_id!r} is not signed with the cluster key"
            )
        self._expires_at[record.worker_id] = time.monotonic() + ttl
        return old is None

    def remove(self, worker_id: str) -> bool:
        """Deregister ``worker_id``; return whether a live record was removed."""
        self.expire()
        self._expires_at.pop(worker_id, None)
        present = worker_id in self.view
        self.view.delete(worker_id, "deregistered")
        return present

    def expire(self, now: float | None = None) -> list[str]:
        """Drop records whose TTL lapsed (``now``: a ``time.monotonic()`` reading); return ids."""
        now = time.monotonic() if now is None else now
        lapsed = [w for w, deadline in self._expires_at.items() if deadline <= now]
        for worker_id in lapsed:
            del self._expires_at[worker_id]
            self.view.delete(worker_id, "TTL expired")
        return lapsed

    def workers(self) -> dict[str, WorkerRecord]:
        """Live records (lapsed ones are dropped first)."""
        self.expire()
        return self.view.snapshot()

    def subscribe(self, callback: Subscriber) -> None:
        """See :meth:`Watcher.subscribe`."""
        self.view.subscribe(callback)

    def subscribe_kv_events(self, handler: KVEventHandler) -> None:
        """Hand every posted KV cache event to ``handler`` (on the event loop)."""
        self._kv_handlers.append(handler)

    def kv_event(self, event: KVCacheEvent) -> KVEventAck:
        """Pass ``event`` to the KV event subscribers; the ack asks for a snapshot when one
        of them wants it (a failing subscriber is logged and asks for one)."""
        return KVEventAck(snapshot=self._hand_out(event))

    def _hand_out(self, event: KVCacheEvent) -> bool:
        snapshot = False
        for handler in list(self._kv_handlers):
            try:
                snapshot = handler(event) or snapshot
            except Exception:
                logger.exception("KV event subscriber %r failed on %s", handler, event.worker_id)
                snapshot = True
        return snapshot

    # -- what the routes call: through the shared store when there is one ---------------------

    async def register(self, record: WorkerRecord, ttl_s: float | None = None) -> bool:
        """:meth:`put`, written to the shared store first when there is one (the store checks
        the epoch against every replica's writes). Raises as :meth:`put` does, and
        ``sqlite3.Error`` when the store cannot be written."""
        if self.store is None:
            return self.put(record, ttl_s)
        if not self.view.accepts(record):
            raise AuthenticationError(
                f"the record of worker {record.worker_id!r} is not signed with the cluster key"
            )
        expires_at = time.monotonic() + (check_ttl(ttl_s) if ttl_s is not None else self.ttl_s)
        store, body = self.store, record.model_dump_json()
        created, seq = await store.call(
            lambda: store.put(record.worker_id, record.epoch, body, expires_at)
        )
        self._own_seq[record.worker_id] = seq
        self.view.put(record)
        self._expires_at[record.worker_id] = expires_at
        return created

    async def deregister(self, worker_id: str) -> bool:
        """:meth:`remove`, through the shared store when there is one."""
        if self.store is None:
            return self.remove(worker_id)
        store = self.store
        removed, seq = await store.call(lambda: store.remove(worker_id))
        self._own_seq[worker_id] = seq
        self.remove(worker_id)
        return removed

    async def post_kv_event(self, event: KVCacheEvent) -> KVEventAck:
        """:meth:`kv_event`, logged to the shared store when there is one (the other
        replicas apply it from there); the ack also asks for a snapshot that another replica
        wants."""
        if self.store is None:
            return self.kv_event(event)
        wanted_here = self._hand_out(event)
        store, body = self.store, event.model_dump_json()
        wanted = await store.call(lambda: store.add_kv_event(event.worker_id, body))
        return KVEventAck(snapshot=wanted_here or wanted)

    # -- HTTP --------------------------------------------------------------------------------

    def api_router(self) -> fastapi.APIRouter:
        """Routes under ``/registry``, internal (bearer token, not in the OpenAPI document);
        include it in the router app at the root."""
        api = fastapi.APIRouter(
            prefix="/registry",
            tags=["registry"],
            include_in_schema=False,
            route_class=internal_route_class(self.key),
        )

        @api.put("/workers/{worker_id}", response_model=RegisterReply)
        async def register(worker_id: str, body: RegisterBody) -> RegisterReply:
            if body.record.worker_id != worker_id:
                raise fastapi.HTTPException(
                    400, f"path worker_id {worker_id!r} != record {body.record.worker_id!r}"
                )
            try:
                created = await self.register(body.record, body.ttl_s)
            except ValueError as exc:  # StaleEpochError too
                raise fastapi.HTTPException(409, str(exc)) from None
            return RegisterReply(
                worker_id=worker_id, ttl_s=body.ttl_s or self.ttl_s, created=created
            )

        @api.delete("/workers/{worker_id}")
        async def deregister(worker_id: str) -> dict[str, bool]:
            return {"removed": await self.deregister(worker_id)}

        @api.get("/workers", response_model=WorkerList)
        async def list_workers() -> WorkerList:
            return WorkerList(workers=list(self.workers().values()))

        @api.get("/workers/{worker_id}", response_model=WorkerRecord)
        async def get_worker(worker_id: str) -> WorkerRecord:
            record = self.workers().get(worker_id)
            if record is None:
                raise fastapi.HTTPException(404, f"no live worker {worker_id!r}")
            return record

        @api.post("/kvcache/{worker_id}", response_model=KVEventAck)
        async def kv_events(worker_id: str, event: KVCacheEvent) -> KVEventAck:
            if event.worker_id != worker_id:
                raise fastapi.HTTPException(
                    400, f"path worker_id {worker_id!r} != event {event.worker_id!r}"
                )
            return await self.post_kv_event(event)

        return api


class EmbeddedWatcher(Watcher):
    """The router's view of its own :class:`EmbeddedRegistry`, read directly (no HTTP).

    ``start`` / ``close`` start and stop the registry's sweep task unless ``manage_sweep`` is
    False (when the router's lifespan already does).
    """

    def __init__(self, registry: EmbeddedRegistry, *, manage_sweep: bool = True) -> None:
        super().__init__(key=registry.key)
        self.registry = registry
        self.view = registry.view  # shared: the registry is the source of truth
        self._manage_sweep = manage_sweep

    async def start(self) -> None:
        if self._manage_sweep:
            await self.registry.start()

    def workers(self) -> dict[str, WorkerRecord]:
        return self.registry.workers()

    def subscribe_kv_events(self, handler: KVEventHandler) -> None:
        """The KV cache events workers post to the registry (:mod:`.kvcache`)."""
        self.registry.subscribe_kv_events(handler)

    async def close(self) -> None:
        if self._manage_sweep:
            await self.registry.close()
