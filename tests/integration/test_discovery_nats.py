"""NATS-only discovery behaviour against a real nats-server (JetStream): identity vs load
writes, compare-and-set against a newer epoch, the load / KV block events the router consumes,
and the resync grace after an outage. The behaviour every backend shares is in
``test_discovery_contract.py``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import nats
import pytest

from pdserve.discovery import RegistrationState, open_registration, open_watcher
from pdserve.discovery.load_events import KVBlockEvent, LoadEvent, event_publisher
from pdserve.discovery.nats import NatsRegistration
from pdserve.discovery.nats_watcher import NatsWatcher
from pdserve.protocol import Role, WorkerLoad, WorkerRecord
from tests.support.discovery_backends import WORKER_ID, make_record, nats_stored_record
from tests.support.fakes import CLUSTER_KEY
from tests.support.servers import NatsServer, free_port, wait_until

TTL_S = 2.0
SLACK_S = 2.0


class Parked:
    """Counters shaped like ParkedBlocks (the ParkedCounts protocol)."""

    def __init__(self, requests: int, blocks: int, released: int, expired: int) -> None:
        self._requests, self.num_blocks = requests, blocks
        self.released_total, self.expired_total = released, expired

    def __len__(self) -> int:
        return self._requests


@pytest.fixture
async def watcher(nats_server: NatsServer) -> AsyncIterator[NatsWatcher]:
    w = open_watcher(nats_server.url, key=CLUSTER_KEY)
    assert isinstance(w, NatsWatcher)
    await w.start()
    assert w.connected
    yield w
    await w.close()


def record_events(watcher: NatsWatcher) -> list[WorkerRecord | None]:
    seen: list[WorkerRecord | None] = []
    watcher.subscribe(lambda wid, rec: seen.append(rec))
    return seen


async def test_endpoint_changes_are_written_at_once_and_load_rides_the_refresh(
    nats_server: NatsServer, watcher: NatsWatcher
) -> None:
    reg = open_registration(nats_server.url, ttl_s=TTL_S, key=CLUSTER_KEY)
    assert isinstance(reg, NatsRegistration)
    await reg.start(make_record())
    try:
        await wait_until(lambda: WORKER_ID in watcher.workers(), 2.0, what="watch event")
        await reg.update(make_record(url="http://127.0.0.1:10"))
        await wait_until(lambda: watcher.workers()[WORKER_ID].http_url.endswith(":10"), 2.0)
        await reg.update(make_record(running=3, url="http://127.0.0.1:10"))
        await wait_until(
            lambda: watcher.workers()[WORKER_ID].load.running == 3, reg.refresh_interval_s + 1.0
        )
    finally:
        await reg.close()


async def test_superseded_incarnation_stops_writing_and_its_close_spares_the_successor(
    nats_server: NatsServer, watcher: NatsWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    old = open_registration(nats_server.url, ttl_s=TTL_S, key=CLUSTER_KEY)
    await old.start(make_record(epoch=1))
    await wait_until(lambda: WORKER_ID in watcher.workers(), 2.0)
    new = open_registration(nats_server.url, ttl_s=TTL_S, key=CLUSTER_KEY)
    await new.start(make_record(epoch=2))
    try:
        await wait_until(lambda: watcher.workers()[WORKER_ID].epoch == 2, 2.0)
        seen = record_events(watcher)
        # The old incarnation, still running, finds a newer epoch at its next refresh and
        # stops writing instead of putting its record back.
        await wait_until(lambda: any("epoch 2 holds" in r.message for r in caplog.records), TTL_S)
        assert old.state is RegistrationState.RETRYING
        target = new.renewals + 4  # more than a TTL of the successor's refreshes
        await wait_until(lambda: new.renewals >= target, 4 * new.refresh_interval_s + 3.0)
        assert watcher.workers()[WORKER_ID].epoch == 2
        assert all(rec is not None and rec.epoch == 2 for rec in seen)
        stored = await nats_stored_record(nats_server, WORKER_ID)
        assert stored is not None and stored.epoch == 2
    finally:
        await old.close()  # its DEL marker must not remove the successor's record
        # A later write of the successor reaches the watcher after any DEL would have.
        await new.update(make_record(epoch=2, url="http://127.0.0.1:11"))
        await wait_until(lambda: watcher.workers()[WORKER_ID].http_url.endswith(":11"), 2.0)
        assert watcher.workers()[WORKER_ID].epoch == 2
        await new.close()


async def test_load_and_kv_events_reach_the_watcher_between_refreshes(
    nats_server: NatsServer, watcher: NatsWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    reg = open_registration(
        nats_server.url, ttl_s=30.0, key=CLUSTER_KEY
    )  # no refresh during the test
    await reg.start(make_record("prefill-0", role=Role.PREFILL))
    try:
        await wait_until(lambda: "prefill-0" in watcher.workers(), 2.0)
        publisher = event_publisher(reg)
        assert publisher is not None
        load = WorkerLoad(running=2, waiting=5, parked=1, free_blocks=90, total_blocks=100)
        assert await publisher.publish(load, Parked(1, 4, released=7, expired=0))
        await wait_until(lambda: watcher.workers()["prefill-0"].load == load, 2.0, what="load")
        await wait_until(lambda: "prefill-0" in watcher.kv_events(), 2.0, what="kv event")
        kv = watcher.kv_events()["prefill-0"]
        assert (kv.parked_requests, kv.parked_blocks, kv.released_total) == (1, 4, 7)
        assert (kv.free_blocks, kv.total_blocks, kv.epoch) == (90, 100, 1)
        # Rising expiry counters are reported by the router.
        caplog.set_level(logging.WARNING, logger="pdserve.discovery")
        assert await publisher.publish(load, Parked(0, 0, released=7, expired=3))
        await wait_until(lambda: watcher.kv_events()["prefill-0"].expired_total == 3, 2.0)
        assert any("3 parked requests expired" in r.message for r in caplog.records)
        # Events of another incarnation, events not signed with the cluster key, and messages
        # that do not parse, change nothing.
        seen = record_events(watcher)
        nc = await nats.connect(nats_server.url)
        stale = CLUSTER_KEY.sign_event(LoadEvent(
            worker_id="prefill-0", epoch=0, seq=99, sent_at=time.time(), load=WorkerLoad(running=9)
        ))  # fmt: skip
        await nc.publish("pdserve.load.prefill-0", stale.model_dump_json().encode())
        forged = LoadEvent(
            worker_id="prefill-0", epoch=1, seq=99, sent_at=time.time(), load=WorkerLoad(running=8)
        )
        await nc.publish("pdserve.load.prefill-0", forged.model_dump_json().encode())
        await nc.publish("pdserve.load.prefill-0", b'{"version": 2, "worker_id": "prefill-0"}')
        await nc.publish("pdserve.kv.prefill-0", b"not json")
        # One connection's messages arrive in order: a valid event published after them proves
        # the watcher has handled them.
        later = CLUSTER_KEY.sign_event(LoadEvent(
            worker_id="prefill-0", epoch=1, seq=100, sent_at=time.time(), load=WorkerLoad(running=4)
        ))  # fmt: skip
        await nc.publish("pdserve.load.prefill-0", later.model_dump_json().encode())
        await nc.flush()
        await nc.close()
        await wait_until(lambda: watcher.workers()["prefill-0"].load.running == 4, 2.0)
        assert [rec.load.running for rec in seen if rec is not None] == [4]
        assert watcher._events.unsigned == 1  # the forged one
        assert isinstance(watcher.kv_events()["prefill-0"], KVBlockEvent)
        assert watcher.kv_events()["prefill-0"].expired_total == 3
    finally:
        await reg.close()


async def test_expiry_after_an_outage_waits_for_the_grace_then_removes_the_dead(
    nats_server: NatsServer,
) -> None:
    watcher = NatsWatcher("127.0.0.1", nats_server.port, key=CLUSTER_KEY, resync_grace_s=1.0)
    await watcher.start()
    reg = open_registration(nats_server.url, ttl_s=1.0, key=CLUSTER_KEY)
    await reg.start(make_record())
    try:
        await wait_until(lambda: WORKER_ID in watcher.workers(), 2.0)
        await reg.abandon()  # the worker dies during the outage
        nats_server.stop()
        # The outage's length is what is tested: longer than the record's 1 s TTL.
        await asyncio.sleep(1.5)
        nats_server.start()
        await wait_until(lambda: watcher.connected, 5.0, what="re-list")
        assert WORKER_ID in watcher.workers()  # not yet: it might still come back
        await wait_until(lambda: WORKER_ID not in watcher.workers(), 1.0 + SLACK_S)
    finally:
        await watcher.close()


async def test_event_publisher_sends_nothing_while_nats_is_unreachable() -> None:
    reg = open_registration(f"nats://127.0.0.1:{free_port()}", ttl_s=TTL_S, key=CLUSTER_KEY)
    await reg.start(make_record())
    assert reg.state is RegistrationState.RETRYING
    publisher = event_publisher(reg)
    assert publisher is not None and not await publisher.publish(WorkerLoad())
    await reg.close()
    assert reg.state is RegistrationState.CLOSED
