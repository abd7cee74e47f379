"""Worker events on core NATS subjects: load and KV block counters, published ~1/s.

With ``--discovery nats://HOST:PORT`` a worker's record lives in the JetStream key-value bucket
(:mod:`pdserve.discovery.nats`), written every ``ttl_s / 3``. Load changes every step, and a
JetStream write is a persisted stream message, so load does not go there: each worker publishes
two fire-and-forget messages per second on core NATS subjects instead, and the router's
:class:`~pdserve.discovery.nats_watcher.NatsWatcher` overlays them on the records it serves to the
pairing policy (fresher load between record refreshes, no disk writes).

Subjects (``<key>`` is the worker id escaped by :func:`subject_token`, see there)::

    pdserve.load.<key>   LoadEvent      the engine's WorkerLoad (running, waiting, parked, blocks)
    pdserve.kv.<key>     KVBlockEvent   parked-block lease counters of a prefill worker

    pdserve.kvcache.<key> KVCacheEvent  prefix-cache block hashes stored / removed
                                        (:mod:`pdserve.discovery.kvcache`, its own version)
    pdserve.kvsync.<key>  (empty)       router -> worker: send a KV cache snapshot

The first two carry ``version`` (:data:`EVENTS_VERSION`), ``worker_id``, ``epoch``, a per-publisher
``seq``, ``sent_at`` (wall-clock UNIX seconds: a monotonic clock does not cross processes) and
``signature``. Delivery is at most once (core NATS), so KV events carry *cumulative* counters,
never deltas: a lost message costs freshness, never correctness. A consumer drops messages
whose version it does not know (one warning per subject) and keeps the newest per worker.

Signed like worker records: ``signature`` is 64 hex characters,
``ClusterKey.proof(label, signing_bytes()).hex()`` with the kind's own label (``"load event"``,
``"kv block event"``: one kind's signature never verifies as another's) over the canonical JSON
of every other field (``worker_id``, ``epoch``, ``seq`` included). :class:`EventPublisher` signs
(:meth:`pdserve.security.ClusterKey.sign_event`); :class:`EventConsumer` drops an unsigned or
badly signed event before its handlers see it (counted in ``unsigned``, a warning at most once
per worker id per minute), so write access to NATS is not enough to skew the pairing policy.

Version history: 1: load + KV lease counters. 2: ``signature`` (HMAC with the cluster key); a
version-1 event is refused.

Async-safety: one event loop; not thread-safe. Nothing here raises on a NATS outage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.discovery.kvcache import (
    KVCACHE_SUBJECT,
    KVSYNC_SUBJECT,
    KVCacheEvent,
    UnsignedWarnings,
    canonical_json,
)
from pdserve.protocol import WorkerLoad
from pdserve.security import KV_BLOCK_EVENT_LABEL, LOAD_EVENT_LABEL

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from pdserve.discovery.registration import Registration
    from pdserve.security import ClusterKey

logger = logging.getLogger(__name__)

EVENTS_VERSION: Literal[2] = 2
LOAD_SUBJECT = "pdserve.load"
KV_SUBJECT = "pdserve.kv"

_M = TypeVar("_M", bound=BaseModel)
_ESCAPED = {".": "=2E", ":": "=3A", "@": "=40"}


def subject_token(worker_id: str) -> str:
    """``worker_id`` as one NATS subject token / KV key: ``.``, ``:`` and ``@`` become ``=2E``,
    ``=3A``, ``=40`` (worker ids never contain ``=``, so this is reversible)."""
    for char, code in _ESCAPED.items():
        worker_id = worker_id.replace(char, code)
    return worker_id


def worker_id_of(token: str) -> str:
    """Inverse of :func:`subject_token`."""
    for char, code in _ESCAPED.items():
        token = token.replace(code, char)
    return token


class _Event(BaseModel):
    """Fields every event carries. Unknown extra fields are ignored (additive changes keep the
    version); a changed meaning bumps :data:`EVENTS_VERSION`. ``signature``: see the module
    docstring (empty: unsigned, which the consumer drops)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: Literal[2] = EVENTS_VERSION
    worker_id: str
    epoch: int
    seq: int = Field(ge=0, description="per-publisher counter, +1 per message of this kind")
    sent_at: float = Field(description="wall-clock UNIX seconds at publish")
    signature: str = Field(default="", max_length=128, description="hex HMAC of the event")

    def signing_bytes(self) -> bytes:
        """The canonical bytes the signature covers: every field but ``signature`` as compact
        JSON with sorted keys (as :meth:`pdserve.protocol.WorkerRecord.signing_bytes`)."""
        return canonical_json(self, exclude={"signature"})


class LoadEvent(_Event):
    """``pdserve.load.<key>``: the worker's load, as its record would carry it."""

    SIGNING_LABEL: ClassVar[str] = LOAD_EVENT_LABEL

    load: WorkerLoad


class KVBlockEvent(_Event):
    """``pdserve.kv.<key>``: KV blocks of a worker's pool (counts of blocks and requests).

    ``released_total`` and ``expired_total`` count parked requests since the worker started
    (epoch): released by their decode worker, or freed when their lease ran out unpulled. A rise
    in ``expired_total`` means decode workers are not pulling what prefill parked.
    """

    SIGNING_LABEL: ClassVar[str] = KV_BLOCK_EVENT_LABEL

    parked_requests: int = Field(ge=0)
    parked_blocks: int = Field(ge=0)
    released_total: int = Field(ge=0)
    expired_total: int = Field(ge=0)
    free_blocks: int = Field(ge=0)
    total_blocks: int = Field(ge=0)


class ParkedCounts(Protocol):
    """What :meth:`EventPublisher.publish` reads from a prefill worker's parked-block table
    (``pdserve.workers.roles.parking.ParkedBlocks`` satisfies it)."""

    expired_total: int
    released_total: int

    def __len__(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...


class EventPublisher:
    """Worker side: publishes :class:`LoadEvent` and :class:`KVBlockEvent` for one incarnation,
    each signed with ``key`` (the cluster key, :meth:`~pdserve.security.ClusterKey.sign_event`).
    KV cache events come signed already (by their publisher,
    :class:`pdserve.workers.kv.cache_events.KVEventPublisher`) and go out as they are.

    Ownership: borrows ``client`` (the registration's connection), never closes it. ``publish``
    never raises and sends nothing while the client is disconnected (stale load is worse than
    none: nats-py would buffer it and flush it after the reconnect).
    """

    def __init__(self, client: NatsClient, *, worker_id: str, epoch: int, key: ClusterKey) -> None:
        self._client = client
        self._key = key
        self.worker_id = worker_id
        self.epoch = epoch
        token = subject_token(worker_id)
        self.load_subject = f"{LOAD_SUBJECT}.{token}"
        self.kv_subject = f"{KV_SUBJECT}.{token}"
        self.kvcache_subject = f"{KVCACHE_SUBJECT}.{token}"
        self.kvsync_subject = f"{KVSYNC_SUBJECT}.{token}"
        self._seq = 0
        self.published = 0
        self._sync_sub: Subscription | None = None
        self._sync_requested = False

    async def publish_kvcache(self, event: KVCacheEvent) -> bool:
        """Publish a KV cache event on ``pdserve.kvcache.<key>``; return whether sent. The
        first call also subscribes to this worker's ``pdserve.kvsync.<key>`` (snapshot
        requests, :meth:`take_sync_request`)."""
        if not self._client.is_connected:
            return False
        try:
            if self._sync_sub is None:
                self._sync_sub = await self._client.subscribe(self.kvsync_subject, cb=self._sync)
            await self._client.publish(self.kvcache_subject, event.model_dump_json().encode())
        except Exception as exc:  # connection dropped between the check and the write
            logger.debug("publishing KV cache events of %s failed: %r", self.worker_id, exc)
            return False
        return True

    def take_sync_request(self) -> bool:
        """Whether a router asked for a snapshot since the last call."""
        requested, self._sync_requested = self._sync_requested, False
        return requested

    async def _sync(self, msg: Msg) -> None:
        self._sync_requested = True

    async def publish(self, load: WorkerLoad, parked: ParkedCounts | None = None) -> bool:
        """Publish the load and, with ``parked``, the KV counters; return whether sent."""
        if not self._client.is_connected:
            return False
        head = _Event(
            worker_id=self.worker_id, epoch=self.epoch, seq=self._seq, sent_at=time.time()
        )
        messages: list[tuple[str, _Event]] = [
            (self.load_subject, self._key.sign_event(LoadEvent(**head.model_dump(), load=load)))
        ]
        if parked is not None:
            kv = KVBlockEvent(
                **head.model_dump(),
                parked_requests=len(parked),
                parked_blocks=parked.num_blocks,
                released_total=parked.released_total,
                expired_total=parked.expired_total,
                free_blocks=load.free_blocks,
                total_blocks=load.total_blocks,
            )
            messages.append((self.kv_subject, self._key.sign_event(kv)))
        try:
            for subject, event in messages:
                await self._client.publish(subject, event.model_dump_json().encode())
        except Exception as exc:  # connection dropped between the check and the write
            logger.debug("publishing events of %s failed: %r", self.worker_id, exc)
            return False
        self._seq += 1
        self.published += 1
        return True


class EventConsumer:
    """Router side: subscribes to ``pdserve.load.>`` and ``pdserve.kv.>`` and hands each valid
    event whose signature verifies under ``key`` (the cluster key) to ``on_load`` / ``on_kv``
    (called on the event loop; they must not block). KV cache events (``on_kvcache``) are
    handed on as they parse: their consumer, the router's KV index, checks their signature.

    Counters: ``received`` events handed on, ``dropped`` malformed or unknown-version ones,
    ``unsigned`` ones whose signature is missing or wrong (a rate-limited warning per worker
    id, :class:`~pdserve.discovery.kvcache.UnsignedWarnings`).

    Ownership: borrows ``client``; :meth:`close` unsubscribes. nats-py re-subscribes by itself
    after a reconnect, so :meth:`start` is called once per client.
    """

    def __init__(
        self,
        on_load: Callable[[LoadEvent], None],
        on_kv: Callable[[KVBlockEvent], None],
        on_kvcache: Callable[[KVCacheEvent], None] | None = None,
        *,
        key: ClusterKey,
    ) -> None:
        self._on_load = on_load
        self._on_kv = on_kv
        self._on_kvcache = on_kvcache
        self._key = key
        self._subs: list[Subscription] = []
        self._warned: set[tuple[str, str]] = set()
        self._unsigned_warnings = UnsignedWarnings(logger)
        self.received = 0
        self.dropped = 0
        self.unsigned = 0

    @property
    def started(self) -> bool:
        return bool(self._subs)

    async def start(self, client: NatsClient) -> None:
        if self._subs:
            return
        self._subs.append(await client.subscribe(f"{LOAD_SUBJECT}.>", cb=self._handle_load))
        self._subs.append(await client.subscribe(f"{KV_SUBJECT}.>", cb=self._handle_kv))
        if self._on_kvcache is not None:
            sub = await client.subscribe(f"{KVCACHE_SUBJECT}.>", cb=self._handle_kvcache)
            self._subs.append(sub)

    async def close(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may already be closed
                logger.debug("unsubscribing %s failed: %r", sub.subject, exc)

    async def _handle_load(self, msg: Msg) -> None:
        event = self._decode(msg, LoadEvent)
        if event is not None and self._signed(event, "a load event"):
            self.received += 1
            self._on_load(event)

    async def _handle_kv(self, msg: Msg) -> None:
        event = self._decode(msg, KVBlockEvent)
        if event is not None and self._signed(event, "a KV block event"):
            self.received += 1
            self._on_kv(event)

    def _signed(self, event: LoadEvent | KVBlockEvent, kind: str) -> bool:
        """Whether ``event``'s signature verifies; a refusal is counted and logged (rate
        limited per worker id)."""
        if self._key.event_signed(event):
            return True
        self.unsigned += 1
        self._unsigned_warnings.dropped(kind, event.worker_id, event.signature)
        return False

    async def _handle_kvcache(self, msg: Msg) -> None:
        event = self._decode(msg, KVCacheEvent)
        if event is not None and self._on_kvcache is not None:
            self.received += 1
            self._on_kvcache(event)

    def _decode(self, msg: Msg, kind: type[_M]) -> _M | None:
        try:
            event = kind.model_validate_json(msg.data)
        except ValidationError as exc:
            self.dropped += 1
            key = (msg.subject, kind.__name__)
            if key not in self._warned:  # once per subject, not once a second
                self._warned.add(key)
                logger.warning(
                    "dropping malformed or unknown-version %s on %s: %s",
                    kind.__name__,
                    msg.subject,
                    exc.errors()[0].get("msg"),
                )
            return None
        return event


def event_publisher(registration: Registration | None) -> EventPublisher | None:
    """The registration's event publisher when it is a started NATS registration, else None
    (etcd and the embedded registry have no event bus: load travels in the record).

    Duck-typed on an ``events`` attribute holding an :class:`EventPublisher` (only
    ``NatsRegistration`` has one), so this module does not import the NATS backend.
    """
    events = getattr(registration, "events", None)
    return events if isinstance(events, EventPublisher) else None
