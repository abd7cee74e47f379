"""KV cache events, worker side (workers/kv/cache_events.py): what the publisher sends makes the
router's index equal the worker's prefix index, across evictions, lost sends, overflow,
snapshot requests and large snapshots; and the embedded registry's event route."""

from __future__ import annotations

import httpx
import pytest

from pdserve.block_hash import BlockHasher
from pdserve.discovery import EmbeddedRegistry
from pdserve.discovery.kvcache import MAX_HASHES_PER_EVENT, KVCacheEvent, KVEventAck
from pdserve.router.kv_index import KVIndex
from pdserve.workers.kv.cache_events import KVEventPublisher, KVEventRecorder
from pdserve.workers.kv.manager import KVCacheManager
from tests.support.fakes import CLUSTER_KEY, INTERNAL_AUTH, layout

TPB = 4
LAYOUT = layout(tokens_per_block=TPB)
HASHER = BlockHasher(LAYOUT.model, LAYOUT.dtype, TPB)


class Transport:
    """Delivers events to a router-side index; ``drop`` loses the next sends, ``ask`` makes
    the next ack ask for a snapshot."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self.events: list[KVCacheEvent] = []
        self.drop = 0
        self.ask = False

    async def __call__(self, event: KVCacheEvent) -> KVEventAck | None:
        if self.drop:
            self.drop -= 1
            return None
        self.events.append(event)
        wanted = self.index.apply(event)
        ask, self.ask = self.ask, False
        return KVEventAck(snapshot=wanted or ask)


def setup(num_blocks: int = 8, **kw: object) -> tuple[KVCacheManager, KVEventPublisher, Transport]:
    cache = KVCacheManager(LAYOUT, num_blocks)
    recorder = KVEventRecorder(**kw)  # type: ignore[arg-type]
    cache.add_listener(recorder)
    transport = Transport(KVIndex(key=CLUSTER_KEY))
    publisher = KVEventPublisher(
        worker_id="p0",
        epoch=1,
        recorder=recorder,
        cached_hashes=cache.cached_hashes,
        key=CLUSTER_KEY,
        send=transport,
        snapshot_s=3600.0,
    )
    return cache, publisher, transport


def compute(cache: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Run a request's KV through the manager as the engine does: allocate, index, free."""
    hashes = HASHER.hash_tokens(tokens)
    cache.allocate(rid, len(tokens))
    cache.register(rid, hashes, len(tokens))
    cache.free(rid)
    return hashes


def router_view(transport: Transport) -> set[int]:
    entry = transport.index._entries["p0"]
    assert entry.synced
    return set(entry.media.get("device", ()))


async def test_the_router_index_follows_stores_and_evictions() -> None:
    cache, publisher, transport = setup(num_blocks=6)
    assert await publisher.flush()  # the first flush: an empty snapshot
    assert transport.events[0].reset and router_view(transport) == set()
    first = compute(cache, "a", list(range(4 * TPB)))  # 4 blocks cached (evictable)
    await publisher.flush()
    assert router_view(transport) == set(first) == set(cache.cached_hashes())
    second = compute(cache, "b", list(range(1000, 1000 + 4 * TPB)))  # evicts 2 of the first
    await publisher.flush()
    assert router_view(transport) == set(cache.cached_hashes())
    assert len(router_view(transport) & set(first)) == 2 and set(second) <= router_view(transport)
    assert [e.seq for e in transport.events] == list(range(len(transport.events)))


async def test_no_change_sends_nothing() -> None:
    cache, publisher, transport = setup()
    await publisher.flush()
    await publisher.flush()
    assert len(transport.events) == 1


async def test_a_lost_send_is_healed_by_a_snapshot_on_the_next_flush() -> None:
    cache, publisher, transport = setup()
    await publisher.flush()
    compute(cache, "a", list(range(2 * TPB)))
    transport.drop = 1
    assert not await publisher.flush()
    compute(cache, "b", list(range(500, 500 + 2 * TPB)))
    assert await publisher.flush()
    assert transport.events[-2].reset, "the flush after a failure starts with a snapshot"
    assert router_view(transport) == set(cache.cached_hashes()) and len(cache.cached_hashes()) == 4


async def test_a_router_that_lost_events_gets_a_snapshot() -> None:
    """A gap the publisher cannot see (the transport delivered out of band): the router asks
    for a snapshot in its ack and is synced again after the next flush."""
    cache, publisher, transport = setup()
    await publisher.flush()
    compute(cache, "a", list(range(2 * TPB)))
    await publisher.flush()
    publisher._seq += 1  # a message the router never saw
    compute(cache, "b", list(range(500, 500 + 2 * TPB)))
    await publisher.flush()
    assert not transport.index.synced("p0", 1)
    await publisher.flush()
    assert router_view(transport) == set(cache.cached_hashes())


async def test_a_snapshot_requested_in_an_ack_is_sent() -> None:
    cache, publisher, transport = setup()
    await publisher.flush()
    compute(cache, "a", list(range(2 * TPB)))
    transport.ask = True
    await publisher.flush()
    before = publisher.snapshots
    await publisher.flush()
    assert publisher.snapshots == before + 1 and transport.events[-1].reset


async def test_recorder_overflow_falls_back_to_a_snapshot() -> None:
    cache, publisher, transport = setup(num_blocks=8, max_pending=3)
    await publisher.flush()
    compute(cache, "a", list(range(6 * TPB)))  # 6 new hashes > 3 pending
    await publisher.flush()
    assert transport.events[-1].reset
    assert router_view(transport) == set(cache.cached_hashes()) and len(router_view(transport)) == 6


async def test_a_large_snapshot_is_split_into_bounded_events() -> None:
    blocks = MAX_HASHES_PER_EVENT + 10
    cache, publisher, transport = setup(num_blocks=blocks + 1)
    compute(cache, "a", list(range(blocks * TPB)))
    await publisher.flush()
    assert [e.reset for e in transport.events] == [True, False]
    assert all(len(e.stored) + len(e.removed) <= MAX_HASHES_PER_EVENT for e in transport.events)
    assert (
        router_view(transport) == set(cache.cached_hashes())
        and len(router_view(transport)) == blocks
    )


async def test_the_periodic_snapshot_comes_when_due() -> None:
    now = [0.0]
    cache = KVCacheManager(LAYOUT, 8)
    recorder = KVEventRecorder()
    cache.add_listener(recorder)
    transport = Transport(KVIndex(key=CLUSTER_KEY))
    publisher = KVEventPublisher(
        worker_id="p0", epoch=1, recorder=recorder, cached_hashes=cache.cached_hashes,
        key=CLUSTER_KEY, send=transport, snapshot_s=10.0, clock=lambda: now[0],
    )  # fmt: skip
    await publisher.flush()
    now[0] = 9.0
    await publisher.flush()
    assert publisher.snapshots == 1
    now[0] = 10.5
    await publisher.flush()
    assert publisher.snapshots == 2 and transport.events[-1].reset


# -- the embedded registry's route ------------------------------------------------------------


@pytest.fixture
async def registry_client() -> httpx.AsyncClient:
    import fastapi

    registry = EmbeddedRegistry(ttl_s=10.0, key=CLUSTER_KEY)
    index = KVIndex(key=CLUSTER_KEY)
    registry.subscribe_kv_events(index.apply)
    app = fastapi.FastAPI()
    from pdserve.http.error_responses import install_error_handlers

    install_error_handlers(app)
    app.include_router(registry.api_router())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    client.index = index  # type: ignore[attr-defined]
    return client


def body(seq: int, reset: bool = False, worker_id: str = "p0") -> str:
    event = KVCacheEvent(worker_id=worker_id, epoch=1, seq=seq, sent_at=0.0, reset=reset,
                         stored=("0" * 32,))  # fmt: skip
    return CLUSTER_KEY.sign_event(event).model_dump_json()


async def test_the_registry_route_needs_the_cluster_token(
    registry_client: httpx.AsyncClient,
) -> None:
    resp = await registry_client.post(
        "/registry/kvcache/p0",
        content=body(0, reset=True),
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 401
    assert registry_client.index.stats().workers == 0  # type: ignore[attr-defined]


async def test_the_registry_route_feeds_the_index_and_asks_for_a_snapshot(
    registry_client: httpx.AsyncClient,
) -> None:
    headers = {**INTERNAL_AUTH, "content-type": "application/json"}

    async def post(path: str, content: str) -> httpx.Response:
        return await registry_client.post(path, content=content, headers=headers)

    resp = await post("/registry/kvcache/p0", body(3))
    assert resp.status_code == 200 and resp.json() == {"snapshot": True}  # joined late
    resp = await post("/registry/kvcache/p0", body(4, reset=True))
    assert resp.json() == {"snapshot": False}
    assert registry_client.index.synced("p0", 1)  # type: ignore[attr-defined]
    resp = await post("/registry/kvcache/p1", body(5))
    assert resp.status_code == 400  # path and event name different workers


# -- lifecycle ---------------------------------------------------------------------------------


class SendingRegistration:
    """A registration whose transport records what it is sent."""

    def __init__(self) -> None:
        self.events: list[KVCacheEvent] = []

    async def send_kv_event(self, event: KVCacheEvent) -> KVEventAck | None:
        self.events.append(event)
        return KVEventAck()


@pytest.mark.parametrize(
    ("kv_events", "prefix_caching", "registration", "publishes"),
    [
        (True, True, SendingRegistration(), True),
        (False, True, SendingRegistration(), False),  # --no-kv-events
        (True, False, SendingRegistration(), False),  # --no-prefix-caching
        (True, True, object(), False),  # a registration without KV events
    ],
)
async def test_open_kv_events_publishes_only_when_everything_is_on(
    kv_events: bool, prefix_caching: bool, registration: object, publishes: bool
) -> None:
    from contextlib import AsyncExitStack

    from pdserve.config.settings import DiscoverySettings
    from pdserve.workers.kv.cache_events import open_kv_events
    from tests.support.servers import wait_until

    cache = KVCacheManager(LAYOUT, 8, prefix_caching=prefix_caching)
    settings = DiscoverySettings(kv_events=kv_events, kv_events_interval_s=0.01)
    async with AsyncExitStack() as stack:
        publisher = await open_kv_events(
            kv_cache=cache, registration=registration, worker_id="p0", epoch=1,
            key=CLUSTER_KEY, settings=settings, stack=stack,
        )  # fmt: skip
        assert (publisher is not None) is publishes
        if publisher is None:
            return
        compute(cache, "a", list(range(2 * TPB)))
        sent = registration.events  # type: ignore[attr-defined]
        await wait_until(lambda: sum(len(e.stored) for e in sent) >= 2, 5, what="2 stored")
        assert sent[0].reset
    count = len(sent)
    compute(cache, "b", list(range(100, 100 + 2 * TPB)))  # after close: nothing recorded
    assert publisher.recorder.drain() == ({}, False) and len(sent) == count


async def test_the_tiers_blocks_reach_the_router_under_their_medium(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A host tier that evicts and a disk tier that writes and cleans up are reported as they
    change and in snapshots, one medium per event; the router's view equals each tier's."""
    import torch

    from pdserve.workers.kv.tiers import DiskTier, HostTier

    block = torch.zeros(LAYOUT.num_layers, 2, TPB, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                        dtype=torch.float32)  # fmt: skip
    size = block.numel() * block.element_size()
    host = HostTier(2 * size)  # room for two blocks
    disk = DiskTier(tmp_path, 64 * size, LAYOUT)
    cache, publisher, transport = setup()
    for tier in (host, disk):
        tier.listeners.add(publisher.recorder)
    publisher._tier_hashes = lambda: {"host": host.hashes(), "disk": disk.hashes()}
    try:
        assert await publisher.flush()  # the first snapshot: nothing anywhere
        for h in (11, 12, 13):
            host.put(h, block.clone())  # 13 evicts 11
        for h in (21, 22):
            disk.save(h, block.clone())
        assert disk.flush(5.0)
        await publisher.flush()
        entry = transport.index._entries["p0"]

        def view() -> dict[str, set[int]]:
            return {m: held for m, held in entry.media.items() if held}

        assert view() == {"host": {12, 13}, "disk": {21, 22}}
        assert {e.medium for e in transport.events[1:]} == {"host", "disk"}
        disk._cleanup(63 * size)  # the cap makes room: both files go
        await publisher.flush()
        assert view() == {"host": {12, 13}}
        disk.save(23, block.clone())
        assert disk.flush(5.0)
        publisher.request_snapshot()  # a snapshot rebuilds every medium from the tiers
        sent = len(transport.events)
        await publisher.flush()
        snapshot = transport.events[sent:]
        assert snapshot[0].reset and not any(e.reset for e in snapshot[1:])
        assert [e.medium for e in snapshot] == ["host", "disk"]
        assert view() == {"host": {12, 13}, "disk": {23}}
    finally:
        disk.close()
