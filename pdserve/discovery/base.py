"""Discovery interfaces shared by every backend: URL parsing, the two roles, the worker view.

Two roles, one per side of the control plane:

- worker side, :class:`Registration`: holds the worker's :class:`WorkerRecord` under a TTL
  (an etcd lease, a NATS per-key TTL, or the embedded registry's expiry) and refreshes it every
  ``ttl_s / 3`` from a background task until :meth:`Registration.close`. Its lifecycle is a
  pollable :class:`RegistrationState`:

      IDLE --start()--> REGISTERED <--(refresh fails / lease lost)--> RETRYING
        \\--------------------------------close()------------------------> CLOSED

- router side, :class:`Watcher`: a live ``worker_id -> WorkerRecord`` view plus put/delete
  callbacks, kept in a :class:`RecordTable`.

Signed records (so that write access to etcd/NATS is not enough to register a worker): a
:class:`Registration` signs every record it holds with the cluster key
(:meth:`WorkerRecord.signed`); a :class:`RecordTable`, the one place records enter any watcher's
view, drops one whose signature does not verify, with a rate-limited warning.

Async-safety: every object here belongs to one asyncio event loop and is not thread-safe;
call its methods from that loop's thread.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
import math
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, TypeVar
from urllib.parse import urlsplit

from pdserve.errors import DiscoveryError
from pdserve.protocol import WorkerLoad, WorkerRecord

if TYPE_CHECKING:
    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)

_F = TypeVar("_F")

Subscriber = Callable[[str, WorkerRecord | None], None]
"""Called with ``(worker_id, record)`` on a put and ``(worker_id, None)`` on a delete."""

_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")

UNSIGNED_WARN_INTERVAL_S = 60.0
"""At most one warning per worker id per this many seconds about a dropped unsigned record."""

ACCEPTED_FORMS = (
    "'http://HOST:PORT' (the router's embedded registry), 'etcd://HOST:PORT' (etcd, port "
    "defaults to 2379) or 'nats://HOST:PORT' (NATS JetStream, port defaults to 4222)"
)


class InvalidDiscoveryURLError(DiscoveryError, ValueError):
    """A discovery URL that no backend accepts. Also a ``ValueError`` (bad configuration)."""

    code = "invalid_discovery_url"


@dataclass(frozen=True)
class DiscoveryURL:
    """A parsed discovery URL. ``base_url`` is the HTTP base for ``http``/``https``."""

    scheme: Literal["embedded", "http", "https", "etcd", "nats"]
    host: str = ""
    port: int = 0
    base_url: str = ""


def parse_discovery_url(url: str, *, allow_embedded: bool = False) -> DiscoveryURL:
    """Parse ``url``; raise :class:`InvalidDiscoveryURLError` naming it and the accepted forms.

    ``embedded`` (the router's in-process registry) is accepted only when ``allow_embedded``.
    """
    forms = ACCEPTED_FORMS + (", or 'embedded' (in-process)" if allow_embedded else "")

    def bad(why: str) -> InvalidDiscoveryURLError:
        return InvalidDiscoveryURLError(
            f"invalid discovery URL {url!r}: {why}; accepted forms: {forms}", param="discovery"
        )

    if not isinstance(url, str) or not url.strip():
        raise bad("empty")
    url = url.strip()
    if url == "embedded":
        if not allow_embedded:
            raise bad("'embedded' names the router's in-process registry, use the router's URL")
        return DiscoveryURL("embedded")
    if "://" not in url:
        raise bad("missing scheme")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https", "etcd", "nats"):
        raise bad(f"unknown scheme {parts.scheme!r}")
    if "," in parts.netloc:
        raise bad("only one endpoint is supported")
    try:
        port = parts.port
    except ValueError as exc:
        raise bad(f"bad port ({exc})") from None
    host = parts.hostname or ""
    if not host:
        raise bad("missing host")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise bad("credentials, query and fragment are not supported")
    if scheme in ("etcd", "nats"):
        if parts.path not in ("", "/"):
            raise bad(f"{scheme} URLs take no path (got {parts.path!r})")
        default = 2379 if scheme == "etcd" else 4222
        return DiscoveryURL(scheme, host, port or default)  # type: ignore[arg-type]
    default_port = 443 if scheme == "https" else 80
    base = f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    return DiscoveryURL(scheme, host, port or default_port, base)  # type: ignore[arg-type]


def check_ttl(ttl_s: float) -> float:
    """Validate a registration TTL in seconds (finite, > 0); return it as a float."""
    if not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")
    return float(ttl_s)


def check_worker_id(worker_id: str) -> str:
    """Worker ids become URL path segments and etcd keys: 1-128 of ``[A-Za-z0-9._:@-]``."""
    if not _WORKER_ID.fullmatch(worker_id):
        raise ValueError(
            f"worker_id {worker_id!r} must be 1-128 characters of [A-Za-z0-9._:@-], "
            "starting with a letter or digit"
        )
    return worker_id


class Backoff:
    """Exponential backoff with jitter: ``initial_s`` doubling up to ``max_s`` (seconds)."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s = initial_s
        self.max_s = max(initial_s, max_s)
        self._next_s = initial_s
        self.failures = 0

    def next_delay(self) -> float:
        """Record a failure and return how long to wait before the next try."""
        self.failures += 1
        delay = self._next_s
        self._next_s = min(self.max_s, self._next_s * 2)
        return delay * random.uniform(0.8, 1.0)

    def reset(self) -> None:
        self._next_s = self.initial_s
        self.failures = 0


class RegistrationState(enum.StrEnum):
    """Where a :class:`Registration` stands (pollable, e.g. by a worker's ``/ready``)."""

    IDLE = "idle"  # constructed, start() not called yet
    REGISTERED = "registered"  # the last write or refresh reached the registry
    RETRYING = "retrying"  # registry unreachable or record lost; the task keeps retrying
    CLOSED = "closed"  # close() called; nothing more is sent


class SupersededError(DiscoveryError):
    """The registry holds a record of a newer epoch: this worker id restarted elsewhere. Raised
    by a backend's :meth:`Registration._write`; the registration then stops writing."""

    code = "registration_superseded"


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if any) and wait for it to finish; its cancellation is swallowed."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Registration(abc.ABC):
    """Worker side: keeps one :class:`WorkerRecord` registered under a TTL.

    The lifecycle is written once, here (a template method); a backend supplies the primitives:

    - :meth:`_write` ``(refresh_due)``: put the newest record if it changed (``_wake`` is set)
      or nothing is registered yet, and keep the TTL alive when ``refresh_due``; raise on any
      failure (:class:`SupersededError` when a newer epoch holds the record);
    - :meth:`_delete`: remove the record, best effort and bounded (never raises);
    - :meth:`_close_client`: release the connection (never raises);
    - optional hooks: :meth:`_connect` (before the first write), :meth:`_needs_write`,
      :meth:`_wait_backoff`, :meth:`_failure_detail`, and ``_write_refreshes`` (False when a
      put does not renew the TTL, as with an etcd lease).

    ``key`` (the cluster key) signs every record :meth:`start` / :meth:`update` receive, so
    what a backend writes (:attr:`record`) always carries its signature.

    Ownership: the registration owns its background task and its client connection; both end
    in :meth:`close`. Errors: none of the methods raise on registry outages (they log a warning
    and the task retries with backoff); programming errors (``update`` before ``start``, a
    different ``worker_id``) raise ``RuntimeError`` / ``ValueError``.
    """

    _task_prefix = "register"
    _write_refreshes = True  # a put also renews the TTL (HTTP registry, NATS per-message TTL)

    def __init__(self, ttl_s: float, *, key: ClusterKey) -> None:
        self.ttl_s = check_ttl(ttl_s)
        self._key = key
        self.state = RegistrationState.IDLE
        self._record: WorkerRecord | None = None
        self._task: asyncio.Task[None] | None = None  # the refresh / keepalive task
        self._backoff = Backoff(0.1, self.refresh_interval_s)
        self._wake = asyncio.Event()  # set by update(): write the newest record soon
        self._gave_up = False  # superseded: the refresh task stops writing
        self._ever_registered = False  # a later creation is logged as a re-registration
        self.renewals = 0  # successful TTL renewals since start (writes or lease refreshes)

    @property
    def record(self) -> WorkerRecord | None:
        """The record most recently passed to :meth:`start` / :meth:`update`, signed."""
        return self._record

    @property
    def refresh_interval_s(self) -> float:
        """Seconds between refreshes: a third of the TTL, so two may fail before expiry."""
        return self.ttl_s / 3

    @property
    def _worker_id(self) -> str:
        return self._record.worker_id if self._record else "?"

    @property
    @abc.abstractmethod
    def _where(self) -> str:
        """The registry, for log lines (``"etcd 127.0.0.1:2379"``)."""

    # -- lifecycle (template) ----------------------------------------------------------------

    async def start(self, record: WorkerRecord) -> None:
        """Register ``record`` and start the refresh task. Tries once inline (bounded by the
        backend's request timeout, at most 5 s); if the registry is unreachable it logs a
        warning, leaves state RETRYING and the task keeps trying. Raises ``RuntimeError`` if
        already started, ``ValueError`` for a worker_id that is not URL/key safe."""
        self._accept(record, starting=True)
        self.state = RegistrationState.RETRYING
        if await self._connect(record):
            await self._attempt(refresh_due=False)
        name = f"{self._task_prefix}-{record.worker_id}"
        self._task = asyncio.create_task(self._refresh_loop(), name=name)

    async def update(self, record: WorkerRecord) -> None:
        """Replace the record (same ``worker_id``), e.g. on load changes. Cheap and
        non-blocking: the refresh task writes the newest record soon (coalescing bursts)."""
        self._accept(record, starting=False)
        if self._needs_write(record):
            self._wake.set()

    async def close(self) -> None:
        """Stop refreshing and remove the record from the registry (best effort, bounded by a
        short timeout). Idempotent."""
        if self.state is RegistrationState.CLOSED:
            return
        was_started = self.state is not RegistrationState.IDLE
        self.state = RegistrationState.CLOSED
        await self._cancel_task()
        if was_started:
            await self._delete()
        await self._close_client()

    async def abandon(self) -> None:
        """Stop refreshing *without* deregistering, as if the process had died: the record
        lapses after its TTL. For crash tests and exit paths that must not wait on the
        registry. Idempotent; ``close()`` afterwards is a no-op."""
        if self.state is RegistrationState.CLOSED:
            return
        self.state = RegistrationState.CLOSED
        await self._cancel_task()
        await self._close_client()

    # -- backend primitives ------------------------------------------------------------------

    @abc.abstractmethod
    async def _write(self, refresh_due: bool) -> None:
        """Put the newest record when it changed or is not registered, renew the TTL when
        ``refresh_due``. Raises on failure (any exception: the caller retries)."""

    @abc.abstractmethod
    async def _delete(self) -> None:
        """Remove the record (only if this registration wrote it); bounded; never raises."""

    @abc.abstractmethod
    async def _close_client(self) -> None:
        """Release the client connection; bounded; never raises."""

    async def _connect(self, record: WorkerRecord) -> bool:
        """Before the first write: return whether the inline attempt should be made."""
        return True

    def _needs_write(self, record: WorkerRecord) -> bool:
        """Whether ``update(record)`` should wake the task for a write before the refresh."""
        return True

    async def _wait_backoff(self) -> None:
        """After a failed attempt: wait before the next one (updates do not shorten it)."""
        await asyncio.sleep(self._backoff.next_delay())

    def _failure_detail(self, exc: Exception) -> str:
        """Extra text for the failure warning (e.g. the start of an HTTP error body)."""
        return ""

    # -- shared machinery --------------------------------------------------------------------

    def _accept(self, record: WorkerRecord, *, starting: bool) -> None:
        if starting:
            if self.state is not RegistrationState.IDLE:
                raise RuntimeError(f"registration already started (state {self.state})")
            check_worker_id(record.worker_id)
        else:
            if self._record is None or self.state is RegistrationState.IDLE:
                raise RuntimeError("update() before start()")
            if record.worker_id != self._record.worker_id:
                raise ValueError(
                    f"update() for worker {record.worker_id!r} on the registration of "
                    f"{self._record.worker_id!r}"
                )
        self._record = self._key.sign_record(record)

    def _log_created(self, record: WorkerRecord, detail: str) -> None:
        """Log a (re-)registration of ``record`` at ``detail`` (where, TTL)."""
        logger.info(
            "%s worker %s (epoch %d) %s",
            "re-registered" if self._ever_registered else "registered",
            record.worker_id,
            record.epoch,
            detail,
        )

    async def _attempt(self, refresh_due: bool) -> bool:
        """One :meth:`_write`; update state and backoff; never raise."""
        try:
            await self._write(refresh_due)
        except SupersededError as exc:
            logger.error("%s; this incarnation stops registering", exc.message)
            self._gave_up = True
            self.state = RegistrationState.RETRYING
            return False
        except Exception as exc:  # registry down, timeout, bad reply: retry, never crash
            self._note_failure(self._where, exc, self._failure_detail(exc))
            return False
        self._ever_registered = True
        self._note_success(self._where)
        return True

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        ok = self.state is RegistrationState.REGISTERED  # outcome of start()'s inline attempt
        next_refresh = loop.time() + self.refresh_interval_s
        while not self._gave_up:
            if ok:  # refresh on schedule; write sooner after update()
                timeout = max(0.0, next_refresh - loop.time())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            else:
                await self._wait_backoff()
            refresh_due = not ok or loop.time() >= next_refresh
            ok = await self._attempt(refresh_due)
            if ok and (refresh_due or self._write_refreshes):
                next_refresh = loop.time() + self.refresh_interval_s
                self.renewals += 1

    def _note_failure(self, where: str, exc: Exception, detail: str = "") -> None:
        """A write or refresh failed: state RETRYING (unless closed); a warning on the first
        failure in a row and every tenth after it, so an outage does not flood the log."""
        if self.state is not RegistrationState.CLOSED:
            self.state = RegistrationState.RETRYING
        failures = self._backoff.failures + 1
        if failures == 1 or failures % 10 == 0:
            logger.warning(
                "%s: keeping worker %s registered failed (%d in a row): %r %s",
                where,
                self._worker_id,
                failures,
                exc,
                detail,
            )

    def _note_success(self, where: str) -> None:
        """A write or refresh reached the registry: reset the backoff, state REGISTERED."""
        if self._backoff.failures:
            logger.info("%s reachable again", where)
        self._backoff.reset()
        if self.state is not RegistrationState.CLOSED:
            self.state = RegistrationState.REGISTERED

    async def _cancel_task(self) -> None:
        task, self._task = self._task, None
        await cancel_task(task)


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
