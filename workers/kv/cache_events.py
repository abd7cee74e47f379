"""KV cache events, worker side: publish the block hashes a worker holds, in its KV pool and
in its KV cache connector's tiers, as they are stored and evicted.

Design origin: Dynamo's KV events (its workers publish ``stored`` / ``removed`` block events
for the KV router). The router keeps, per worker, the set of block hashes the worker holds
(:mod:`pdserve.router.kv_index`) and routes a prompt to the worker holding its prefix.

Two parts, split at the thread boundary:

- :class:`KVEventRecorder`, a :class:`~pdserve.workers.kv.manager.KVCacheListener` (the pool's
  changes, medium ``device``, under the KV cache manager's lock on the engine thread) and a
  :class:`~pdserve.workers.kv.tiers.TierListener` (the host, disk and remote tiers' changes, on
  the engine thread or a tier's writer thread); it only records, per (medium, hash), whether
  the hash was last stored or evicted (a dict insert under its own lock: quick, never blocks on
  I/O). Bounded: past ``max_pending`` distinct hashes it forgets them and asks for a snapshot.
- :class:`KVEventPublisher`, on the worker's event loop: every ``interval_s`` it drains the
  recorder into :class:`~pdserve.discovery.kvcache.KVCacheEvent` batches (at most
  ``MAX_HASHES_PER_EVENT`` hashes each, ``seq`` +1 per event), signs each with the cluster key
  (:meth:`~pdserve.security.ClusterKey.sign_event`: the router drops unsigned events, whatever
  the transport) and sends them over the registration's control plane
  (:func:`~pdserve.discovery.kvcache.kv_event_sender`: the embedded registry over HTTP, NATS,
  or etcd), one medium per event. A *snapshot* (the manager's ``cached_hashes()`` and each
  tier's ``hashes()``, sent as one ``reset`` event plus ``stored`` events) goes first, every
  ``snapshot_s`` seconds, after any failed send, after the recorder overflowed, and when the
  router asks for one (the transport's ack).

Why a snapshot followed by the drained changes is exact: ``cached_hashes()`` is taken first,
then the recorder is drained. Every change recorded before the snapshot is already in it and
replaying it sets the same state (per hash, the last change wins); every change after it is
in the drained batch or the next. So a router that applies reset + snapshot + changes holds
exactly the worker's index as of the drain.

Lifecycle (:func:`open_kv_events`): 1 START listener added, publisher task started (its first
flush is a snapshot) -> 2 RUN flush every ``interval_s`` -> 3 CLOSE (on the worker's exit
stack, before the registration closes) the task is cancelled and the recorder stops recording.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

from pdserve.discovery.kvcache import (
    MAX_HASHES_PER_EVENT,
    MEDIA,
    KVCacheEvent,
    KVEventSend,
    Medium,
    encode_hash,
    kv_event_sender,
    kv_snapshot_requests,
)

if TYPE_CHECKING:
    from pdserve.config.settings import DiscoverySettings
    from pdserve.security import ClusterKey
    from pdserve.workers.kv.manager import KVCacheManager
    from pdserve.workers.kv.offload import KVConnector

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
"""Longest wait between flushes while sends fail."""
MAX_PENDING = 1 << 16
"""Distinct hashes the recorder holds between two flushes before it gives up on them and asks
for a snapshot instead."""


class KVEventRecorder:
    """Records the pool's and the tiers' changes, coalesced per (medium, hash) (the last change
    wins).

    Thread-safety: ``blocks_stored`` / ``blocks_evicted`` run on the engine thread (under the
    manager's lock), ``tier_changed`` on the engine thread or a tier's writer thread,
    :meth:`drain` on the event loop; one internal lock, held for O(hashes), never calling out.
    """

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._changes: dict[tuple[Medium, int], bool] = {}  # True: stored, False: removed
        self._overflowed = False
        self._closed = False

    def blocks_stored(self, hashes: list[int], block_ids: list[int]) -> None:
        """KVCacheListener: ``hashes`` were indexed in the pool."""
        self.tier_changed("device", hashes, True)

    def blocks_evicted(self, hashes: list[int], block_ids: list[int]) -> None:
        """KVCacheListener: ``hashes`` left the pool's index."""
        self.tier_changed("device", hashes, False)

    def tier_changed(self, medium: Medium, hashes: Sequence[int], present: bool) -> None:
        """TierListener: ``hashes`` were stored in (``present``) or left ``medium``."""
        with self._lock:
            if self._closed:
                return
            for h in hashes:
                self._changes[(medium, h)] = present
            if len(self._changes) > self.max_pending:
                self._changes.clear()
                self._overflowed = True

    def drain(self) -> tuple[dict[tuple[Medium, int], bool], bool]:
        """The changes since the last drain (``(medium, hash) -> stored?``) and whether some
        were dropped (overflow: only a snapshot is exact now)."""
        with self._lock:
            changes, self._changes = self._changes, {}
            overflowed, self._overflowed = self._overflowed, False
            return changes, overflowed

    def close(self) -> None:
        """Stop recording (the manager keeps calling; idempotent)."""
        with self._lock:
            self._closed = True
            self._changes.clear()


class KVEventPublisher:
    """Sends one worker incarnation's KV cache events (see the module docstring).

    ``cached_hashes``: the manager's snapshot function (medium ``device``); ``tier_hashes``: the
    tiers' (:meth:`~pdserve.workers.kv.offload.KVConnector.tier_hashes`; None: no tier);
    ``key``: the cluster key every event is
    signed with (as the worker's record is); ``send``: the transport (never raises; None = not
    delivered); ``snapshot_requested``: polled at every flush, True when a router asked for a
    snapshot out of band (NATS). ``clock``: monotonic seconds (tests pass a fake).
    Not thread-safe: the event loop only. Counters: ``sent`` events, ``failed`` sends,
    ``snapshots``.
    """

    def __init__(
        self,
        *,
        worker_id: str,
        epoch: int,
        recorder: KVEventRecorder,
        cached_hashes: Callable[[], list[int]],
        key: ClusterKey,
        tier_hashes: Callable[[], Mapping[Medium, list[int]]] | None = None,
        send: KVEventSend,
        snapshot_s: float = 10.0,
        snapshot_requested: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshot_requested = snapshot_requested
        self.worker_id = worker_id
        self.epoch = epoch
        self.recorder = recorder
        self._cached_hashes = cached_hashes
        self._tier_hashes = tier_hashes
        self._key = key
        self._send = send
        self.snapshot_s = snapshot_s
        self._clock = clock
        self._seq = 0
        self._snapshot_wanted = True  # the first flush sends one
        self._next_snapshot = clock() + snapshot_s
        self.sent = self.failed = self.snapshots = 0

    def counts(self) -> dict[str, int]:
        """``sent`` and ``failed`` events and ``snapshots`` since start (for ``/metrics``)."""
        return {"sent": self.sent, "failed": self.failed, "snapshots": self.snapshots}

    def request_snapshot(self) -> None:
        """Send a snapshot with the next flush."""
        self._snapshot_wanted = True

    async def flush(self) -> bool:
        """Send what changed since the last flush (a snapshot first when one is due); return
        whether every event was delivered. Never raises."""
        if self._snapshot_requested is not None and self._snapshot_requested():
            self._snapshot_wanted = True
        snapshot = self._snapshot_wanted or self._clock() >= self._next_snapshot
        current = self._held() if snapshot else {}
        changes, overflowed = self.recorder.drain()  # after the snapshot: see the docstring
        if overflowed and not snapshot:  # a snapshot now covers what was drained; drain again
            snapshot, current = True, self._held()
            changes, _ = self.recorder.drain()
        events = self._batches(current, changes, snapshot)
        if snapshot:
            self._snapshot_wanted = False
            self._next_snapshot = self._clock() + self.snapshot_s
            self.snapshots += 1
        for event in events:
            ack = await self._send(event)
            if ack is None:  # lost: the rest would follow a gap; resync next time
                self.failed += 1
                self._snapshot_wanted = True
                return False
            self.sent += 1
            if ack.snapshot:
                self._snapshot_wanted = True
        return True

    def _held(self) -> dict[Medium, list[int]]:
        """What the worker holds now, per medium: the pool's cached hashes, then the tiers'."""
        held: dict[Medium, list[int]] = {"device": self._cached_hashes()}
        if self._tier_hashes is not None:
            held.update(self._tier_hashes())
        return held

    def _batches(
        self,
        snapshot: Mapping[Medium, list[int]],
        changes: Mapping[tuple[Medium, int], bool],
        reset: bool,
    ) -> list[KVCacheEvent]:
        """Events for a snapshot (``reset``: a first event that clears, even when empty) with
        the coalesced changes applied over it (they came later), each (medium, hash) once, one
        medium per event, at most MAX_HASHES_PER_EVENT hashes per event, ``seq`` assigned,
        each signed."""
        merged: dict[tuple[Medium, int], bool] = {}
        for medium, hashes in snapshot.items():
            merged.update(dict.fromkeys(((medium, h) for h in hashes), True))
        merged.update(changes)
        by_medium: dict[Medium, list[tuple[str, bool]]] = {}
        for (medium, h), present in merged.items():
            by_medium.setdefault(medium, []).append((encode_hash(h), present))
        parts = [
            (medium, items[start : start + MAX_HASHES_PER_EVENT])
            for medium in MEDIA
            if (items := by_medium.get(medium))
            for start in range(0, len(items), MAX_HASHES_PER_EVENT)
        ]
        if reset and not parts:
            parts = [("device", [])]  # a snapshot of nothing still clears the router's view
        events: list[KVCacheEvent] = []
        for i, (medium, part) in enumerate(parts):
            event = KVCacheEvent(
                worker_id=self.worker_id,
                epoch=self.epoch,
                seq=self._seq,
                sent_at=time.time(),
                reset=reset and i == 0,
                medium=medium,
                stored=tuple(h for h, present in part if present),
                removed=tuple(h for h, present in part if not present),
            )
            events.append(self._key.sign_event(event))
            self._seq += 1
        return events

    async def run(self, interval_s: float) -> None:
        """Flush every ``interval_s`` seconds until cancelled; after failed sends (the control
        plane unreachable) the wait doubles up to :data:`MAX_BACKOFF_S`, so an outage does
        not cost a snapshot's encoding every interval."""
        failures = 0
        while True:
            try:
                ok = await self.flush()
            except Exception:  # a bug must not end the loop for good
                log.exception("publishing KV cache events failed")
                self._snapshot_wanted = True
                ok = False
            failures = 0 if ok else failures + 1
            backoff = min(interval_s * 2 ** min(failures, 16), MAX_BACKOFF_S)
            await asyncio.sleep(max(interval_s, backoff))


async def open_kv_events(
    *,
    kv_cache: KVCacheManager,
    connector: KVConnector | None = None,
    registration: object,
    worker_id: str,
    epoch: int,
    key: ClusterKey,
    settings: DiscoverySettings,
    stack: AsyncExitStack,
) -> KVEventPublisher | None:
    """Lifecycle step 1: publish ``kv_cache``'s index changes and those of ``connector``'s tiers
    (None: no tier), signed with ``key`` (the cluster
    key, as the worker's record is), through ``registration`` (the cleanup goes onto
    ``stack``). None when KV events are off (``discovery.kv_events``), the
    prefix cache is off, or the registration carries no KV events."""
    send = kv_event_sender(registration)
    if not (settings.kv_events and kv_cache.prefix_caching and send is not None):
        return None
    recorder = KVEventRecorder()
    kv_cache.add_listener(recorder)
    if connector is not None:
        connector.add_tier_listener(recorder)
    publisher = KVEventPublisher(
        worker_id=worker_id,
        epoch=epoch,
        recorder=recorder,
        cached_hashes=kv_cache.cached_hashes,
        tier_hashes=connector.tier_hashes if connector is not None else None,
        key=key,
        send=send,
        snapshot_s=settings.kv_events_snapshot_s,
        snapshot_requested=kv_snapshot_requests(registration),
    )
    task = asyncio.create_task(publisher.run(settings.kv_events_interval_s), name="kv-events")

    async def close() -> None:
        recorder.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    stack.push_async_callback(close)
    log.info(
        "publishing KV cache events every %.0f ms (snapshot every %.0f s)",
        settings.kv_events_interval_s * 1e3,
        settings.kv_events_snapshot_s,
    )
    return publisher
