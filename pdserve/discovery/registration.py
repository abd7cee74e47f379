"""Worker side of discovery: :class:`Registration` holds the worker's :class:`WorkerRecord` under
a TTL (an etcd lease, a NATS per-key TTL, or the embedded registry's expiry) and refreshes it
every ``ttl_s / 3`` from a background task until :meth:`Registration.close`. Its lifecycle is a
pollable :class:`RegistrationState`::

    IDLE --start()--> REGISTERED <--(refresh fails / lease lost)--> RETRYING
      \\--------------------------------close()------------------------> CLOSED

Every record it holds is signed with the cluster key
(:meth:`pdserve.security.ClusterKey.sign_record`), so write access to etcd or NATS is not
enough to register a worker. Async-safety: one event loop, not thread-safe.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
from typing import TYPE_CHECKING

from pdserve.discovery.retry import Backoff, cancel_task
from pdserve.discovery.url import check_ttl, check_worker_id
from pdserve.errors import DiscoveryError
from pdserve.protocol import WorkerRecord

if TYPE_CHECKING:
    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)


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
