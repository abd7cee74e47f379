"""KV cache events: which prefix-cache block hashes a worker stored and removed (Dynamo's KV
events), on the wire and between the discovery backends and the router's index.

Design origin: Dynamo's KV router. Each worker's KV cache manager indexes full blocks under a
chained hash (:class:`pdserve.workers.kv.prefix_cache.BlockHasher`); the worker publishes every
change of that index as a :class:`KVCacheEvent`, and the router keeps, per worker, the set of
hashes it holds (:class:`pdserve.router.kv_index.KVIndex`) to route a prompt to the worker that
already holds its prefix.

One message, :class:`KVCacheEvent`: ``worker_id``, ``epoch`` (the incarnation), ``seq`` (+1 per
event of this publisher and epoch, from 0), ``reset`` (clear the worker's sets, every medium,
before applying: the first part of a snapshot), ``medium`` (where the blocks of this event are:
``device``, the KV pool; ``host``, ``disk`` or ``remote``, the KV cache connector's tiers, which
cost a load instead of nothing), ``stored`` and ``removed`` (hashes as 32 hex digits, disjoint,
at most :data:`MAX_HASHES_PER_EVENT` together, so a message stays under ~150 KB). A consumer
applies the events of one (worker, epoch) in ``seq`` order; a missing ``seq`` (a lost or
skipped message) leaves the worker *unsynced* (nothing counted) until its next ``reset``. A
snapshot is one ``reset`` event followed by ordinary ``stored`` events with the next ``seq``s.

Transports, one per control plane (each named in the backend that carries it):

- embedded registry: ``POST /registry/kvcache/{worker_id}`` (internal: the cluster token) on
  the router; the reply, :class:`KVEventAck`, asks for a snapshot when the router is unsynced
  (it joined late, restarted, or saw a gap);
- NATS: core subject ``pdserve.kvcache.<key>`` (at most once); a router that needs a snapshot
  publishes an empty message on ``pdserve.kvsync.<key>``, which the worker answers with one;
- etcd: the key ``/pdserve/kvcache/<worker_id>`` under the worker's lease, put once per event;
  the router's watch on ``/pdserve/`` sees every put in order (a reconnect shows a gap, healed
  by the worker's periodic snapshot).

Every worker also sends a snapshot periodically (``discovery.kv_events_snapshot_s``), so any
loss heals within that time whatever the transport.

Signed like worker records: ``signature`` is 64 hex characters,
``ClusterKey.proof("kvcache event", signing_bytes()).hex()`` (the canonical JSON of every other
field, ``worker_id``, ``epoch`` and ``seq`` included), set by the worker's publisher
(:meth:`pdserve.security.ClusterKey.sign_event`) and checked where events enter the router, the
same on every transport (:meth:`pdserve.router.kv_index.KVIndex.apply`, with
:meth:`~pdserve.security.ClusterKey.event_signed`): an unsigned or badly signed event is dropped
and counted (outcome ``unsigned``), so write access to NATS or etcd is not enough to skew
routing. The label is this kind's own, so a signature of another kind of event (or of a record)
never verifies as a KV cache event's. A signed event can still be replayed by whoever saw it:
the index drops one not newer than what it holds (``seq``, ``epoch``), and one that reaches a
router which restarted since is undone by the worker's next event (a gap) or snapshot.

Version history: 1: stored / removed hex hashes, reset snapshots. 2: ``signature`` (HMAC with
the cluster key); a version-1 event is refused. 3: ``medium`` (tier-aware events: the host,
disk and remote tiers are reported too); an older event is refused.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.discovery.records import UNSIGNED_WARN_INTERVAL_S
from pdserve.security import KVCACHE_EVENT_LABEL

KVCACHE_EVENTS_VERSION: Literal[3] = 3
Medium = Literal["device", "host", "disk", "remote"]
MEDIA: tuple[Medium, ...] = ("device", "host", "disk", "remote")
"""Where a worker holds a block: its KV pool, or a tier of its KV cache connector (fastest
first)."""
KVCACHE_SUBJECT = "pdserve.kvcache"
"""NATS subject prefix of the events: ``pdserve.kvcache.<escaped worker id>``."""
KVSYNC_SUBJECT = "pdserve.kvsync"
"""NATS subject prefix of snapshot requests: ``pdserve.kvsync.<escaped worker id>``."""
ETCD_KVCACHE_PREFIX = "/pdserve/kvcache/"
"""etcd key prefix of the events: ``/pdserve/kvcache/<worker id>`` (under the worker's lease)."""
MAX_HASHES_PER_EVENT = 4096
"""Most hashes (stored + removed) in one event: ~140 KB of JSON."""

_HASH_HEX = 32  # 128-bit block hashes


class KVCacheEvent(BaseModel):
    """One batch of prefix-cache index changes of one worker incarnation (see the module
    docstring). Raises ``ValidationError`` for a malformed hash, overlapping or oversized
    lists. ``signature``: see the module docstring (empty: unsigned, which the router
    drops)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    SIGNING_LABEL: ClassVar[str] = KVCACHE_EVENT_LABEL

    version: Literal[3] = KVCACHE_EVENTS_VERSION
    worker_id: str = Field(min_length=1, max_length=128)
    epoch: int
    seq: int = Field(ge=0, description="+1 per event of this publisher and epoch")
    sent_at: float = Field(description="wall-clock UNIX seconds at publish")
    reset: bool = Field(default=False, description="clear every set first (snapshot start)")
    medium: Medium = Field(default="device", description="where the blocks are (MEDIA)")
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    signature: str = Field(default="", max_length=128, description="hex HMAC of the event")

    @model_validator(mode="after")
    def _check_hashes(self) -> KVCacheEvent:
        if len(self.stored) + len(self.removed) > MAX_HASHES_PER_EVENT:
            raise ValueError(f"more than {MAX_HASHES_PER_EVENT} hashes in one event")
        for h in (*self.stored, *self.removed):
            if len(h) != _HASH_HEX:
                raise ValueError(f"a block hash is {_HASH_HEX} hex digits, got {h!r}")
        return self

    def signing_bytes(self) -> bytes:
        """The canonical bytes the signature covers: every field but ``signature`` as compact
        JSON with sorted keys (as :meth:`pdserve.protocol.WorkerRecord.signing_bytes`)."""
        return canonical_json(self, exclude={"signature"})

    def stored_hashes(self) -> list[int]:
        """``stored`` as ints. Raises ValueError for a non-hex item."""
        return decode_hashes(self.stored)

    def removed_hashes(self) -> list[int]:
        """``removed`` as ints. Raises ValueError for a non-hex item."""
        return decode_hashes(self.removed)


class KVEventAck(BaseModel):
    """Reply of the embedded registry to a posted event: ``snapshot`` asks the worker to send
    a snapshot next (the router has no usable view of it)."""

    model_config = ConfigDict(frozen=True)

    snapshot: bool = False


KVEventHandler = Callable[[KVCacheEvent], bool]
"""Router side: applies one event and returns whether a snapshot of that worker is wanted.
Called on the event loop; must not block."""

KVEventSend = Callable[[KVCacheEvent], Awaitable[KVEventAck | None]]
"""Worker side: sends one event over the registration's control plane; returns the ack (None:
not delivered, e.g. the control plane is unreachable). Never raises."""


def canonical_json(model: BaseModel, *, exclude: set[str]) -> bytes:
    """``model`` without the ``exclude`` fields as compact JSON with sorted keys: stable
    across a JSON round trip (floats print as the shortest text that reads back the same), so
    a signature made before sending verifies after receiving."""
    data = model.model_dump(mode="json", exclude=exclude)
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


class UnsignedWarnings:
    """Router side: the warning about a dropped unsigned (or badly signed) event, at most once
    per worker id per ``interval_s`` seconds (as :meth:`pdserve.discovery.records.RecordTable.
    accepts` does for records; the ids come from whoever can publish, so the table is
    bounded). ``clock``: monotonic seconds (tests pass a fake)."""

    MAX_IDS = 1024

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = UNSIGNED_WARN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._warned_at: dict[str, float] = {}  # worker id -> clock() of the warning

    def dropped(self, kind: str, worker_id: str, signature: str) -> None:
        """Log that an event of ``kind`` claiming ``worker_id`` was dropped, unless one was
        logged for that id less than ``interval_s`` ago."""
        now = self._clock()
        last = self._warned_at.get(worker_id)
        if last is not None and now - last < self.interval_s:
            return
        if len(self._warned_at) >= self.MAX_IDS:
            self._warned_at.clear()
        self._warned_at[worker_id] = now
        self._logger.warning(
            "dropping %s of worker %r: its signature is %s; it was not published by a process "
            "holding this cluster's secret (further ones from this id are not logged for %.0f s)",
            kind,
            worker_id,
            "wrong" if signature else "missing",
            self.interval_s,
        )


def encode_hash(h: int) -> str:
    """A 128-bit block hash as 32 lowercase hex digits."""
    return f"{h:032x}"


def decode_hashes(items: Iterable[str]) -> list[int]:
    """Hex hashes back to ints. Raises ValueError for a non-hex item."""
    return [int(h, 16) for h in items]


def kv_snapshot_requests(registration: object) -> Callable[[], bool] | None:
    """The registration's ``take_kv_snapshot_request`` (NATS: whether a router asked for a
    snapshot on ``pdserve.kvsync.<key>`` since the last call), or None (the other transports
    answer in their acks)."""
    take = getattr(registration, "take_kv_snapshot_request", None)
    return take if callable(take) else None


def kv_event_sender(registration: object) -> KVEventSend | None:
    """The registration's ``send_kv_event`` (HTTP, NATS and etcd registrations have one), or
    None for a registration that carries no KV events (a test fake). Duck-typed so that this
    module imports no backend."""
    send = getattr(registration, "send_kv_event", None)
    return send if callable(send) else None
