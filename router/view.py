"""The router's view of the workers it may use for one served model.

A :class:`WorkerView` reads live records from a discovery watcher (anything with
``workers() -> dict[str, WorkerRecord]``) on every call, so it never holds stale records, and
keeps the router's *own* per-worker in-flight counts: requests this router has sent to a worker
and not yet finished. Workers report their load in their records only every second or so, so the
local count is what keeps a burst of requests from all landing on the same worker.

A worker is *usable* when its record

- serves this router's model (``record.model == served_model_name``),
- speaks this router's protocol (``record.protocol_version == PROTOCOL_VERSION``),
- has a role (prefill, decode or colocated; the policy decides which path uses which,
  :mod:`pdserve.router.policy`).

A worker the router could not connect to is *suspect* for ``suspect_s`` seconds (its record
may outlive a crash by up to the registration TTL): it is left out, unless it re-registers
with a new epoch (a restart), so requests stop paying a failed connect each.

Restarts: :meth:`WorkerView.observe` is a discovery subscriber (``watcher.subscribe``); it
remembers the last epoch of every worker id it has seen (also after the record is gone, since a
crashed worker's record may expire before its successor registers) and calls ``on_restart``
with the new record when a known worker id comes back with a higher epoch.

Losses and changes (fault tolerance, docs/reliability.md): :meth:`WorkerView.watch_loss` calls
back when one incarnation of a worker leaves discovery (its record deleted: the registration
lease expired, the worker deregistered; or replaced by a higher epoch), so a transaction can
stop waiting on a stopped or partitioned worker; :meth:`WorkerView.changed` waits for the next
put or delete (requests held while no worker can serve them).

Whether a prefill and a decode worker can be paired (KV layouts the formatter maps,
``KVLayout.can_map_to``) is the policy's business (:mod:`pdserve.router.policy`); the view only
reports what is there.

Thread-safety: none needed and none given. Every method runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

from pdserve.protocol import PROTOCOL_VERSION, Role, WorkerRecord

LOST = "left discovery"
"""In the reason :meth:`WorkerView.watch_loss` passes: a worker's incarnation is gone."""


class WorkerSource(Protocol):
    """What the view needs from a discovery watcher."""

    def workers(self) -> dict[str, WorkerRecord]: ...


@dataclass(frozen=True)
class WorkerState:
    """One usable worker as the policy sees it: its record plus this router's in-flight count."""

    record: WorkerRecord
    in_flight: int
    prefilling: int = 0
    """Of ``in_flight``, requests still in their prefill leg on another worker (a decode
    worker's requests that have not reached it yet)."""

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def compat_hash(self) -> str:
        return self.record.layout.compat_hash()


@dataclass(frozen=True)
class Candidates:
    """A snapshot of the usable workers, split by role, plus what was skipped and why."""

    model: str
    prefill: tuple[WorkerState, ...]
    decode: tuple[WorkerState, ...]
    skipped: tuple[str, ...] = ()
    """Human-readable reasons for live records that were left out, e.g. a protocol mismatch."""
    colocated: tuple[WorkerState, ...] = ()


@dataclass(frozen=True)
class ViewReadiness:
    """The view's readiness, what ``/ready`` reports: usable worker ids per role, the paths that
    can serve a request now (``disaggregated``, ``local_prefill``, ``colocated``), what is
    missing (empty = ready) and notes on a ready deployment that serves less than its workers
    suggest (e.g. prefill workers no decode worker can pair with). The HTTP body it becomes is
    :class:`pdserve.server.rendering.replies.Readiness`."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    missing: tuple[str, ...]
    colocated: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        """True when some path can serve the model (nothing is missing)."""
        return not self.missing


class WorkerView:
    """Usable workers for ``served_model_name`` plus this router's in-flight counts.

    Ownership: the view does not own the watcher (it never starts or closes it).
    """

    def __init__(
        self,
        source: WorkerSource,
        *,
        served_model_name: str,
        suspect_s: float = 5.0,
        on_restart: Callable[[WorkerRecord], None] | None = None,
    ) -> None:
        self._source = source
        self.served_model_name = served_model_name
        self.suspect_s = suspect_s
        self._on_restart = on_restart
        self._in_flight: dict[str, int] = {}
        self._prefilling: dict[str, int] = {}  # of those, still in their prefill leg
        self._suspect: dict[tuple[str, int], float] = {}  # (id, epoch) -> monotonic expiry
        self._epochs: dict[str, int] = {}  # worker id -> highest epoch seen
        self.restarts = 0
        """Restarts seen by :meth:`observe` (a known worker id with a higher epoch)."""
        # worker id -> epoch -> watch token -> callback (watch_loss)
        self._losses: dict[str, dict[int, dict[int, Callable[[str], None]]]] = {}
        self._watches = itertools.count()
        self._changed: asyncio.Event | None = None
        self.follows = False
        """Whether discovery puts and deletes reach :meth:`observe` (else :meth:`changed`
        polls and losses are seen by connection errors only)."""

    def follow(self, watcher: object) -> None:
        """Subscribe :meth:`observe` to ``watcher`` (when it has ``subscribe``) after noting
        the epochs of the workers it already lists, so they do not count as restarts."""
        subscribe = getattr(watcher, "subscribe", None)
        if subscribe is None:
            return
        for worker_id, record in self._source.workers().items():
            self._epochs[worker_id] = max(record.epoch, self._epochs.get(worker_id, 0))
        subscribe(self.observe)
        self.follows = True

    def observe(self, worker_id: str, record: WorkerRecord | None) -> None:
        """A discovery put (``record``) or delete (None); a known ``worker_id`` with a higher
        epoch than seen before is a restart: counted, and passed to ``on_restart``. A delete,
        or a higher epoch, is the loss of the incarnation seen before (:meth:`watch_loss`)."""
        if (changed := self._changed) is not None:
            self._changed = None
            changed.set()
        if record is None:
            self._lost(worker_id, None, "its registration expired or was withdrawn")
            return
        self._lost(worker_id, record.epoch, f"it restarted (epoch {record.epoch})")
        last = self._epochs.get(worker_id)
        if last is not None and record.epoch <= last:
            return
        self._epochs[worker_id] = record.epoch
        if last is not None:
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart(record)

    def _lost(self, worker_id: str, epoch: int | None, why: str) -> None:
        """Call the loss callbacks of ``worker_id``'s incarnations older than ``epoch`` (None:
        all of them)."""
        epochs = self._losses.get(worker_id)
        if not epochs:
            return
        for old in [e for e in epochs if epoch is None or e < epoch]:
            for callback in epochs.pop(old).values():
                callback(f"worker {worker_id} {LOST}: {why}")
        if not epochs:
            del self._losses[worker_id]

    def watch_loss(
        self, record: WorkerRecord, callback: Callable[[str], None]
    ) -> Callable[[], None]:
        """Call ``callback(reason)`` once, on the event loop, when this incarnation of the
        worker (id and epoch) leaves discovery (a delete, or a record with a higher epoch).
        Returns the function that stops watching (idempotent, O(1)). Needs :meth:`follow`;
        without it nothing is ever called."""
        worker_id, epoch, token = record.worker_id, record.epoch, next(self._watches)
        self._losses.setdefault(worker_id, {}).setdefault(epoch, {})[token] = callback

        def unwatch() -> None:
            epochs = self._losses.get(worker_id)
            watches = epochs.get(epoch) if epochs is not None else None
            if watches is None or watches.pop(token, None) is None:
                return
            if not watches:
                del epochs[epoch]  # type: ignore[union-attr]
                if not epochs:
                    del self._losses[worker_id]

        return unwatch

    async def changed(self, timeout_s: float) -> None:
        """Wait until discovery reports a put or delete, at most ``timeout_s`` seconds (and at
        most 0.25 s when the view does not :meth:`follow` a watcher: then it polls)."""
        if not self.follows:
            timeout_s = min(timeout_s, 0.25)
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            pass

    def record(self, worker_id: str) -> WorkerRecord | None:
        """The worker's live record (None: not in discovery now)."""
        return self._source.workers().get(worker_id)

    def mark_unreachable(self, record: WorkerRecord) -> None:
        """Leave this incarnation of the worker out for ``suspect_s`` seconds."""
        self._suspect[(record.worker_id, record.epoch)] = time.monotonic() + self.suspect_s

    def _is_suspect(self, record: WorkerRecord, now: float) -> bool:
        key = (record.worker_id, record.epoch)
        until = self._suspect.get(key)
        if until is not None and until <= now:
            del self._suspect[key]
            return False
        return until is not None

    def in_flight(self, worker_id: str) -> int:
        """Requests this router has outstanding on ``worker_id``."""
        return self._in_flight.get(worker_id, 0)

    def track(self, worker_id: str) -> AbstractContextManager[None]:
        """Count one in-flight request on ``worker_id`` for the duration of the block."""
        return _counted(self._in_flight, worker_id)

    def prefilling(self, decode_worker_id: str) -> AbstractContextManager[None]:
        """Mark one of ``decode_worker_id``'s in-flight requests as still in its prefill leg
        for the duration of the block (:attr:`WorkerState.prefilling`)."""
        return _counted(self._prefilling, decode_worker_id)

    def candidates(self) -> Candidates:
        """Snapshot the usable prefill, decode and colocated workers (sorted by worker id)."""
        prefill: list[WorkerState] = []
        decode: list[WorkerState] = []
        colocated: list[WorkerState] = []
        skipped: list[str] = []
        now = time.monotonic()
        for worker_id, record in sorted(self._source.workers().items()):
            if record.model != self.served_model_name:
                continue
            if self._is_suspect(record, now):
                skipped.append(f"{worker_id} was unreachable less than {self.suspect_s:g} s ago")
                continue
            if record.protocol_version != PROTOCOL_VERSION:
                skipped.append(
                    f"{worker_id} speaks protocol {record.protocol_version}, "
                    f"router speaks {PROTOCOL_VERSION}"
                )
                continue
            state = WorkerState(
                record, self.in_flight(worker_id), self._prefilling.get(worker_id, 0)
            )
            if record.role == Role.PREFILL:
                prefill.append(state)
            elif record.role == Role.DECODE:
                decode.append(state)
            elif record.role == Role.COLOCATED:
                colocated.append(state)
        return Candidates(
            self.served_model_name,
            tuple(prefill),
            tuple(decode),
            tuple(skipped),
            tuple(colocated),
        )

    def readiness(self) -> ViewReadiness:
        """Ready when some path can serve a request: a usable decode worker (paired with a
        prefill worker whose KV layout it maps, or prefilling locally) or a colocated worker.
        A prefill worker alone serves nothing."""
        cands = self.candidates()
        model = self.served_model_name
        paths: list[str] = []
        notes: list[str] = []
        pairable = any(
            p.record.layout.can_map_to(d.record.layout) for p in cands.prefill for d in cands.decode
        )
        if pairable:
            paths.append("disaggregated")
        if cands.decode:
            paths.append("local_prefill")
            if cands.prefill and not pairable:
                notes.append(
                    "no prefill/decode pair with mappable KV layouts: decode workers prefill "
                    "every request locally"
                )
        if cands.colocated:
            paths.append("colocated")
        missing: list[str] = []
        if not paths:
            missing = [f"decode or colocated worker for model {model!r}", *cands.skipped]
        return ViewReadiness(
            prefill=tuple(w.worker_id for w in cands.prefill),
            decode=tuple(w.worker_id for w in cands.decode),
            missing=tuple(missing),
            colocated=tuple(w.worker_id for w in cands.colocated),
            paths=tuple(paths),
            notes=tuple(notes),
        )


@contextmanager
def _counted(counts: dict[str, int], key: str) -> Iterator[None]:
    """``counts[key]`` one higher for the duration of the block; a key that drops to 0 is
    removed (no entries for workers long gone)."""
    counts[key] = counts.get(key, 0) + 1
    try:
        yield
    finally:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
