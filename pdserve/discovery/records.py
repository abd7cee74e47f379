"""Router side of discovery: :class:`Watcher` (a live ``worker_id -> WorkerRecord`` view plus
put/delete callbacks), :class:`BackgroundWatcher` (a watcher that follows its backend from one
task) and :class:`RecordTable`, the one place records enter any watcher's view: it drops a
record whose signature does not verify, with a rate-limited warning. Async-safety: one event
loop, not thread-safe.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Generic, TypeVar

from pdserve.discovery.retry import cancel_task
from pdserve.protocol import WorkerLoad, WorkerRecord

if TYPE_CHECKING:
    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)

_F = TypeVar("_F")

Subscriber = Callable[[str, WorkerRecord | None], None]
"""Called with ``(worker_id, record)`` on a put and ``(worker_id, None)`` on a delete."""

UNSIGNED_WARN_INTERVAL_S = 60.0
"""At most one warning per worker id per this many seconds about a dropped unsigned record."""


class Watcher(abc.ABC):
    """Router side: a live view of registered workers. ``key`` (the cluster key) checks every
    record's signature as it enters the view (:class:`RecordTable`)."""

    def __init__(self, *, key: ClusterKey) -> None:
        self.view = RecordTable(key=key)

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the current records and begin following changes."""

    def workers(self) -> dict[str, WorkerRecord]:
        """A snapshot ``worker_id -> record`` of live records (a new dict; safe to keep)."""
        return self.view.snapshot()

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(worker_id, record)`` on every put and ``(worker_id, None)`` on every
        delete, on the event loop thread. It must not block; exceptions are logged."""
        self.view.subscribe(callback)

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop following changes; idempotent. The last view stays readable."""


class BackgroundWatcher(Watcher, Generic[_F]):
    """A :class:`Watcher` that follows its backend from one background task (template method).

    A backend supplies :meth:`_sync` (the first listing, inline, never raising; returns what
    :meth:`_follow` continues from, e.g. an open watch or None after a failure), :meth:`_follow`
    (runs until cancelled; reconnects by itself) and :meth:`_release` (frees clients; never
    raises). ``start`` is idempotent while running; ``close`` cancels the task, then releases.
    """

    _task_name = "discovery-watch"

    def __init__(self, *, key: ClusterKey) -> None:
        super().__init__(key=key)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """List inline (a failure is logged, not raised), then follow in the background."""
        if self._task is not None:
            return
        first = await self._sync()
        self._task = asyncio.create_task(self._follow(first), name=self._task_name)

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_task(task)
        await self._release()

    @abc.abstractmethod
    async def _sync(self) -> _F:
        """The first listing into the view; never raises."""

    @abc.abstractmethod
    async def _follow(self, first: _F) -> None:
        """Follow changes until cancelled."""

    @abc.abstractmethod
    async def _release(self) -> None:
        """Release clients and timers after the task ended; never raises."""


class RecordTable:
    """``worker_id -> WorkerRecord`` plus subscribers; logs arrivals, restarts and removals.

    Every record that enters (:meth:`put`, :meth:`replace_all`) must carry a signature that
    verifies under ``key`` (:meth:`WorkerRecord.signature_ok`); any other is dropped with a warning naming
    the worker id, at most once per id per :data:`UNSIGNED_WARN_INTERVAL_S` seconds.

    Not thread-safe: mutate and read it from one event loop.
    """

    def __init__(self, *, key: ClusterKey) -> None:
        self._key = key
        self._records: dict[str, WorkerRecord] = {}
        self._subscribers: list[Subscriber] = []
        self._warned_at: dict[str, float] = {}  # worker_id -> monotonic time of the warning
        self.dropped = 0  # records refused for their signature, since creation

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._records

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def snapshot(self) -> dict[str, WorkerRecord]:
        return dict(self._records)

    def subscribe(self, callback: Subscriber) -> None:
        self._subscribers.append(callback)

    def accepts(self, record: WorkerRecord) -> bool:
        """Whether ``record``'s signature verifies; a refusal is counted and logged (rate
        limited per worker id)."""
        if self._key.record_signed(record):
            return True
        self.dropped += 1
        now = time.monotonic()
        last = self._warned_at.get(record.worker_id)
        if last is None or now - last >= UNSIGNED_WARN_INTERVAL_S:
            if len(self._warned_at) >= 1024:  # bounded: ids come from whoever writes records
                self._warned_at.clear()
            self._warned_at[record.worker_id] = now
            logger.warning(
                "dropping the record of worker %r (%s at %r): its signature is %s; it was not "
                "written by a process holding this cluster's secret",
                record.worker_id,
                record.role,
                record.http_url,
                "wrong" if record.signature else "missing",
            )
        return False

    def put(self, record: WorkerRecord, *, load: WorkerLoad | None = None) -> bool:
        """Insert or replace a record whose signature verifies (else drop it, see
        :meth:`accepts`); a higher epoch for a known worker is a restart. ``load`` replaces
        the record's load once it is verified (fresher load from an event bus). Returns
        whether the record was taken."""
        if not self.accepts(record):
            return False
        if load is not None:
            record = record.model_copy(update={"load": load})
        self._store(record)
        return True

    def _store(self, record: WorkerRecord) -> None:
        old = self._records.get(record.worker_id)
        self._records[record.worker_id] = record
        if old is None:
            logger.info(
                "worker %s registered (%s, epoch %d, %s)",
                record.worker_id,
                record.role,
                record.epoch,
                record.http_url,
            )
        elif record.epoch > old.epoch:
            logger.info(
                "worker %s restarted: epoch %d -> %d", record.worker_id, old.epoch, record.epoch
            )
        elif record.epoch < old.epoch:
            logger.warning(
                "worker %s epoch went back %d -> %d (stale incarnation?)",
                record.worker_id,
                old.epoch,
                record.epoch,
            )
        self._notify(record.worker_id, record)

    def set_load(self, worker_id: str, load: WorkerLoad) -> None:
        """Replace the load of a record already in the table (a load event about a verified
        record; the signature still covers the identity it was verified with). No-op for an
        unknown worker."""
        old = self._records.get(worker_id)
        if old is None or old.load == load:
            return
        self._records[worker_id] = record = old.model_copy(update={"load": load})
        self._notify(worker_id, record)

    def delete(self, worker_id: str, reason: str) -> None:
        """Remove a record (no-op if absent); ``reason`` goes to the log ("expired", ...)."""
        old = self._records.pop(worker_id, None)
        if old is None:
            return
        logger.info("worker %s removed (%s, epoch %d)", worker_id, reason, old.epoch)
        self._notify(worker_id, None)

    def replace_all(self, records: Iterable[WorkerRecord], reason: str) -> None:
        """Make the view equal ``records`` (after a re-list), emitting only the differences;
        a record whose signature does not verify counts as absent."""
        fresh = {r.worker_id: r for r in records if self.accepts(r)}
        for worker_id in [w for w in self._records if w not in fresh]:
            self.delete(worker_id, reason)
        for worker_id, record in fresh.items():
            if self._records.get(worker_id) != record:
                self._store(record)

    def _notify(self, worker_id: str, record: WorkerRecord | None) -> None:
        for callback in list(self._subscribers):
            try:
                callback(worker_id, record)
            except Exception:
                logger.exception("discovery subscriber %r failed on %s", callback, worker_id)
