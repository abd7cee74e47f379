"""KV cache, load and KV block events are signed with the cluster key like worker records
(issue 26): publishers sign, and the router drops and counts an unsigned event, one signed
with another cluster key, one changed after signing, or one signed as another kind, whatever
the control plane (the KV index for KV cache events, the NATS event consumer for load and KV
block events)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pdserve.discovery import EmbeddedRegistry, EmbeddedWatcher
from pdserve.discovery.kvcache import KVCacheEvent, UnsignedWarnings, encode_hash
from pdserve.discovery.load_events import (
    EventConsumer,
    EventPublisher,
    KVBlockEvent,
    LoadEvent,
)
from pdserve.protocol import WorkerLoad
from pdserve.router.kv_index import OUTCOMES, KVIndex, follow_kv_events
from pdserve.security import (
    KV_BLOCK_EVENT_LABEL,
    KVCACHE_EVENT_LABEL,
    LOAD_EVENT_LABEL,
    RECORD_LABEL,
    ClusterKey,
)
from tests.support.fakes import CLUSTER_KEY, INTERNAL_AUTH

OTHER_KEY = ClusterKey(b"another-deployment-secret-0123456789abcdef")
HASHES = tuple(encode_hash(h) for h in (11, 22, 33))


def kvcache(seq: int = 0, *, reset: bool = True, worker_id: str = "p0") -> KVCacheEvent:
    return KVCacheEvent(
        worker_id=worker_id, epoch=7, seq=seq, sent_at=1.5, reset=reset, stored=HASHES
    )


def load_event(**kw: Any) -> LoadEvent:
    fields: dict[str, Any] = dict(
        worker_id="p0", epoch=7, seq=0, sent_at=1.5, load=WorkerLoad(running=2)
    )
    return LoadEvent(**{**fields, **kw})


def kv_block_event(**kw: Any) -> KVBlockEvent:
    fields: dict[str, Any] = dict(
        worker_id="p0", epoch=7, seq=0, sent_at=1.5, parked_requests=1, parked_blocks=4,
        released_total=2, expired_total=0, free_blocks=10, total_blocks=20,
    )  # fmt: skip
    return KVBlockEvent(**{**fields, **kw})


def forgeries(signed: Any) -> dict[str, Any]:
    """Ways an event fails verification: unsigned, another deployment's key, fields changed
    after signing, a signature that is not hex, and a signature of the same bytes made under
    another label (another kind of event, a worker record)."""
    data = signed.signing_bytes()
    out = {
        "unsigned": signed.model_copy(update={"signature": ""}),
        "other key": OTHER_KEY.sign_event(signed.model_copy(update={"signature": ""})),
        "worker_id changed": signed.model_copy(update={"worker_id": "p9"}),
        "epoch changed": signed.model_copy(update={"epoch": signed.epoch + 1}),
        "seq changed": signed.model_copy(update={"seq": signed.seq + 5}),
        "sent_at changed": signed.model_copy(update={"sent_at": 99.0}),
        "not hex": signed.model_copy(update={"signature": "zz" * 32}),
    }
    for label in (KVCACHE_EVENT_LABEL, LOAD_EVENT_LABEL, KV_BLOCK_EVENT_LABEL, RECORD_LABEL):
        if label != type(signed).SIGNING_LABEL:
            proof = CLUSTER_KEY.proof(label, data).hex()
            out[f"signed as {label}"] = signed.model_copy(update={"signature": proof})
    return out


# -- signatures --------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [kvcache, load_event, kv_block_event])
def test_a_signature_survives_the_wire_and_covers_every_field(make: Any) -> None:
    event = make()
    assert event.signature == "" and not CLUSTER_KEY.event_signed(event)
    signed = CLUSTER_KEY.sign_event(event)
    assert len(signed.signature) == 64 and CLUSTER_KEY.event_signed(signed)
    assert type(signed).model_validate_json(signed.model_dump_json()) == signed
    assert CLUSTER_KEY.event_signed(type(signed).model_validate_json(signed.model_dump_json()))
    for why, forged in forgeries(signed).items():
        assert not CLUSTER_KEY.event_signed(forged), why


def test_the_three_kinds_have_distinct_labels() -> None:
    labels = {KVCacheEvent.SIGNING_LABEL, LoadEvent.SIGNING_LABEL, KVBlockEvent.SIGNING_LABEL}
    assert len(labels) == 3 and RECORD_LABEL not in labels


def test_changed_hashes_break_the_signature() -> None:
    signed = CLUSTER_KEY.sign_event(kvcache())
    for change in ({"stored": HASHES[:2]}, {"removed": HASHES[2:]}, {"reset": False}):
        assert not CLUSTER_KEY.event_signed(signed.model_copy(update=change)), change


# -- the KV index (every control plane's KV cache events enter the router there) -------------


def test_the_index_applies_a_signed_event() -> None:
    index = KVIndex(key=CLUSTER_KEY)
    assert index.apply(CLUSTER_KEY.sign_event(kvcache())) is False
    assert index.synced("p0", 7) and index.overlap("p0", 7, [11, 22, 33]) == 3
    outcomes = index.stats().outcomes
    assert outcomes["applied"] == 1 and outcomes["unsigned"] == 0 and "unsigned" in OUTCOMES


@pytest.mark.parametrize("why", list(forgeries(CLUSTER_KEY.sign_event(kvcache()))))
def test_the_index_drops_and_counts_an_event_that_does_not_verify(why: str) -> None:
    index = KVIndex(key=CLUSTER_KEY)
    forged = forgeries(CLUSTER_KEY.sign_event(kvcache()))[why]
    assert index.apply(forged) is False  # and no snapshot is asked of whoever sent it
    stats = index.stats()
    assert stats.outcomes["unsigned"] == 1 and stats.workers == 0
    assert sum(stats.outcomes.values()) == 1


def test_a_forged_event_leaves_a_synced_worker_as_it_was() -> None:
    index = KVIndex(key=CLUSTER_KEY)
    index.apply(CLUSTER_KEY.sign_event(kvcache(0)))
    index.apply(kvcache(1, reset=True, worker_id="p0").model_copy(update={"stored": ()}))
    index.apply(OTHER_KEY.sign_event(KVCacheEvent(worker_id="p0", epoch=8, seq=0, sent_at=2.0)))
    assert index.synced("p0", 7) and index.overlap("p0", 7, [11, 22, 33]) == 3
    assert index.stats().outcomes["unsigned"] == 2
    assert index.apply(CLUSTER_KEY.sign_event(kvcache(1, reset=False))) is False  # seq 1 next
    assert index.stats().outcomes["applied"] == 2


def test_unsigned_events_are_logged_once_per_worker_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = KVIndex(key=CLUSTER_KEY)
    with caplog.at_level(logging.WARNING, logger="pdserve.router.kv_index"):
        for seq in range(5):
            index.apply(kvcache(seq))
        index.apply(kvcache(0, worker_id="p1"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "'p0'" in warnings[0] and "missing" in warnings[0] and "'p1'" in warnings[1]
    assert index.stats().outcomes["unsigned"] == 6


def test_the_warning_comes_again_after_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    warnings = UnsignedWarnings(logging.getLogger("test.unsigned"), 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.unsigned"):
        warnings.dropped("KV cache events", "p0", "")
        now[0] = 59.0
        warnings.dropped("KV cache events", "p0", "ab")
        now[0] = 60.0
        warnings.dropped("KV cache events", "p0", "ab")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "missing" in messages[0] and "wrong" in messages[1]


# -- the embedded registry's route and follow_kv_events -----------------------------------------


async def test_the_registry_route_passes_the_signature_and_the_index_checks_it() -> None:
    import fastapi

    from pdserve.http.error_responses import install_error_handlers

    registry = EmbeddedRegistry(ttl_s=10.0, key=CLUSTER_KEY)
    index = follow_kv_events(EmbeddedWatcher(registry, manage_sweep=False))
    assert index is not None
    app = fastapi.FastAPI()
    install_error_handlers(app)
    app.include_router(registry.api_router())
    headers = {**INTERNAL_AUTH, "content-type": "application/json"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        for forged in (kvcache(), OTHER_KEY.sign_event(kvcache())):
            resp = await client.post("/registry/kvcache/p0", content=forged.model_dump_json(),
                                     headers=headers)  # fmt: skip
            assert resp.status_code == 200 and resp.json() == {"snapshot": False}
        assert index.stats().outcomes["unsigned"] == 2 and index.stats().workers == 0
        signed = CLUSTER_KEY.sign_event(kvcache())
        resp = await client.post("/registry/kvcache/p0", content=signed.model_dump_json(),
                                 headers=headers)  # fmt: skip
        assert resp.status_code == 200 and index.synced("p0", 7)


@dataclass
class KeyedWatcher:
    """A watcher with KV events and a ``key`` (as the etcd and NATS watchers have)."""

    key: object = None

    def subscribe_kv_events(self, handler: object) -> None:
        self.handler = handler


def test_follow_kv_events_checks_with_the_watchers_key_or_the_one_given() -> None:
    index = follow_kv_events(KeyedWatcher(CLUSTER_KEY))
    assert index is not None and index._key is CLUSTER_KEY
    index = follow_kv_events(KeyedWatcher(), key=OTHER_KEY)
    assert index is not None and index._key is OTHER_KEY
    assert follow_kv_events(KeyedWatcher()) is None  # no key: no unverifiable routing


# -- load and KV block events on NATS ----------------------------------------------------------


@dataclass
class Msg:
    subject: str
    data: bytes


class Consumer:
    def __init__(self) -> None:
        self.loads: list[LoadEvent] = []
        self.kvs: list[KVBlockEvent] = []
        self.events = EventConsumer(self.loads.append, self.kvs.append, key=CLUSTER_KEY)

    async def send(self, event: LoadEvent | KVBlockEvent) -> None:
        msg = Msg(f"pdserve.x.{event.worker_id}", event.model_dump_json().encode())
        if isinstance(event, LoadEvent):
            await self.events._handle_load(msg)  # type: ignore[arg-type]
        else:
            await self.events._handle_kv(msg)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [load_event, kv_block_event])
async def test_the_nats_consumer_hands_on_only_signed_events(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = Consumer()
    signed = CLUSTER_KEY.sign_event(make())
    await consumer.send(signed)
    got = consumer.loads if isinstance(signed, LoadEvent) else consumer.kvs
    assert got == [signed] and consumer.events.received == 1
    forged = forgeries(signed)
    with caplog.at_level(logging.WARNING, logger="pdserve.discovery.load_events"):
        for event in forged.values():
            await consumer.send(event)
    assert got == [signed]
    assert consumer.events.unsigned == len(forged) and consumer.events.received == 1
    warned = {r.getMessage().split("'")[1] for r in caplog.records if r.levelno >= logging.WARNING}
    assert warned == {"p0", "p9"}  # once per claimed worker id, not once per event


class FakeClient:
    is_connected = True

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.sent.append((subject, data))


@dataclass
class Parked:
    expired_total: int = 0
    released_total: int = 1
    num_blocks: int = 4

    def __len__(self) -> int:
        return 1


async def test_the_nats_publisher_signs_load_and_kv_block_events() -> None:
    client = FakeClient()
    nats_client: Any = client
    publisher = EventPublisher(nats_client, worker_id="p0", epoch=7, key=CLUSTER_KEY)
    for _ in range(2):
        assert await publisher.publish(WorkerLoad(running=1), Parked())
    consumer = Consumer()
    for subject, data in client.sent:
        kind = LoadEvent if subject.startswith("pdserve.load.") else KVBlockEvent
        event = kind.model_validate_json(data)
        assert CLUSTER_KEY.event_signed(event) and not OTHER_KEY.event_signed(event)
        await consumer.send(event)
    assert [e.seq for e in consumer.loads] == [0, 1] and [e.seq for e in consumer.kvs] == [0, 1]
