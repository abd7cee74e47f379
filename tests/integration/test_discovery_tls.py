"""TLS and user credentials toward the control planes, against real servers started with TLS:
etcd on https client URLs with ``--client-cert-auth`` (and role-based auth), nats-server with a
``tls { verify: true }`` block, JetStream and operator-mode (JWT) auth. Certificates, JWTs and
the ``.creds`` file are made by the test (:mod:`tests.support.pki`).

Each "refused" case checks that the failure is bounded (``start()`` returns within a few
seconds with the registration RETRYING, the watcher not connected) and that the warning says
why (handshake, certificate, password, authorization).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pdserve.config.settings import DiscoverySettings
from pdserve.discovery import Registration, RegistrationState, Watcher, open_registration
from pdserve.discovery import open_watcher as _open_watcher
from pdserve.discovery.etcd import EtcdRegistration, EtcdWatcher
from pdserve.discovery.load_events import event_publisher
from pdserve.discovery.nats import NatsRegistration
from pdserve.discovery.nats_watcher import NatsWatcher
from pdserve.protocol import WorkerLoad
from tests.support.discovery_backends import make_record
from tests.support.fakes import CLUSTER_KEY
from tests.support.pki import PKI, NatsOperator, make_nats_operator, make_pki
from tests.support.servers import (
    EtcdServer,
    NatsServer,
    ServerTLS,
    running_etcd,
    running_nats,
    wait_until,
)

TTL_S = 3.0
REFUSED_WITHIN_S = 8.0
"""A refused connection must leave start() within this (connect waits are ~2 s)."""
ETCD_USER = "pdserve-worker"  # not the client certificate's CN: etcd would map CN to a user
ETCD_PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> NatsOperator:
    return make_nats_operator(tmp_path_factory.mktemp("nats-operator"))


def server_tls(pki: PKI) -> ServerTLS:
    return ServerTLS(pki.server_cert, pki.server_key, pki.ca, pki.client_cert, pki.client_key)


def settings(
    url: str, pki: PKI, *, cert: bool = True, ca: Path | None = None, **more: object
) -> DiscoverySettings:
    """Discovery settings with the test CA (or ``ca``) and, with ``cert``, the client cert."""
    files: dict[str, object] = {"ca_file": ca or pki.ca}
    if cert:
        files |= {"cert_file": pki.client_cert, "key_file": pki.client_key}
    return DiscoverySettings.model_validate({"url": url, **files, **more})


def open_watcher(cfg: DiscoverySettings) -> Watcher:
    return _open_watcher(cfg.url, key=CLUSTER_KEY, discovery=cfg)


def register(cfg: DiscoverySettings) -> Registration:
    return open_registration(cfg.url, ttl_s=TTL_S, key=CLUSTER_KEY, discovery=cfg)


async def assert_registers_and_is_watched(cfg: DiscoverySettings) -> None:
    watcher = open_watcher(cfg)
    reg = register(cfg)
    try:
        await watcher.start()
        await reg.start(make_record("decode-0"))
        assert reg.state is RegistrationState.REGISTERED
        await wait_until(lambda: "decode-0" in watcher.workers(), 5.0, what="watch event")
        await reg.update(make_record("decode-0", running=3))
        await wait_until(
            lambda: watcher.workers()["decode-0"].load.running == 3, 5.0, what="update"
        )
        await reg.close()
        await wait_until(lambda: "decode-0" not in watcher.workers(), 5.0, what="deregistered")
    finally:
        await reg.close()
        await watcher.close()


async def assert_refused(
    cfg: DiscoverySettings, caplog: pytest.LogCaptureFixture, *reasons: str
) -> None:
    """start() returns within REFUSED_WITHIN_S, RETRYING; the watcher is not connected; the
    warnings name one of ``reasons`` (case-insensitive)."""
    caplog.set_level(logging.WARNING, logger="pdserve.discovery")
    watcher = open_watcher(cfg)
    reg = register(cfg)
    try:
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(reg.start(make_record("decode-0")), REFUSED_WITHIN_S)
        await asyncio.wait_for(watcher.start(), REFUSED_WITHIN_S)
        assert loop.time() - began < REFUSED_WITHIN_S
        assert reg.state is RegistrationState.RETRYING
        assert not getattr(watcher, "connected", True)
        assert watcher.workers() == {}
        text = caplog.text.lower()
        assert any(r.lower() in text for r in reasons), caplog.text
    finally:
        await asyncio.wait_for(reg.close(), REFUSED_WITHIN_S)
        await asyncio.wait_for(watcher.close(), REFUSED_WITHIN_S)


# ----------------------------------------------------------------------------- etcd


@pytest.fixture
def etcd_tls(pki: PKI) -> Iterator[EtcdServer]:
    with running_etcd(server_tls(pki)) as server:
        yield server


async def test_etcd_mutual_tls_registers_and_watches(etcd_tls: EtcdServer, pki: PKI) -> None:
    cfg = settings(etcd_tls.url, pki)
    assert isinstance(register(cfg), EtcdRegistration)
    assert isinstance(open_watcher(cfg), EtcdWatcher)
    await assert_registers_and_is_watched(cfg)


async def test_etcd_refuses_a_client_without_certificate(
    etcd_tls: EtcdServer, pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    await assert_refused(
        settings(etcd_tls.url, pki, cert=False), caplog, "handshake", "certificate"
    )


async def test_etcd_with_a_wrong_ca_is_refused(
    etcd_tls: EtcdServer, pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = settings(etcd_tls.url, pki, ca=pki.other_ca)
    await assert_refused(cfg, caplog, "certificate_verify_failed", "handshake")


async def test_etcd_plaintext_client_is_refused_by_a_tls_server(
    etcd_tls: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    await assert_refused(DiscoverySettings(url=etcd_tls.url), caplog, "does etcd serve tls")


async def test_etcd_user_and_password(
    etcd_tls: EtcdServer, pki: PKI, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    etcd_tls.enable_auth(
        root_password="root-secret", user=ETCD_USER, password=ETCD_PASSWORD, prefix="/pdserve/"
    )
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text(ETCD_PASSWORD + "\n")
    bad.write_text("not the password\n")
    user = {"etcd_username": ETCD_USER}
    await assert_registers_and_is_watched(
        settings(etcd_tls.url, pki, etcd_password_file=good, **user)
    )
    await assert_refused(
        settings(etcd_tls.url, pki, etcd_password_file=bad, **user),
        caplog,
        "authentication failed",
    )
    caplog.clear()
    # No user: the client certificate alone (CN "pdserve", no such etcd user) gets no access.
    await assert_refused(settings(etcd_tls.url, pki), caplog, "authentication on")


async def test_etcd_user_logs_in_again_after_an_etcd_restart(
    etcd_tls: EtcdServer, pki: PKI, tmp_path: Path
) -> None:
    """etcd forgets auth tokens when it restarts: the registration logs in again (and keeps
    its record), the watcher follows again."""
    etcd_tls.enable_auth(
        root_password="root-secret", user=ETCD_USER, password=ETCD_PASSWORD, prefix="/pdserve/"
    )
    password = tmp_path / "password"
    password.write_text(ETCD_PASSWORD)
    cfg = settings(
        etcd_tls.url,
        pki,
        etcd_username=ETCD_USER,
        etcd_password_file=password,
        **{"registration_ttl_s": TTL_S},
    )
    watcher = open_watcher(cfg)
    reg = register(cfg)
    try:
        await watcher.start()
        await reg.start(make_record("decode-0"))
        await wait_until(lambda: "decode-0" in watcher.workers(), 5.0)
        etcd_tls.restart()
        await reg.update(make_record("decode-0", running=5))
        await wait_until(
            lambda: (w := watcher.workers().get("decode-0")) is not None and w.load.running == 5,
            15.0,
            what="the update after the restart",
        )
        assert reg.state is RegistrationState.REGISTERED
    finally:
        await reg.close()
        await watcher.close()


# ----------------------------------------------------------------------------- NATS


@pytest.fixture
def nats_tls(pki: PKI, operator: NatsOperator) -> Iterator[NatsServer]:
    """nats-server: mutual TLS, operator-mode auth (JWT + creds), JetStream."""
    with running_nats(server_tls(pki), config=operator.server_config) as server:
        yield server


async def test_nats_mutual_tls_with_credentials_registers_and_watches(
    nats_tls: NatsServer, pki: PKI, operator: NatsOperator
) -> None:
    cfg = settings(nats_tls.url, pki, nats_credentials_file=operator.creds)
    assert isinstance(register(cfg), NatsRegistration)
    assert isinstance(open_watcher(cfg), NatsWatcher)
    await assert_registers_and_is_watched(cfg)


async def test_nats_load_events_travel_over_the_tls_connection(
    nats_tls: NatsServer, pki: PKI, operator: NatsOperator
) -> None:
    cfg = settings(nats_tls.url, pki, nats_credentials_file=operator.creds)
    watcher = open_watcher(cfg)
    reg = register(cfg)
    try:
        await watcher.start()
        await reg.start(make_record("decode-0"))
        await wait_until(lambda: "decode-0" in watcher.workers(), 5.0)
        events = event_publisher(reg)
        assert events is not None

        async def load_seen() -> bool:
            await events.publish(WorkerLoad(running=7))
            return watcher.workers()["decode-0"].load.running == 7

        await wait_until(load_seen, 5.0, interval_s=0.2, what="load event over TLS")
    finally:
        await reg.close()
        await watcher.close()


async def test_nats_refuses_a_client_without_certificate(
    nats_tls: NatsServer, pki: PKI, operator: NatsOperator, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = settings(nats_tls.url, pki, cert=False, nats_credentials_file=operator.creds)
    await assert_refused(cfg, caplog, "certificate", "unreachable")


async def test_nats_with_a_wrong_ca_is_refused(
    nats_tls: NatsServer, pki: PKI, operator: NatsOperator, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = settings(nats_tls.url, pki, ca=pki.other_ca, nats_credentials_file=operator.creds)
    await assert_refused(cfg, caplog, "certificate verify failed")


async def test_nats_refuses_credentials_of_another_operator(
    nats_tls: NatsServer, pki: PKI, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stranger = make_nats_operator(tmp_path / "stranger")
    cfg = settings(nats_tls.url, pki, nats_credentials_file=stranger.creds)
    await assert_refused(cfg, caplog, "authorization")
    caplog.clear()
    await assert_refused(settings(nats_tls.url, pki), caplog, "authorization")


async def test_nats_with_tls_configured_refuses_a_plaintext_server(
    nats_server: NatsServer, pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that does not require TLS is never used in plaintext (no downgrade)."""
    await assert_refused(settings(nats_server.url, pki), caplog, "does not require tls")


@pytest.fixture
async def nats_tls_only(pki: PKI) -> AsyncIterator[NatsServer]:
    """nats-server with mutual TLS and no user auth."""
    with running_nats(server_tls(pki)) as server:
        yield server


async def test_nats_mutual_tls_without_credentials_file(
    nats_tls_only: NatsServer, pki: PKI
) -> None:
    await assert_registers_and_is_watched(settings(nats_tls_only.url, pki))
