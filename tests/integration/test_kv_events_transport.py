"""KV cache events over every control plane on a real server (the embedded registry over HTTP,
etcd, NATS): a worker's publisher, through its real registration, keeps the router's KV index
(fed by the real watcher) equal to the worker's prefix index; a lost event is healed (the
router asks for a snapshot on the embedded registry and NATS; etcd heals with the periodic
snapshot); a deregistered worker leaves the index."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdserve.discovery.kvcache import kv_event_sender, kv_snapshot_requests
from pdserve.router.kv_index import KVIndex, follow_kv_events
from pdserve.workers.kv.cache_events import KVEventPublisher, KVEventRecorder
from pdserve.workers.kv.manager import KVCacheManager
from tests.support.discovery_backends import (
    WORKER_ID,
    Backend,
    EmbeddedBackend,
    EtcdBackend,
    NatsBackend,
    make_record,
    open_registration_for,
)
from tests.support.fakes import CLUSTER_KEY, layout
from tests.support.servers import wait_until

TPB = 4
LAYOUT = layout(tokens_per_block=TPB)


@pytest.fixture(params=["embedded", "etcd", "nats"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    b: Backend
    if request.param == "etcd":
        b = EtcdBackend(request.getfixturevalue("etcd_server"))
    elif request.param == "nats":
        b = NatsBackend(request.getfixturevalue("nats_server"))
    else:
        b = EmbeddedBackend()
    await b.open()
    yield b
    await b.aclose()


def compute(cache: KVCacheManager, rid: str, start: int, blocks: int) -> None:
    """A request's full blocks computed, indexed and freed, as the engine does."""
    tokens = list(range(start, start + blocks * TPB))
    cache.allocate(rid, len(tokens))
    cache.register(rid, cache.hasher.hash_tokens(tokens), len(tokens))
    cache.free(rid)


def in_sync(index: KVIndex, cache: KVCacheManager, epoch: int) -> bool:
    held = set(cache.cached_hashes())
    entry = index._entries.get(WORKER_ID)
    return (
        index.synced(WORKER_ID, epoch)
        and entry is not None
        and entry.media.get("device", set()) == held
    )


async def test_kv_events_keep_the_router_index_in_sync(backend: Backend) -> None:
    index = follow_kv_events(backend.watcher)
    assert index is not None, f"the {backend.name} watcher carries no KV events"
    reg = open_registration_for(backend)
    rec = make_record()
    await reg.start(rec)
    send = kv_event_sender(reg)
    assert send is not None
    cache = KVCacheManager(LAYOUT, num_blocks=8)
    recorder = KVEventRecorder()
    cache.add_listener(recorder)
    # etcd cannot be asked for a snapshot: only the periodic one heals a gap there.
    periodic = 1.0 if backend.name == "etcd" else 3600.0
    publisher = KVEventPublisher(
        worker_id=WORKER_ID, epoch=rec.epoch, recorder=recorder,
        cached_hashes=cache.cached_hashes, key=CLUSTER_KEY, send=send, snapshot_s=periodic,
        snapshot_requested=kv_snapshot_requests(reg),
    )  # fmt: skip
    try:
        compute(cache, "a", 0, 5)
        assert await publisher.flush()
        await wait_until(lambda: in_sync(index, cache, rec.epoch), 10, what="the snapshot")

        compute(cache, "b", 1000, 6)  # evicts 3 of a's blocks
        assert await publisher.flush()
        await wait_until(lambda: in_sync(index, cache, rec.epoch), 10, what="the evictions")
        assert len(cache.cached_hashes()) == 8

        publisher._seq += 1  # an event the router never sees
        compute(cache, "c", 2000, 2)
        assert await publisher.flush()
        await wait_until(lambda: not index.synced(WORKER_ID, rec.epoch), 10, what="the gap")

        async def healed() -> bool:
            await publisher.flush()
            return in_sync(index, cache, rec.epoch)

        await wait_until(healed, 15, interval_s=0.1, what="the resync after the gap")
        assert index.stats().outcomes["gap"] == 1
    finally:
        await reg.close()
    await wait_until(lambda: index.stats().workers == 0, 10, what="the deregistered worker gone")
