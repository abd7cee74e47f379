"""NATS discovery against a real nats-server (JetStream): TTLs, expiry, restarts, outages,
and the load / KV block events the router consumes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import nats
import nats.js.errors
import pytest

from pdserve.discovery import RegistrationState, open_registration, open_watcher
from pdserve.discovery.events import KVBlockEvent, LoadEvent, event_publisher, subject_token
from pdserve.discovery.nats import BUCKET, NatsRegistration
from pdserve.discovery.nats_watcher import NatsWatcher
from pdserve.protocol import KVLayout, Role, WorkerLoad, WorkerRecord
from tests.fixtures.servers import NatsServer, free_port, wait_until

pytestmark = pytest.mark.integration

TTL_S = 2.0
SLACK_S = 2.0

LAYOUT = KVLayout(
    model="tiny", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32"
)


def make_record(
    worker_id: str = "decode-0", epoch: int = 1, running: int = 0, url: str = "http://127.0.0.1:9"
) -> WorkerRecord:
    return WorkerRecord(
        role=Role.DECODE,
        worker_id=worker_id,
        epoch=epoch,
        model="tiny",
        http_url=url,
        layout=LAYOUT,
        load=WorkerLoad(running=running),
    )


async def stored_record(server: NatsServer, worker_id: str) -> WorkerRecord | None:
    """The record in the bucket, read with a separate client (None when absent or deleted)."""
    nc = await nats.connect(server.url)
    try:
        kv = await nc.jetstream().key_value(BUCKET)
        try:
            entry = await kv.get(subject_token(worker_id))
        except nats.js.errors.KeyNotFoundError:
            return None
        if not entry.value:  # a server-placed expiry marker
            return None
        return WorkerRecord.model_validate_json(entry.value)
    finally:
        await nc.close()


class Parked:
    """Counters shaped like ParkedBlocks (the ParkedCounts protocol)."""

    def __init__(self, requests: int, blocks: int, released: int, expired: int) -> None:
        self._requests, self.num_blocks = requests, blocks
        self.released_total, self.expired_total = released, expired

    def __len__(self) -> int:
        return self._requests


@pytest.fixture
async def watcher(nats_server: NatsServer) -> AsyncIterator[NatsWatcher]:
    w = open_watcher(nats_server.url)
    assert isinstance(w, NatsWatcher)
    await w.start()
    assert w.connected
    yield w
    await w.close()


async def test_registration_is_visible_to_a_watcher(
    nats_server: NatsServer, watcher: NatsWatcher
) -> None:
    worker_id = "decode@host-1:8100.a"  # characters NATS keys cannot hold are escaped
    reg = open_registration(nats_server.url, ttl_s=TTL_S)
    assert isinstance(reg, NatsRegistration)
    await reg.start(make_record(worker_id))
    try:
        assert reg.state is RegistrationState.REGISTERED
        await wait_until(lambda: worker_id in watcher.workers(), 2.0, what="watch event")
        stored = await stored_record(nats_server, worker_id)
        assert stored is not None and stored.epoch == 1
        # A changed endpoint is written at once; a load change rides the next refresh.
        await reg.update(make_record(worker_id, url="http://127.0.0.1:10"))
        await wait_until(lambda: watcher.workers()[worker_id].http_url.endswith(":10"), 2.0)
        await reg.update(make_record(worker_id, running=3, url="http://127.0.0.1:10"))
        await wait_until(
            lambda: watcher.workers()[worker_id].load.running == 3, reg.refresh_interval_s + 1.0
        )
        # The refresh holds the record past its TTL.
        await asyncio.sleep(TTL_S + 1.0)
        assert worker_id in watcher.workers()
    finally:
        await reg.close()


async def test_crashed_worker_lapses_from_the_watcher_within_ttl(
    nats_server: NatsServer, watcher: NatsWatcher
) -> None:
    removed: list[float] = []
    watcher.subscribe(lambda wid, rec: removed.append(time.monotonic()) if rec is None else None)
    reg = open_registration(nats_server.url, ttl_s=TTL_S)
    await reg.start(make_record())
    await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
    crashed = time.monotonic()
    await reg.abandon()  # stop refreshing without deleting, as a killed process would
    await wait_until(lambda: removed, TTL_S + SLACK_S, what="TTL expiry")
    assert removed[0] - crashed <= TTL_S + SLACK_S
    assert watcher.workers() == {}
    assert await stored_record(nats_server, "decode-0") is None


async def test_close_removes_the_record_at_once(
    nats_server: NatsServer, watcher: NatsWatcher
) -> None:
    reg = open_registration(nats_server.url, ttl_s=10.0)
    await reg.start(make_record())
    await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
    await reg.close()
    await wait_until(lambda: watcher.workers() == {}, 2.0, what="DEL marker")  # TTL is 10 s
    assert await stored_record(nats_server, "decode-0") is None
    await reg.close()  # idempotent
    assert reg.state is RegistrationState.CLOSED


async def test_restarted_worker_replaces_its_record_and_the_old_epoch_stops(
    nats_server: NatsServer, watcher: NatsWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    old = open_registration(nats_server.url, ttl_s=TTL_S)
    await old.start(make_record(epoch=1))
    await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
    new = open_registration(nats_server.url, ttl_s=TTL_S)
    await new.start(make_record(epoch=2))
    try:
        await wait_until(lambda: watcher.workers()["decode-0"].epoch == 2, 2.0)
        assert any("restarted: epoch 1 -> 2" in r.message for r in caplog.records)
        # The old incarnation, still running, finds a newer epoch at its next refresh and
        # stops writing instead of putting its record back.
        await wait_until(lambda: any("epoch 2 holds" in r.message for r in caplog.records), TTL_S)
        assert old.state is RegistrationState.RETRYING
        await asyncio.sleep(TTL_S + 0.5)
        assert watcher.workers()["decode-0"].epoch == 2
        stored = await stored_record(nats_server, "decode-0")
        assert stored is not None and stored.epoch == 2
    finally:
        await old.close()  # its DEL marker must not remove the successor's record
        await asyncio.sleep(0.3)
        assert watcher.workers()["decode-0"].epoch == 2
        await new.close()


async def test_load_and_kv_events_reach_the_watcher_between_refreshes(
    nats_server: NatsServer, watcher: NatsWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    reg = open_registration(nats_server.url, ttl_s=30.0)  # no refresh during the test
    await reg.start(make_record("prefill-0"))
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
        # Events of another incarnation, and messages that do not parse, change nothing.
        nc = await nats.connect(nats_server.url)
        stale = LoadEvent(
            worker_id="prefill-0", epoch=0, seq=99, sent_at=time.time(), load=WorkerLoad(running=9)
        )
        await nc.publish("pdserve.load.prefill-0", stale.model_dump_json().encode())
        await nc.publish("pdserve.load.prefill-0", b'{"version": 2, "worker_id": "prefill-0"}')
        await nc.publish("pdserve.kv.prefill-0", b"not json")
        await nc.flush()
        await nc.close()
        await asyncio.sleep(0.3)
        assert watcher.workers()["prefill-0"].load == load
        assert isinstance(watcher.kv_events()["prefill-0"], KVBlockEvent)
    finally:
        await reg.close()


async def test_nats_outage_keeps_the_view_and_registration_returns(
    nats_server: NatsServer, watcher: NatsWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    reg = open_registration(nats_server.url, ttl_s=TTL_S)
    await reg.start(make_record())
    try:
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
        nats_server.stop(kill=True)
        await wait_until(lambda: not watcher.connected, 2.0, what="watcher to notice")
        await wait_until(lambda: reg.state is RegistrationState.RETRYING, TTL_S + 1.0)
        await asyncio.sleep(TTL_S + 1.0)  # down for longer than the TTL: the record expires
        assert "decode-0" in watcher.workers()  # the last view is kept
        nats_server.start()
        await wait_until(lambda: reg.state is RegistrationState.REGISTERED, 5.0, what="re-put")
        await wait_until(lambda: watcher.connected, 5.0, what="watcher to re-list")
        stored = await stored_record(nats_server, "decode-0")
        assert stored is not None and stored.epoch == 1
        await asyncio.sleep(TTL_S + 1.0)  # refreshes work again, and nothing was dropped
        assert "decode-0" in watcher.workers()
        assert not any("removed" in r.message for r in caplog.records)
    finally:
        await reg.close()


async def test_record_removed_behind_its_back_is_put_again(
    nats_server: NatsServer, watcher: NatsWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    """As if the record had expired while the worker was cut off from NATS."""
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    events: list[tuple[str, int | None]] = []
    watcher.subscribe(lambda wid, rec: events.append((wid, rec.epoch if rec else None)))
    reg = open_registration(nats_server.url, ttl_s=TTL_S)
    await reg.start(make_record())
    try:
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
        nc = await nats.connect(nats_server.url)
        await (await nc.jetstream().key_value(BUCKET)).delete("decode-0")
        await nc.close()
        # Gone, then back within one refresh interval (+ slack), logged as a re-registration.
        await wait_until(lambda: ("decode-0", None) in events, 2.0, what="delete event")
        await wait_until(lambda: "decode-0" in watcher.workers(), TTL_S / 3 + 1.0)
        assert any("re-registered worker decode-0" in r.message for r in caplog.records)
        assert reg.state is RegistrationState.REGISTERED
    finally:
        await reg.close()


async def test_registration_returns_after_nats_loses_its_store(
    nats_server: NatsServer, watcher: NatsWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    reg = open_registration(nats_server.url, ttl_s=TTL_S)
    await reg.start(make_record())
    try:
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
        nats_server.restart(wipe=True)  # the bucket and every record are gone
        await wait_until(
            lambda: any("re-registered" in r.message for r in caplog.records),
            TTL_S + SLACK_S,
            what="re-registration",
        )
        await wait_until(lambda: watcher.connected and "decode-0" in watcher.workers(), 5.0)
        assert await stored_record(nats_server, "decode-0") is not None
    finally:
        await reg.close()


async def test_expiry_after_an_outage_waits_for_the_grace_then_removes_the_dead(
    nats_server: NatsServer,
) -> None:
    watcher = NatsWatcher("127.0.0.1", nats_server.port, resync_grace_s=1.0)
    await watcher.start()
    reg = open_registration(nats_server.url, ttl_s=1.0)
    await reg.start(make_record())
    try:
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
        await reg.abandon()  # the worker dies during the outage
        nats_server.stop()
        await asyncio.sleep(1.5)
        nats_server.start()
        await wait_until(lambda: watcher.connected, 5.0, what="re-list")
        assert "decode-0" in watcher.workers()  # not yet: it might still come back
        await wait_until(lambda: "decode-0" not in watcher.workers(), 1.0 + SLACK_S)
    finally:
        await watcher.close()


async def test_nothing_raises_while_nats_is_unreachable() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    reg = open_registration(url, ttl_s=TTL_S)
    await reg.start(make_record())
    assert reg.state is RegistrationState.RETRYING
    await reg.update(make_record(running=1))
    publisher = event_publisher(reg)
    assert publisher is not None and not await publisher.publish(WorkerLoad())
    watcher = open_watcher(url)
    await watcher.start()
    assert watcher.workers() == {}
    await watcher.close()
    await reg.close()
    assert reg.state is RegistrationState.CLOSED
