"""The embedded registry's shared store: one SQLite file the router replicas of a host share, so
that a worker that registers with (or posts KV cache events to) any replica is seen by all.

``pdserve up --routers N`` runs N router processes on one port (SO_REUSEPORT); each accepts a
share of the public and the registry connections. A worker's ``PUT /registry/workers/{id}`` or
``POST /registry/kvcache/{id}`` therefore lands on one replica. Each replica's
:class:`~pdserve.discovery.registry.EmbeddedRegistry` writes it here and tails what the others
wrote (:meth:`RegistryStore.changes_after`), so every replica builds the same view and KV index
from the same signed records and events, and none holds state a request needs that the others
lack. Design origin: the brief's "SQLite embedded by default" for state shared between processes;
a log table tailed by sequence number is the outbox pattern (as in Litestream or Postgres'
logical decoding, on a far smaller scale).

Tables::

    records          worker_id PK, epoch, body (WorkerRecord JSON), expires_at
    changes          seq (AUTOINCREMENT), kind ('put' | 'delete' | 'kv'), worker_id, body,
                     expires_at, origin (the writing replica), at (when written)
    snapshot_wanted  worker_id PK: some replica's KV index wants a snapshot of that worker;
                     the replica that takes the worker's next event asks for it in its ack
    meta             key PK, value: 'boot_id' (the host's boot this file's deadlines belong
                     to), 'trimmed' (the highest seq trimmed away)

Deadlines (``expires_at``) are ``time.monotonic()`` readings: on Linux CLOCK_MONOTONIC is one
clock for every process of a host, and a SQLite file in WAL mode belongs to one host (it needs
shared memory). A file written during another boot (``/proc/sys/kernel/random/boot_id``) is
emptied when opened, since its deadlines mean nothing now.

Costs: one small write transaction per registration refresh (~1/s per worker) and per KV event
batch, no fsync (WAL with ``synchronous=NORMAL``: the records are soft state that workers
re-send within a TTL); one indexed read per replica every ``sync_interval_s``. ``changes`` keeps
:data:`KEEP_CHANGES_S` seconds; a replica that fell further behind (paused longer) reloads the
records whole and lets its KV index heal through snapshots.

Errors: :class:`StaleEpochError` when a PUT's epoch is older than the live record's;
``sqlite3.Error`` for a store that cannot be opened or written (a full disk, a folder that does
not exist), raised to the caller. Thread-safety: every method runs on the store's one thread
(:meth:`call` hands them to it), so one connection serves the process.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

KEEP_CHANGES_S = 60.0
"""Seconds the change log keeps an entry; replicas normally read it within ``sync_interval_s``."""
LAPSED_KEEP_S = 60.0
"""Lapsed records stay this long past their deadline before the trim deletes them."""
MAX_CHANGES_PER_READ = 2000
"""Most change rows one :meth:`RegistryStore.changes_after` returns."""
BUSY_TIMEOUT_MS = 5000
"""How long a write waits for another replica's write transaction before ``sqlite3.Error``."""

_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    worker_id TEXT PRIMARY KEY, epoch INTEGER NOT NULL, body TEXT NOT NULL,
    expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, worker_id TEXT NOT NULL,
    body TEXT, expires_at REAL, origin TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS snapshot_wanted (worker_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class StaleEpochError(ValueError):
    """A PUT carried an epoch older than the live record's (a stale incarnation)."""

    def __init__(self, worker_id: str, epoch: int, live: int) -> None:
        super().__init__(
            f"worker {worker_id!r}: epoch {epoch} is older than the registered epoch {live}"
        )
        self.live = live


@dataclass(frozen=True)
class Change:
    """One row of the change log: ``kind`` 'put' (``body`` a WorkerRecord's JSON,
    ``expires_at`` its monotonic deadline), 'delete' or 'kv' (``body`` a KVCacheEvent's JSON),
    written by replica ``origin``."""

    seq: int
    kind: str
    worker_id: str
    body: str | None
    expires_at: float | None
    origin: str


@dataclass(frozen=True)
class Loaded:
    """The live records (``(body, expires_at)`` pairs) and the log position they reflect."""

    seq: int
    records: list[tuple[str, float]]


def boot_id() -> str:
    """This boot's id (Linux), or '' where the kernel has none to read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class RegistryStore:
    """The SQLite file at ``path`` (created with its tables when missing), shared by the
    replicas of one host. ``origin`` names this replica in the change log (default: a fresh
    id per instance). Open with :meth:`open`, close with :meth:`close`; ``clock`` is the
    monotonic clock (seconds), replaceable in tests."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        origin: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.origin = origin or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._clock = clock
        self._db: sqlite3.Connection | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="registry-store")
        self._shut = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` (one of this store's methods, bound) on the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def open(self) -> None:
        """Connect, set WAL mode and create the tables; empty a file of another boot. Raises
        ``sqlite3.Error`` (e.g. the folder does not exist)."""
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE key = 'boot_id'").fetchone()
            boot = boot_id()
            if row is None or row[0] != boot:
                db.execute("DELETE FROM records")
                db.execute("DELETE FROM snapshot_wanted")
                high = db.execute("SELECT coalesce(max(seq), 0) FROM changes").fetchone()[0]
                db.execute("DELETE FROM changes")
                db.execute("INSERT OR REPLACE INTO meta VALUES ('boot_id', ?)", (boot,))
                db.execute("INSERT OR REPLACE INTO meta VALUES ('trimmed', ?)", (str(high),))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            db.close()
            raise
        self._db = db

    def close(self) -> None:
        """Close the connection (idempotent); the file stays for the other replicas."""
        db, self._db = self._db, None
        if db is not None:
            db.close()

    def shutdown(self) -> None:
        """:meth:`close` and stop the store's thread; idempotent."""
        if self._shut:
            return
        self._shut = True
        self._thread.submit(self.close).result()
        self._thread.shutdown(wait=True)

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"registry store {self.path} is not open")
        return self._db

    def _write(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    def _log(
        self,
        db: sqlite3.Connection,
        kind: str,
        worker_id: str,
        body: str | None = None,
        expires_at: float | None = None,
    ) -> int:
        """Append a change; its seq."""
        cursor = db.execute(
            "INSERT INTO changes (kind, worker_id, body, expires_at, origin, at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (kind, worker_id, body, expires_at, self.origin, self._clock()),
        )
        return int(cursor.lastrowid or 0)

    # -- records -----------------------------------------------------------------------------

    def put(self, worker_id: str, epoch: int, body: str, expires_at: float) -> tuple[bool, int]:
        """Upsert a record (already verified by the caller) until ``expires_at``; return
        whether no live record existed, and the change's seq. Raises
        :class:`StaleEpochError` (nothing written) when a live record has a higher epoch."""

        def write(db: sqlite3.Connection) -> tuple[bool, int]:
            row = db.execute(
                "SELECT epoch, expires_at FROM records WHERE worker_id = ?", (worker_id,)
            ).fetchone()
            live = row is not None and row[1] > self._clock()
            if live and epoch < row[0]:
                raise StaleEpochError(worker_id, epoch, row[0])
            db.execute(
                "INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?)",
                (worker_id, epoch, body, expires_at),
            )
            return not live, self._log(db, "put", worker_id, body, expires_at)

        return self._write(write)

    def remove(self, worker_id: str) -> tuple[bool, int]:
        """Delete a record; return whether a live one was removed, and the change's seq."""

        def write(db: sqlite3.Connection) -> tuple[bool, int]:
            row = db.execute(
                "DELETE FROM records WHERE worker_id = ? RETURNING expires_at", (worker_id,)
            ).fetchone()
            seq = self._log(db, "delete", worker_id)
            return row is not None and row[0] > self._clock(), seq

        return self._write(write)

    def load(self) -> Loaded:
        """The live records and the last change seq, read in one transaction."""
        db = self.db
        db.execute("BEGIN")
        try:
            seq = db.execute("SELECT coalesce(max(seq), 0) FROM changes").fetchone()[0]
            trimmed = int(db.execute("SELECT value FROM meta WHERE key = 'trimmed'").fetchone()[0])
            rows = db.execute(
                "SELECT body, expires_at FROM records WHERE expires_at > ?", (self._clock(),)
            ).fetchall()
        finally:
            db.execute("COMMIT")
        return Loaded(max(seq, trimmed), [(b, e) for b, e in rows])

    # -- KV cache events ---------------------------------------------------------------------

    def add_kv_event(self, worker_id: str, body: str) -> bool:
        """Log a KV cache event (already checked for shape; the indexes check its signature);
        return whether some replica wants a snapshot of ``worker_id`` (the want is taken)."""

        def write(db: sqlite3.Connection) -> bool:
            self._log(db, "kv", worker_id, body)
            taken = db.execute(
                "DELETE FROM snapshot_wanted WHERE worker_id = ? RETURNING worker_id", (worker_id,)
            ).fetchone()
            return taken is not None

        return self._write(write)

    def want_snapshot(self, worker_id: str) -> None:
        """Record that this replica wants a snapshot of ``worker_id``'s KV cache."""
        self._write(
            lambda db: db.execute("INSERT OR IGNORE INTO snapshot_wanted VALUES (?)", (worker_id,))
        )

    # -- the log -----------------------------------------------------------------------------

    def changes_after(self, seq: int) -> list[Change] | None:
        """The changes after ``seq`` in order (at most :data:`MAX_CHANGES_PER_READ`), or None
        when some of them were trimmed away (the caller reloads: :meth:`load`)."""
        db = self.db
        db.execute("BEGIN")
        try:
            trimmed = int(db.execute("SELECT value FROM meta WHERE key = 'trimmed'").fetchone()[0])
            if trimmed > seq:
                return None
            rows = db.execute(
                "SELECT seq, kind, worker_id, body, expires_at, origin FROM changes "
                "WHERE seq > ? ORDER BY seq LIMIT ?",
                (seq, MAX_CHANGES_PER_READ),
            ).fetchall()
        finally:
            db.execute("COMMIT")
        return [Change(*row) for row in rows]

    def trim(self, keep_s: float = KEEP_CHANGES_S) -> int:
        """Delete change rows older than ``keep_s`` seconds and records lapsed for more than
        :data:`LAPSED_KEEP_S`; return how many change rows went."""
        now = self._clock()

        def write(db: sqlite3.Connection) -> int:
            high = db.execute(
                "SELECT max(seq) FROM changes WHERE at < ?", (now - keep_s,)
            ).fetchone()[0]
            db.execute("DELETE FROM records WHERE expires_at < ?", (now - LAPSED_KEEP_S,))
            if high is None:
                return 0
            gone = db.execute("DELETE FROM changes WHERE seq <= ?", (high,)).rowcount
            db.execute(
                "UPDATE meta SET value = ? WHERE key = 'trimmed' AND CAST(value AS INTEGER) < ?",
                (str(high), high),
            )
            return int(gone)

        return self._write(write)
