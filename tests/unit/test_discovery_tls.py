"""``ControlPlaneTLS.from_settings``: every unusable TLS / credentials setting is a ConfigError
naming the setting, raised by open_registration / open_watcher before anything connects."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from pdserve.config.settings import DiscoverySettings
from pdserve.discovery import open_registration, open_watcher
from pdserve.discovery.tls import ControlPlaneTLS
from pdserve.errors import ConfigError
from tests.support.fakes import CLUSTER_KEY
from tests.support.pki import PKI, make_nats_operator, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def cfg(**fields: object) -> DiscoverySettings:
    return DiscoverySettings.model_validate({"url": "etcd://127.0.0.1:2379", **fields})


def refused(settings: DiscoverySettings, setting: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        ControlPlaneTLS.from_settings(settings)
    assert caught.value.param == f"discovery.{setting}"
    assert f"discovery.{setting}" in caught.value.message
    return caught.value


def test_nothing_set_is_plain_tcp() -> None:
    for tls in (ControlPlaneTLS.from_settings(None), ControlPlaneTLS.from_settings(cfg())):
        assert not tls.enabled and tls.ssl_context() is None and tls.grpc_credentials() is None
        assert tls.describe() == "plain TCP"


def test_ca_and_client_certificate(pki: PKI) -> None:
    tls = ControlPlaneTLS.from_settings(
        cfg(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    )
    assert tls.enabled and tls.mutual and tls.describe() == "mutual TLS"
    context = tls.ssl_context()
    assert context is not None and context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname
    assert tls.grpc_credentials() is not None
    ca_only = ControlPlaneTLS.from_settings(cfg(ca_file=pki.ca))
    assert ca_only.enabled and not ca_only.mutual


def test_half_a_client_certificate_pair(pki: PKI) -> None:
    refused(cfg(ca_file=pki.ca, cert_file=pki.client_cert), "key_file")
    refused(cfg(key_file=pki.client_key), "cert_file")


def test_unreadable_empty_and_malformed_files(pki: PKI, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    assert "cannot read" in refused(cfg(ca_file=missing), "ca_file").message
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    assert "empty" in refused(cfg(ca_file=empty), "ca_file").message
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    refused(cfg(ca_file=garbage), "ca_file")
    refused(cfg(cert_file=garbage, key_file=pki.client_key), "cert_file")
    # A key that is not the certificate's.
    refused(cfg(cert_file=pki.client_cert, key_file=pki.server_key), "cert_file")


def test_etcd_user_and_password_file(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("s3cret\nignored second line\n")
    tls = ControlPlaneTLS.from_settings(cfg(etcd_username="pdserve", etcd_password_file=password))
    assert tls.etcd_password == "s3cret" and not tls.enabled
    assert "s3cret" not in repr(tls) and "s3cret" not in tls.describe()
    refused(cfg(etcd_username="pdserve"), "etcd_password_file")
    refused(cfg(etcd_password_file=password), "etcd_username")
    password.write_text("\n")
    refused(cfg(etcd_username="pdserve", etcd_password_file=password), "etcd_password_file")


def test_nats_credentials_file(tmp_path: Path) -> None:
    creds = make_nats_operator(tmp_path / "op").creds
    assert ControlPlaneTLS.from_settings(cfg(nats_credentials_file=creds)).nats_credentials_file
    not_creds = tmp_path / "x.creds"
    not_creds.write_text("hello\n")
    refused(cfg(nats_credentials_file=not_creds), "nats_credentials_file")
    refused(cfg(nats_credentials_file=tmp_path / "absent.creds"), "nats_credentials_file")


def test_open_functions_check_before_connecting(pki: PKI) -> None:
    bad = cfg(cert_file=pki.client_cert)
    for url in ("etcd://127.0.0.1:1", "nats://127.0.0.1:1"):
        with pytest.raises(ConfigError):
            open_registration(url, ttl_s=1.0, key=CLUSTER_KEY, discovery=bad)
        with pytest.raises(ConfigError):
            open_watcher(url, key=CLUSTER_KEY, discovery=bad)
    # The embedded registry (HTTP) does not use them.
    open_registration("http://127.0.0.1:1", ttl_s=1.0, key=CLUSTER_KEY, discovery=bad)
