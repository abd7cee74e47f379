"""etcd-only discovery behaviour (leases), against a real etcd server. The behaviour every
backend shares is in ``test_discovery_contract.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aetcd
import pytest

from pdserve.discovery import RegistrationState, open_registration, open_watcher
from pdserve.discovery.etcd import EtcdRegistration, EtcdWatcher, worker_key
from pdserve.protocol import WorkerRecord
from tests.support.discovery_backends import make_record
from tests.support.fakes import CLUSTER_KEY
from tests.support.servers import EtcdServer, wait_until

TTL_S = 2.0


@pytest.fixture
async def watcher(etcd_server: EtcdServer) -> AsyncIterator[EtcdWatcher]:
    w = open_watcher(etcd_server.url, key=CLUSTER_KEY)
    assert isinstance(w, EtcdWatcher)
    await w.start()
    yield w
    await w.close()


async def test_record_is_stored_under_the_registrations_lease(
    etcd_server: EtcdServer, watcher: EtcdWatcher
) -> None:
    reg = open_registration(etcd_server.url, ttl_s=TTL_S, key=CLUSTER_KEY)
    assert isinstance(reg, EtcdRegistration)
    await reg.start(make_record("decode-0"))
    try:
        await wait_until(lambda: "decode-0" in watcher.workers(), 2.0, what="watch event")
        async with aetcd.Client(port=etcd_server.client_port) as client:
            stored = await client.get(worker_key("decode-0"))
            assert stored is not None and stored.lease == reg.lease_id
            assert WorkerRecord.model_validate_json(stored.value).epoch == 1
    finally:
        await reg.close()


async def test_lost_lease_is_replaced_by_a_new_lease_while_etcd_stays_up(
    etcd_server: EtcdServer, watcher: EtcdWatcher
) -> None:
    """As if the lease had expired while the worker was partitioned from etcd."""
    events: list[tuple[str, int | None]] = []
    watcher.subscribe(lambda wid, rec: events.append((wid, rec.epoch if rec else None)))
    reg = open_registration(etcd_server.url, ttl_s=TTL_S, key=CLUSTER_KEY)
    assert isinstance(reg, EtcdRegistration)
    await reg.start(make_record("decode-0"))
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
