"""etcd discovery against a real etcd server: leases, expiry, restarts, outages."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import aetcd
import pytest

from pdserve.discovery import RegistrationState, open_registration, open_watcher
from pdserve.discovery.etcd import EtcdRegistration, EtcdWatcher, worker_key
from pdserve.protocol import KVLayout, Role, WorkerLoad, WorkerRecord
from tests.fixtures.servers import EtcdServer, free_port, wait_until

pytestmark = pytest.mark.integration

TTL_S = 2.0
SLACK_S = 2.0

LAYOUT = KVLayout(
    model="tiny", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16, dtype="float32"
)


def make_record(worker_id: str = "decode-0", epoch: int = 1, running: int = 0) -> WorkerRecord:
    return WorkerRecord(
        role=Role.DECODE,
        worker_id=worker_id,
        epoch=epoch,
        model="tiny",
        http_url="http://127.0.0.1:9",
        layout=LAYOUT,
        load=WorkerLoad(running=running),
    )


@pytest.fixture
async def watcher(etcd_server: EtcdServer) -> AsyncIterator[EtcdWatcher]:
    w = open_watcher(etcd_server.url)
    assert isinstance(w, EtcdWatcher)
    await w.start()
    yield w
    await w.close()


async def test_registration_is_visible_to_a_watcher(
    etcd_server: EtcdServer, watcher: EtcdWatcher
) -> None:
    reg = open_registration(etcd_server.url, ttl_s=TTL_S)
    assert isinstance(reg, EtcdRegistration)
    await reg.start(make_record())
    try:
        assert reg.state is RegistrationState.REGISTERED
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0, what="watch event")
        async with aetcd.Client(port=etcd_server.client_port) as client:
            stored = await client.get(worker_key("decode-0"))
            assert stored is not None and stored.lease == reg.lease_id
            assert WorkerRecord.model_validate_json(stored.value).epoch == 1
        await reg.update(make_record(running=3))
        await wait_until(lambda: watcher.workers()["decode-0"].load.running == 3, 2.0)
        # The keepalive holds the record past several TTLs.
        await asyncio.sleep(2 * TTL_S)
        assert "decode-0" in watcher.workers()
    finally:
        await reg.close()


async def test_crashed_worker_lapses_from_the_watcher_within_ttl(
    etcd_server: EtcdServer, watcher: EtcdWatcher
) -> None:
    removed: list[float] = []
    watcher.subscribe(lambda wid, rec: removed.append(time.monotonic()) if rec is None else None)
    reg = open_registration(etcd_server.url, ttl_s=TTL_S)
    await reg.start(make_record())
    await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
    crashed = time.monotonic()
    await reg.abandon()  # cancel the keepalive without revoking the lease
    await wait_until(lambda: removed, TTL_S + SLACK_S, what="lease expiry")
    assert removed[0] - crashed <= TTL_S + SLACK_S
    assert watcher.workers() == {}


async def test_restarted_worker_replaces_its_record_with_new_epoch(
    etcd_server: EtcdServer, watcher: EtcdWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    old = open_registration(etcd_server.url, ttl_s=TTL_S)
    await old.start(make_record(epoch=1))
    await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
    await old.abandon()
    new = open_registration(etcd_server.url, ttl_s=TTL_S)
    await new.start(make_record(epoch=2))
    try:
        await wait_until(lambda: watcher.workers()["decode-0"].epoch == 2, 2.0)
        assert any("restarted: epoch 1 -> 2" in r.message for r in caplog.records)
        # The old lease lapses without taking the new incarnation's record along.
        await asyncio.sleep(TTL_S + 1.0)
        assert watcher.workers()["decode-0"].epoch == 2
    finally:
        await new.close()


async def test_close_removes_the_record_at_once(
    etcd_server: EtcdServer, watcher: EtcdWatcher
) -> None:
    reg = open_registration(etcd_server.url, ttl_s=TTL_S)
    await reg.start(make_record())
    await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
    await reg.close()
    took = await wait_until(lambda: watcher.workers() == {}, 1.0, what="revoke")
    assert took < 1.0
    await reg.close()  # idempotent


async def test_etcd_outage_keeps_the_view_and_registration_returns(
    etcd_server: EtcdServer, watcher: EtcdWatcher
) -> None:
    reg = open_registration(etcd_server.url, ttl_s=TTL_S)
    await reg.start(make_record())
    try:
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
        etcd_server.stop(kill=True)
        await wait_until(lambda: not watcher.connected, 2.0, what="watch to break")
        await wait_until(lambda: reg.state is RegistrationState.RETRYING, TTL_S, what="retry")
        await asyncio.sleep(TTL_S)  # down for longer than the TTL
        assert "decode-0" in watcher.workers()  # the last view is kept
        etcd_server.start()
        await wait_until(lambda: watcher.connected, 8.0, what="watch to reconnect")
        await wait_until(lambda: reg.state is RegistrationState.REGISTERED, 2 * TTL_S)
        assert "decode-0" in watcher.workers()
        await asyncio.sleep(TTL_S + 1.0)  # the keepalive works again after the restart
        assert "decode-0" in watcher.workers()
    finally:
        await reg.close()


async def test_registration_returns_after_etcd_loses_its_data(
    etcd_server: EtcdServer, watcher: EtcdWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    reg = open_registration(etcd_server.url, ttl_s=TTL_S)
    await reg.start(make_record())
    try:
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
        etcd_server.restart(wipe=True)  # every key and lease is gone
        await wait_until(
            lambda: any("re-registered" in r.message for r in caplog.records),
            TTL_S + SLACK_S,
            what="re-registration",
        )
        await wait_until(lambda: watcher.connected and "decode-0" in watcher.workers(), 8.0)
        async with aetcd.Client(port=etcd_server.client_port) as client:
            assert await client.get(worker_key("decode-0")) is not None
    finally:
        await reg.close()


async def test_lost_lease_is_replaced_while_etcd_stays_up(
    etcd_server: EtcdServer, watcher: EtcdWatcher
) -> None:
    """As if the lease had expired while the worker was partitioned from etcd."""
    events: list[tuple[str, int | None]] = []
    watcher.subscribe(lambda wid, rec: events.append((wid, rec.epoch if rec else None)))
    reg = open_registration(etcd_server.url, ttl_s=TTL_S)
    assert isinstance(reg, EtcdRegistration)
    await reg.start(make_record())
    try:
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0)
        old_lease = reg.lease_id
        assert old_lease is not None
        async with aetcd.Client(port=etcd_server.client_port) as client:
            await client.revoke_lease(old_lease)
        # Gone, then back under a new lease within one refresh interval (+ slack).
        await wait_until(lambda: ("decode-0", None) in events, 2.0, what="delete event")
        await wait_until(lambda: "decode-0" in watcher.workers(), TTL_S / 3 + 1.0)
        assert reg.lease_id not in (None, old_lease)
        assert reg.state is RegistrationState.REGISTERED
    finally:
        await reg.close()


async def test_nothing_raises_while_etcd_is_unreachable() -> None:
    url = f"etcd://127.0.0.1:{free_port()}"
    reg = open_registration(url, ttl_s=TTL_S)
    await reg.start(make_record())
    assert reg.state is RegistrationState.RETRYING
    await reg.update(make_record(running=1))
    watcher = open_watcher(url)
    await watcher.start()
    assert watcher.workers() == {}
    await watcher.close()
    await reg.close()
    assert reg.state.value == "closed"
