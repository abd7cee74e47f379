"""The discovery contract, against every backend on a real server: the embedded registry (over
HTTP), etcd and NATS. What a worker's registration and the router's watcher promise whatever
the backend: visibility, updates, refresh past the TTL, expiry of a crashed worker, immediate
deregistration, restarts with a new epoch, re-registration after the record or the server's
state is lost, outages, and no exceptions while the server is unreachable.

Backend-specific behaviour lives beside it: ``tests/unit/test_discovery_embedded.py``,
``test_discovery_etcd.py``, ``test_discovery_nats.py``.

"Nothing happened" checks wait for progress instead of sleeping: the registration's
``renewals`` counter proves that enough refreshes (so enough time past the TTL) went by, and the
subscriber's event list shows what the watcher saw meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.discovery import Registration, RegistrationState, open_registration, open_watcher
from pdserve.protocol import WorkerRecord
from pdserve.security import ClusterKey
from tests.support.discovery_backends import (
    WORKER_ID,
    Backend,
    EmbeddedBackend,
    EtcdBackend,
    NatsBackend,
    make_record,
    open_registration_for,
)
from tests.support.fakes import CLUSTER_KEY
from tests.support.servers import EtcdServer, NatsServer, wait_until

Events = list[tuple[str, int | None]]


def _make_backend(name: str, request: pytest.FixtureRequest) -> Backend:
    if name == "etcd":
        return EtcdBackend(request.getfixturevalue("etcd_server"))
    if name == "nats":
        return NatsBackend(request.getfixturevalue("nats_server"))
    return EmbeddedBackend()


@pytest.fixture(params=["embedded", "etcd", "nats"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Each backend with a started watcher; its server is torn down after the test."""
    b = _make_backend(request.param, request)
    await b.open()
    yield b
    await b.aclose()


@pytest.fixture(params=["etcd", "nats"])
async def server_backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """The backends whose server runs apart from the router (so it can be out of reach)."""
    b = _make_backend(request.param, request)
    await b.open()
    yield b
    await b.aclose()


def record_events(backend: Backend) -> Events:
    """``(worker_id, epoch or None)`` per put / delete the watcher reports from now on."""
    events: Events = []
    backend.watcher.subscribe(lambda wid, rec: events.append((wid, rec.epoch if rec else None)))
    return events


async def renewed(reg: Registration, times: int) -> None:
    """Wait until ``reg`` renewed its TTL ``times`` more times (each ``ttl_s / 3`` apart)."""
    target = reg.renewals + times
    budget = times * reg.refresh_interval_s + 3.0
    await wait_until(lambda: reg.renewals >= target, budget, what=f"{times} renewals")


async def test_registration_is_visible_to_a_watcher_and_outlives_its_ttl(
    backend: Backend,
) -> None:
    events = record_events(backend)
    reg = open_registration_for(backend)
    await reg.start(make_record())
    try:
        assert reg.state is RegistrationState.REGISTERED
        await wait_until(lambda: WORKER_ID in backend.watcher.workers(), 2.0, what="watch event")
        assert backend.watcher.workers()[WORKER_ID].epoch == 1
        stored = await backend.stored(WORKER_ID)
        assert stored is not None and stored.epoch == 1
        await reg.update(make_record(running=7))
        await wait_until(
            lambda: backend.watcher.workers()[WORKER_ID].load.running == 7,
            reg.refresh_interval_s + 1.0,
            what="updated load",
        )
        # Refreshes every ttl/3 hold the record: 4 renewals span more than one TTL.
        await renewed(reg, 4)
        assert WORKER_ID in backend.watcher.workers()
        assert (WORKER_ID, None) not in events
    finally:
        await reg.close()


async def test_crashed_worker_lapses_from_the_watcher_within_ttl(backend: Backend) -> None:
    removed: list[float] = []
    backend.watcher.subscribe(
        lambda wid, rec: removed.append(time.monotonic()) if rec is None else None
    )
    reg = open_registration_for(backend)
    await reg.start(make_record())
    await wait_until(lambda: WORKER_ID in backend.watcher.workers(), 2.0)
    crashed = time.monotonic()
    await reg.abandon()  # stop refreshing without deregistering, as a killed process would
    assert WORKER_ID in backend.watcher.workers()
    limit = backend.ttl_s + backend.slack_s
    await wait_until(lambda: removed, limit, what="TTL expiry")
    assert removed[0] - crashed <= limit
    assert backend.watcher.workers() == {}
    assert await backend.stored(WORKER_ID) is None


async def test_close_removes_the_record_at_once_and_is_idempotent(backend: Backend) -> None:
    reg = open_registration_for(backend, ttl_s=10.0)  # so removal cannot be an expiry
    await reg.start(make_record())
    await wait_until(lambda: WORKER_ID in backend.watcher.workers(), 2.0)
    await reg.close()
    assert reg.state is RegistrationState.CLOSED
    # Within close_within_s (0 for the embedded registry: already gone when close() returns).
    await wait_until(
        lambda: backend.watcher.workers() == {}, backend.close_within_s, what="deregistration"
    )
    assert await backend.stored(WORKER_ID) is None
    await reg.close()  # idempotent
    assert reg.state is RegistrationState.CLOSED


async def test_restarted_worker_replaces_its_record_with_a_new_epoch(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    old = open_registration_for(backend)
    await old.start(make_record(epoch=1))
    await wait_until(lambda: WORKER_ID in backend.watcher.workers(), 2.0)
    await old.abandon()
    new = open_registration_for(backend)
    await new.start(make_record(epoch=2))
    try:
        events = record_events(backend)
        await wait_until(lambda: backend.watcher.workers()[WORKER_ID].epoch == 2, 2.0)
        assert any("restarted: epoch 1 -> 2" in r.message for r in caplog.records)
        # The old incarnation's TTL lapses (5 renewals of the new one span more than
        # TTL + 1 s) without taking the new incarnation's record along.
        await renewed(new, 5)
        assert backend.watcher.workers()[WORKER_ID].epoch == 2
        assert (WORKER_ID, None) not in events and (WORKER_ID, 1) not in events
        stored = await backend.stored(WORKER_ID)
        assert stored is not None and stored.epoch == 2
    finally:
        await new.close()


async def test_record_removed_behind_its_back_is_put_again(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """As if the record had expired while the worker was cut off from the server."""
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    events = record_events(backend)
    reg = open_registration_for(backend)
    await reg.start(make_record())
    try:
        await wait_until(lambda: WORKER_ID in backend.watcher.workers(), 2.0)
        await backend.remove_behind_back(reg, WORKER_ID)
        # Gone, then back within one refresh interval (+ slack), logged as a re-registration.
        await wait_until(lambda: (WORKER_ID, None) in events, 2.0, what="delete event")
        await wait_until(
            lambda: WORKER_ID in backend.watcher.workers(), reg.refresh_interval_s + 1.0
        )
        await wait_until(
            lambda: any(f"re-registered worker {WORKER_ID}" in r.message for r in caplog.records),
            1.0,
            what="re-registration logged",
        )
        assert reg.state is RegistrationState.REGISTERED
    finally:
        await reg.close()


async def test_registration_returns_after_the_server_loses_its_state(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    reg = open_registration_for(backend)
    await reg.start(make_record())
    try:
        await wait_until(lambda: WORKER_ID in backend.watcher.workers(), 2.0)
        await backend.lose_state()
        await wait_until(
            lambda: any("re-registered" in r.message for r in caplog.records),
            backend.ttl_s + backend.slack_s,
            what="re-registration",
        )
        await wait_until(
            lambda: backend.following() and WORKER_ID in backend.watcher.workers(), 8.0
        )
        assert await backend.stored(WORKER_ID) is not None
    finally:
        await reg.close()


async def test_nothing_raises_while_the_server_is_unreachable(backend: Backend) -> None:
    url = backend.unreachable_url()
    reg = open_registration(url, ttl_s=backend.ttl_s, key=CLUSTER_KEY)
    await reg.start(make_record())
    assert reg.state is RegistrationState.RETRYING
    await reg.update(make_record(running=1))
    watcher = open_watcher(url, key=CLUSTER_KEY)
    await watcher.start()
    assert watcher.workers() == {}
    await watcher.close()
    await reg.close()
    assert reg.state is RegistrationState.CLOSED


async def test_outage_keeps_the_view_and_the_registration_returns(
    server_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    backend = server_backend
    server: EtcdServer | NatsServer = backend.server  # type: ignore[attr-defined]
    caplog.set_level(logging.INFO, logger="pdserve.discovery")
    reg = open_registration_for(backend)
    await reg.start(make_record())
    try:
        await wait_until(lambda: WORKER_ID in backend.watcher.workers(), 2.0)
        server.stop(kill=True)
        await wait_until(lambda: not backend.following(), 2.0, what="watcher to notice")
        await wait_until(lambda: reg.state is RegistrationState.RETRYING, backend.ttl_s + 1.0)
        # The outage's length is what is tested: down for longer than the TTL.
        await asyncio.sleep(backend.ttl_s + 1.0)
        assert WORKER_ID in backend.watcher.workers()  # the last view is kept
        server.start()
        await wait_until(lambda: backend.following(), 8.0, what="watcher to re-list")
        await wait_until(lambda: reg.state is RegistrationState.REGISTERED, 2 * backend.ttl_s)
        assert WORKER_ID in backend.watcher.workers()
        stored = await backend.stored(WORKER_ID)
        assert stored is not None and stored.epoch == 1
        # Refreshes work again after the restart, and nothing was dropped meanwhile.
        await renewed(reg, 4)
        assert WORKER_ID in backend.watcher.workers()
        assert not any(f"worker {WORKER_ID} removed" in r.message for r in caplog.records)
    finally:
        await reg.close()


async def test_records_not_signed_with_the_cluster_key_never_reach_the_view(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that can write to the store but lacks the cluster secret can neither add a worker
    nor replace a real one's record: the watcher drops it and names it in a warning."""
    caplog.set_level(logging.WARNING, logger="pdserve.discovery")
    events = record_events(backend)
    other = ClusterKey(b"another-deployment-secret-0123456789abcdef")
    genuine = make_record()
    forged: list[WorkerRecord] = [
        make_record("rogue-unsigned").model_copy(update={"signature": ""}),
        other.sign_record(make_record("rogue-foreign").model_copy(update={"signature": ""})),
        # A hijack: the real worker's id, its endpoint changed after signing.
        genuine.model_copy(update={"http_url": "http://attacker:8100"}),
    ]
    reg = open_registration_for(backend)
    try:
        await reg.start(genuine)
        await wait_until(lambda: WORKER_ID in backend.watcher.workers(), 2.0)
        for rec in forged:
            await backend.write_forged(rec)

        def warned(worker_id: str) -> bool:
            return any(repr(worker_id) in r.getMessage() for r in caplog.records)

        if backend.name != "embedded":  # the embedded route refused them already (401)
            await wait_until(
                lambda: all(warned(r.worker_id) for r in forged),
                5.0,
                what="a warning naming each forged record",
            )
        view = backend.watcher.workers()
        assert set(view) == {WORKER_ID}, view
        assert view[WORKER_ID].http_url == genuine.http_url
        assert [wid for wid, _ in events if wid != WORKER_ID] == []
    finally:
        await reg.close()
        for rec in forged:
            await backend.erase(rec.worker_id)
