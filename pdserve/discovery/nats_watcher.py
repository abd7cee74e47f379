"""Router side of NATS discovery: follows the ``pdserve_workers`` bucket and the worker events.

:class:`NatsWatcher` lifecycle:

1. ``start()``: connect (2 s at most inline, then in the background), ``watchall`` the bucket:
   the last entry per key is the listing (put into the view), then live updates follow. It
   also subscribes to ``pdserve.load.>`` and ``pdserve.kv.>`` (:mod:`pdserve.discovery.load_events`).
2. follow: a put -> the view; a DEL marker (a worker's ``close()``) -> removed at once; an
   expiry marker (the record's TTL ran out: the worker stopped refreshing) -> removed, within
   TTL + the server's marker delay of the worker's last refresh.
3. NATS lost: the view is kept as it was (``connected`` is False) and nats-py reconnects. On
   the reconnect the bucket is listed and watched again (only the differences are applied).
   Records that expired *during* the outage are no proof that their workers died (their
   refreshes could not reach the server either), so for ``resync_grace_s`` seconds after a
   re-list, expiries and absences are deferred, and cancelled by a fresh put; DEL markers act
   at once. A worker that really died leaves the view when the grace ends.
4. ``close()``: stop following; the last view stays readable. Idempotent.

Every event is signed with the cluster key, like the records: the
:class:`~pdserve.discovery.load_events.EventConsumer` drops load and KV block events whose signature
does not verify before they reach the overlay below, and the router's KV index
(:meth:`pdserve.router.kv_index.KVIndex.apply`) does the same for KV cache events.

Load events: a :class:`~pdserve.discovery.load_events.LoadEvent` of the record's epoch, newer than
the record (``sent_at > updated_at``), replaces the record's ``load`` in the view, so the
pairing policy sees load about once a second while records are written every ``ttl_s / 3``.
KV block events are kept per worker (:meth:`NatsWatcher.kv_events`); a rise in a prefill
worker's ``expired_total`` is logged as a warning. KV cache events (``pdserve.kvcache.>``,
:mod:`pdserve.discovery.kvcache`) go to the handlers of :meth:`NatsWatcher.subscribe_kv_events`;
when one wants a snapshot, the watcher asks the worker on ``pdserve.kvsync.<key>`` (at most
once per worker per :data:`SYNC_REQUEST_INTERVAL_S`).

Async-safety: one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from pdserve.discovery.kvcache import KVSYNC_SUBJECT, KVCacheEvent, KVEventHandler
from pdserve.discovery.load_events import (
    EventConsumer,
    KVBlockEvent,
    LoadEvent,
    subject_token,
    worker_id_of,
)
from pdserve.discovery.nats import (
    CLOSE_TIMEOUT_S,
    CONNECT_WAIT_S,
    NatsSession,
    explain_error,
    record_of,
)
from pdserve.discovery.records import BackgroundWatcher
from pdserve.discovery.retry import Backoff
from pdserve.discovery.tls import ControlPlaneTLS
from pdserve.protocol import WorkerRecord

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)

RESYNC_GRACE_S = 5.0
"""Seconds after a re-list during which expiries wait for the worker's own re-put."""
SYNC_REQUEST_INTERVAL_S = 1.0
"""Least time between two KV cache snapshot requests to one worker."""


class NatsWatcher(BackgroundWatcher["KeyValue.KeyWatcher | None"]):
    """Follows the ``pdserve_workers`` bucket and the worker event subjects."""

    _task_name = "nats-watch"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        key: ClusterKey,
        op_timeout_s: float = 5.0,
        resync_grace_s: float = RESYNC_GRACE_S,
        tls: ControlPlaneTLS | None = None,
    ) -> None:
        super().__init__(key=key)  # key: the view drops records not signed with it
        self.key = key  # and the events drop events not signed with it
        self.server_url = f"nats://{host}:{port}"
        self.op_timeout_s = op_timeout_s
        self.resync_grace_s = resync_grace_s
        self.connected = False
        self._session = NatsSession(
            self.server_url,
            op_timeout_s=op_timeout_s,
            on_connect=self._on_connect,
            on_disconnect=self._on_disconnect,
            tls=tls,
        )
        self._resync = asyncio.Event()
        self._backoff = Backoff(0.1, 5.0)
        self._events = EventConsumer(self._on_load, self._on_kv, self._on_kvcache, key=key)
        self._kv_handlers: list[KVEventHandler] = []
        self._sync_asked: dict[str, float] = {}  # worker id -> loop time of the last request
        self._pending_sync: set[asyncio.Task[None]] = set()
        self._loads: dict[str, LoadEvent] = {}
        self._kv_events: dict[str, KVBlockEvent] = {}
        self._expiring: dict[str, asyncio.TimerHandle] = {}
        self._grace_until = 0.0  # loop time; expiries before it are deferred

    def kv_events(self) -> dict[str, KVBlockEvent]:
        """The newest KV block event per live worker (a new dict)."""
        return dict(self._kv_events)

    def subscribe_kv_events(self, handler: KVEventHandler) -> None:
        """Hand every KV cache event (``pdserve.kvcache.>``) to ``handler`` (on the loop)."""
        self._kv_handlers.append(handler)

    def _on_kvcache(self, event: KVCacheEvent) -> None:
        wanted = False
        for handler in list(self._kv_handlers):
            try:
                wanted = handler(event) or wanted
            except Exception:
                logger.exception("KV event subscriber %r failed on %s", handler, event.worker_id)
        if wanted:
            self._ask_snapshot(event.worker_id)

    def _ask_snapshot(self, worker_id: str) -> None:
        """Publish a snapshot request to ``worker_id`` (rate limited; fire and forget)."""
        now = asyncio.get_running_loop().time()
        if now - self._sync_asked.get(worker_id, -1e9) < SYNC_REQUEST_INTERVAL_S:
            return
        if len(self._sync_asked) >= 4096:  # bounded: ids come from whoever publishes
            self._sync_asked.clear()
        self._sync_asked[worker_id] = now
        client = self._session.client
        subject = f"{KVSYNC_SUBJECT}.{subject_token(worker_id)}"

        async def publish() -> None:
            try:
                await client.publish(subject, b"")
            except Exception as exc:  # NATS away: the worker's periodic snapshot heals it
                logger.debug("asking %s for a KV snapshot failed: %r", worker_id, exc)

        if client.is_connected:
            task = asyncio.create_task(publish())
            self._pending_sync.add(task)
            task.add_done_callback(self._pending_sync.discard)

    async def _sync(self) -> KeyValue.KeyWatcher | None:
        """List and begin watching inline (2 s at most to connect); if NATS is unreachable,
        log a warning and keep retrying in the background (the view starts empty)."""
        await self._session.start()
        if await self._session.wait_connected(CONNECT_WAIT_S):
            return await self._open()
        error = self._session.last_error
        logger.warning(
            "NATS %s unreachable (%s); watching workers once it is up",
            self.server_url,
            explain_error(error) if error is not None else "no answer",
        )
        return None

    async def _release(self) -> None:
        for handle in self._expiring.values():
            handle.cancel()
        self._expiring.clear()
        await self._events.close()
        await self._session.close()
        self.connected = False

    def _on_connect(self) -> None:
        self._resync.set()

    def _on_disconnect(self) -> None:
        self.connected = False

    async def _open(self) -> KeyValue.KeyWatcher | None:
        """(Re)list the bucket into the view and return the live watch, or None after
        logging a failure (the last view is kept)."""
        self._resync.clear()  # a reconnect from here on triggers another re-list
        watch = None
        try:
            if not self._session.client.is_connected:
                raise ConnectionError("not connected")
            kv = await self._session.kv()
            watch = await kv.watchall()
            listed: dict[str, WorkerRecord] = {}
            deregistered: set[str] = set()
            while (entry := await watch.updates(timeout=self.op_timeout_s)) is not None:
                worker_id = worker_id_of(entry.key)
                record = record_of(entry)
                if record is not None:
                    listed[worker_id] = record
                elif entry.operation == "DEL":
                    deregistered.add(worker_id)
            await self._events.start(self._session.client)
        except Exception as exc:  # NATS down, JetStream not ready, timeout: retry with backoff
            if watch is not None:
                await _stop(watch)
            self._session.forget_bucket()
            if self._backoff.failures % 10 == 0:
                logger.warning(
                    "NATS %s: listing/watching workers failed (%r); keeping the last view "
                    "(%d workers) and retrying",
                    self.server_url,
                    exc,
                    len(self.view),
                )
            return None
        self._relist(listed, deregistered)
        if self._backoff.failures:
            logger.info("NATS %s: watching workers again (%d live)", self.server_url, len(listed))
        self._backoff.reset()
        self.connected = True
        return watch

    def _relist(self, listed: dict[str, WorkerRecord], deregistered: set[str]) -> None:
        """Make the view match a fresh listing; absences other than DEL markers are deferred
        expiries (their workers could not refresh while the server was away)."""
        if len(self.view):
            self._grace_until = asyncio.get_running_loop().time() + self.resync_grace_s
        for worker_id in [w for w in self.view.snapshot() if w not in listed]:
            if worker_id in deregistered:
                self._remove(worker_id, "deregistered while NATS was out of reach")
            else:
                self._expire_later(worker_id)
        for record in listed.values():
            self._put(record)

    async def _follow(self, watch: KeyValue.KeyWatcher | None) -> None:
        while True:
            if watch is None:  # wait for the backoff or a reconnect, whichever comes first
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._resync.wait(), self._backoff.next_delay())
            else:
                resync = await self._follow_watch(watch)
                self.connected = False
                await _stop(watch)
                if not resync:  # the watch ended by itself: do not spin on a broken one
                    await asyncio.sleep(self._backoff.next_delay())
            watch = await self._open()

    async def _follow_watch(self, watch: KeyValue.KeyWatcher) -> bool:
        """Apply updates until a reconnect asks for a re-list (return True) or the watch ends
        (False)."""

        async def apply_all() -> None:
            async for entry in watch:
                if entry is not None:
                    self._apply(entry)

        follow = asyncio.create_task(apply_all())
        resync = asyncio.create_task(self._resync.wait())
        await asyncio.wait({follow, resync}, return_when=asyncio.FIRST_COMPLETED)
        if resync.done():
            logger.info("NATS %s: reconnected; listing workers again", self.server_url)
        elif follow.exception() is not None:  # done: a broken watch is listed again too
            logger.warning(
                "NATS %s: watch broke (%r); listing again", self.server_url, follow.exception()
            )
        requested = resync.done()
        for task in (follow, resync):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return requested

    def _apply(self, entry: KeyValue.Entry) -> None:
        worker_id = worker_id_of(entry.key)
        if (record := record_of(entry)) is not None:
            self._put(record)
        elif entry.operation is None:
            return  # a malformed value (logged)
        elif entry.operation == "DEL":
            self._remove(worker_id, "deregistered (DEL in NATS)")
        elif asyncio.get_running_loop().time() < self._grace_until:
            self._expire_later(worker_id)
        else:
            self._remove(worker_id, "record expired in NATS (TTL)")

    def _put(self, record: WorkerRecord) -> None:
        event = self._loads.get(record.worker_id)
        if event is None or event.epoch != record.epoch or event.sent_at <= record.updated_at:
            event = None  # the record's own load is the freshest
        if not self.view.put(record, load=event.load if event is not None else None):
            return  # not signed with the cluster key: dropped (logged), no expiry cancelled
        handle = self._expiring.pop(record.worker_id, None)
        if handle is not None:
            handle.cancel()

    def _remove(self, worker_id: str, reason: str) -> None:
        handle = self._expiring.pop(worker_id, None)
        if handle is not None:
            handle.cancel()
        self._loads.pop(worker_id, None)
        self._kv_events.pop(worker_id, None)
        self._sync_asked.pop(worker_id, None)
        self.view.delete(worker_id, reason)

    def _expire_later(self, worker_id: str) -> None:
        if worker_id in self._expiring or worker_id not in self.view:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._grace_until - loop.time())
        self._expiring[worker_id] = loop.call_later(
            delay,
            self._remove,
            worker_id,
            "record expired in NATS and not renewed after the outage",
        )

    def _on_load(self, event: LoadEvent) -> None:
        record = self.view.get(event.worker_id)
        if record is None or record.epoch != event.epoch:
            return  # unknown worker or another incarnation: the record decides
        last = self._loads.get(event.worker_id)
        if last is not None and last.epoch == event.epoch and event.seq <= last.seq:
            return
        self._loads[event.worker_id] = event
        if event.sent_at > record.updated_at and event.load != record.load:
            self.view.set_load(event.worker_id, event.load)  # the record was verified already

    def _on_kv(self, event: KVBlockEvent) -> None:
        record = self.view.get(event.worker_id)
        if record is None or record.epoch != event.epoch:
            return
        last = self._kv_events.get(event.worker_id)
        self._kv_events[event.worker_id] = event
        if (
            last is not None
            and last.epoch == event.epoch
            and event.expired_total > last.expired_total
        ):
            logger.warning(
                "worker %s: %d parked requests expired before a decode worker pulled them "
                "(%d since it started)",
                event.worker_id,
                event.expired_total - last.expired_total,
                event.expired_total,
            )


async def _stop(watch: KeyValue.KeyWatcher) -> None:
    try:
        await asyncio.wait_for(watch.stop(), CLOSE_TIMEOUT_S)
    except Exception as exc:  # the connection may be down
        logger.debug("stopping the NATS watch failed: %r", exc)
