"""Two router replicas' embedded registries sharing one SQLite store (issue 42, item 2): a worker
that registers with, deregisters from or posts KV events to one replica is seen by the other;
the epoch check spans replicas; a snapshot one replica's index wants is asked for by whichever
replica takes the worker's next event; a replica that fell behind the trimmed log reloads; a
store file from another boot is emptied. Real SQLite files, two registries in one process."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pdserve.discovery import EmbeddedRegistry
from pdserve.discovery.kvcache import KVCacheEvent
from pdserve.discovery.registry_store import RegistryStore
from pdserve.protocol import Role, WorkerRecord
from pdserve.router.kv_index import KVIndex
from tests.support.fakes import CLUSTER_KEY, record

Pair = tuple[EmbeddedRegistry, EmbeddedRegistry]


def make_record(worker_id: str = "decode-0", epoch: int = 1) -> WorkerRecord:
    return record(worker_id, Role.DECODE, "http://127.0.0.1:9", epoch=epoch)


def kv_event(seq: int, *, reset: bool = False, worker_id: str = "decode-0") -> KVCacheEvent:
    event = KVCacheEvent(worker_id=worker_id, epoch=1, seq=seq, sent_at=0.0, reset=reset,
                         stored=(f"{seq:032x}",))  # fmt: skip
    return CLUSTER_KEY.sign_event(event)


def replica(path: Path) -> EmbeddedRegistry:
    # a long sync interval: the tests call sync() themselves, so nothing races them
    return EmbeddedRegistry(ttl_s=30.0, key=CLUSTER_KEY, store=RegistryStore(path),
                            sync_interval_s=3600)  # fmt: skip


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    a, b = replica(tmp_path / "registry.sqlite"), replica(tmp_path / "registry.sqlite")
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_a_registration_with_one_replica_reaches_the_other(pair: Pair) -> None:
    a, b = pair
    seen: list[tuple[str, int | None]] = []
    b.subscribe(lambda wid, rec: seen.append((wid, rec.epoch if rec else None)))
    assert await a.register(make_record()) is True
    assert "decode-0" in a.workers() and "decode-0" not in b.workers()  # b has not read yet
    assert await b.sync() == 1
    assert b.workers()["decode-0"] == a.workers()["decode-0"]
    assert await b.register(make_record()) is False  # a refresh through b: not new
    await a.sync()
    assert await a.deregister("decode-0") is True
    await b.sync()
    assert b.workers() == {} and seen == [("decode-0", 1), ("decode-0", 1), ("decode-0", None)]


async def test_the_epoch_check_spans_replicas(pair: Pair) -> None:
    a, b = pair
    await a.register(make_record(epoch=2))
    with pytest.raises(ValueError, match="epoch 1 is older than the registered epoch 2"):
        await b.register(make_record(epoch=1))  # b has not synced: the store refuses it
    await b.sync()
    assert b.workers()["decode-0"].epoch == 2


async def test_an_earlier_change_read_later_does_not_undo_a_replicas_own_write(
    pair: Pair,
) -> None:
    """The old incarnation deregisters through b; the new one registers through a before a
    has read b's delete: a keeps the new record (the log's order decides), and so does b."""
    a, b = pair
    await b.register(make_record(epoch=1))
    await a.sync()
    await b.deregister("decode-0")
    await a.register(make_record(epoch=2))
    assert await a.sync() == 2  # b's delete, then its own put
    assert a.workers()["decode-0"].epoch == 2
    await b.sync()
    assert b.workers()["decode-0"].epoch == 2


async def test_an_unsigned_record_never_reaches_the_store(pair: Pair, tmp_path: Path) -> None:
    a, _ = pair
    forged = make_record().model_copy(update={"signature": "0" * 64})
    with pytest.raises(Exception, match="not signed with the cluster key"):
        await a.register(forged)
    with sqlite3.connect(tmp_path / "registry.sqlite") as db:
        assert db.execute("SELECT count(*) FROM records").fetchone()[0] == 0


async def test_kv_events_reach_every_replica_and_wants_travel(pair: Pair) -> None:
    a, b = pair
    index_a, index_b = KVIndex(key=CLUSTER_KEY), KVIndex(key=CLUSTER_KEY)
    a.subscribe_kv_events(index_a.apply)
    b.subscribe_kv_events(index_b.apply)
    # both replicas start with no view of the worker: a asks at once, b through the store
    assert (await a.post_kv_event(kv_event(0, reset=True))).snapshot is False
    assert index_a.synced("decode-0", 1)
    await b.sync()
    assert index_b.synced("decode-0", 1)
    assert (await a.post_kv_event(kv_event(1))).snapshot is False
    await b.sync()
    assert index_b.stats().blocks == index_a.stats().blocks == 2
    # b's index starts over (say b restarted): the next event it reads leaves it unsynced...
    b2_index = KVIndex(key=CLUSTER_KEY)
    b.subscribe_kv_events(b2_index.apply)
    assert (await a.post_kv_event(kv_event(2))).snapshot is False  # a has no want of its own
    await b.sync()
    assert not b2_index.synced("decode-0", 1)
    # ...and the worker's next event, posted to a, comes back with a's ack asking for a snapshot
    assert (await a.post_kv_event(kv_event(3))).snapshot is True
    assert (await a.post_kv_event(kv_event(4))).snapshot is False  # the want was taken
    await a.post_kv_event(kv_event(5, reset=True))
    await b.sync()
    assert b2_index.synced("decode-0", 1)


async def test_a_replica_behind_the_trimmed_log_reloads(tmp_path: Path) -> None:
    now = [100.0]
    path = tmp_path / "registry.sqlite"
    a = EmbeddedRegistry(ttl_s=30.0, key=CLUSTER_KEY, sync_interval_s=3600,
                         store=RegistryStore(path, clock=lambda: now[0]))  # fmt: skip
    b = replica(path)
    await a.start()
    await b.start()
    try:
        await a.register(make_record("decode-0"))
        await a.register(make_record("decode-1"))
        await a.deregister("decode-0")
        now[0] += 120  # the rows are older than the log keeps them
        assert a.store is not None
        assert await a.store.call(a.store.trim) == 3
        assert await b.sync() == 0  # behind the trim: reloaded from the records table
        assert sorted(b.workers()) == ["decode-1"]
    finally:
        await a.close()
        await b.close()


async def test_a_store_from_another_boot_is_emptied(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    a = replica(path)
    await a.start()
    await a.register(make_record())
    await a.close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = 'an-earlier-boot' WHERE key = 'boot_id'")
    b = replica(path)
    await b.start()
    try:
        assert b.workers() == {}  # its deadline belonged to another boot's clock
    finally:
        await b.close()


async def test_a_store_that_cannot_be_opened_fails_the_start(tmp_path: Path) -> None:
    registry = replica(tmp_path / "missing" / "registry.sqlite")
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        await registry.start()
    await registry.close()
