"""TLS and user credentials toward the control planes (etcd, NATS), from ``DiscoverySettings``.

One object, :class:`ControlPlaneTLS`, read once at startup (before anything connects) by
:func:`pdserve.discovery.open_registration` / :func:`~pdserve.discovery.open_watcher` and handed
to both backends:

- TLS is on when ``discovery.ca_file`` or ``discovery.cert_file`` is set. ``ca_file`` (PEM) is
  the only trust root then; without it the system's default CAs verify the server. The server's
  certificate must name the host of the discovery URL (hostname checking stays on).
- ``cert_file`` + ``key_file`` (PEM, both or neither): the client certificate (mutual TLS).
- etcd: ``etcd_username`` + ``etcd_password_file`` (both or neither; the file's first line is
  the password) for etcd's role-based access control; gRPC credentials by
  :meth:`ControlPlaneTLS.grpc_credentials`.
- NATS: ``nats_credentials_file`` (a ``.creds`` file: user JWT + NKey seed; needs the
  ``nkeys`` package) and an :class:`ssl.SSLContext` by :meth:`ControlPlaneTLS.ssl_context`.

Every file is read (and every certificate and key parsed) in
:meth:`ControlPlaneTLS.from_settings`, so a missing, unreadable or malformed file, or half a
pair, is a :class:`~pdserve.errors.ConfigError` naming the setting at startup rather than a
connection that keeps failing. The password never appears in ``repr`` or logs. ``grpc`` is
imported only by :meth:`ControlPlaneTLS.grpc_credentials`.
"""

from __future__ import annotations

import importlib.util
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.errors import ConfigError

if TYPE_CHECKING:
    import grpc  # type: ignore[import-untyped]  # grpcio ships no type stubs

    from pdserve.config.settings import DiscoverySettings

_FLAGS = {
    "ca_file": "--discovery-ca-file",
    "cert_file": "--discovery-cert-file",
    "key_file": "--discovery-key-file",
    "nats_credentials_file": "--nats-credentials-file",
    "etcd_username": "--etcd-username",
    "etcd_password_file": "--etcd-password-file",
}


def _error(setting: str, message: str) -> ConfigError:
    """A ConfigError whose text and ``param`` name ``discovery.<setting>`` and its flag."""
    return ConfigError(
        f"discovery.{setting} ({_FLAGS[setting]}): {message}", param=f"discovery.{setting}"
    )


def _read(setting: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _error(setting, f"cannot read {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise _error(setting, f"{path} is empty")
    return data


@dataclass(frozen=True)
class ControlPlaneTLS:
    """TLS material and user credentials for etcd and NATS (see the module docstring).

    Build it with :meth:`from_settings`; ``ControlPlaneTLS()`` is "plain TCP, no user". The
    PEM bytes are held in memory (read once); ``etcd_password`` is left out of ``repr``.
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    ca_pem: bytes | None = field(default=None, repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)
    nats_credentials_file: Path | None = None
    etcd_username: str | None = None
    etcd_password: str | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        """Whether connections use TLS (``ca_file`` or ``cert_file`` is set)."""
        return self.ca_file is not None or self.cert_file is not None

    @property
    def mutual(self) -> bool:
        """Whether a client certificate is presented."""
        return self.cert_file is not None

    @classmethod
    def from_settings(cls, settings: DiscoverySettings | None) -> ControlPlaneTLS:
        """Read and check every file ``settings`` names; None gives plain TCP, no user.

        Raises :class:`~pdserve.errors.ConfigError` (``param`` = ``discovery.<setting>``) for
        a file that is missing, unreadable, empty or not valid PEM of its kind, a certificate
        without its key (or the reverse), a key that does not match its certificate, a user
        without a password file (or the reverse), and a credentials file without the
        ``nkeys`` package.
        """
        if settings is None:
            return cls()
        if (settings.cert_file is None) != (settings.key_file is None):
            have, missing = (
                ("cert_file", "key_file")
                if settings.key_file is None
                else ("key_file", "cert_file")
            )
            raise _error(
                missing,
                f"not set, but discovery.{have} is: a client certificate needs both "
                f"(PEM certificate and its private key)",
            )
        if (settings.etcd_username is None) != (settings.etcd_password_file is None):
            missing = (
                "etcd_password_file" if settings.etcd_password_file is None else "etcd_username"
            )
            raise _error(missing, "etcd_username and etcd_password_file go together")
        tls = cls(
            ca_file=settings.ca_file,
            cert_file=settings.cert_file,
            key_file=settings.key_file,
            ca_pem=_read("ca_file", settings.ca_file) if settings.ca_file else None,
            cert_pem=_read("cert_file", settings.cert_file) if settings.cert_file else None,
            key_pem=_read("key_file", settings.key_file) if settings.key_file else None,
            nats_credentials_file=_check_creds(settings.nats_credentials_file),
            etcd_username=settings.etcd_username,
            etcd_password=_read_password(settings.etcd_password_file),
        )
        if tls.enabled:
            tls.ssl_context()  # parses the CA, certificate and key: errors name the setting
        return tls

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client :class:`ssl.SSLContext` (TLS 1.2+, hostname checked, ``ca_file`` as the
        trust root or the system CAs, the client certificate loaded), or None without TLS.
        Raises ConfigError for a CA, certificate or key that does not parse or match."""
        if not self.enabled:
            return None
        try:
            context = ssl.create_default_context(
                cadata=self.ca_pem.decode("ascii", errors="replace") if self.ca_pem else None
            )
        except (ssl.SSLError, ValueError) as exc:
            raise _error("ca_file", f"{self.ca_file} is not a PEM CA certificate: {exc}") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file is not None and self.key_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except ssl.SSLError as exc:
                raise _error(
                    "cert_file",
                    f"cannot load {self.cert_file} with key {self.key_file} (PEM certificate "
                    f"and its unencrypted private key expected): {exc}",
                ) from None
            except OSError as exc:
                raise _error("cert_file", f"cannot read {self.cert_file}: {exc}") from None
        return context

    def grpc_credentials(self) -> grpc.ChannelCredentials | None:
        """gRPC channel credentials for etcd (CA, client certificate and key as PEM), or None
        without TLS."""
        if not self.enabled:
            return None
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )

    def describe(self) -> str:
        """What is in use, for logs (never secrets): e.g. ``TLS (client certificate), user
        pdserve``."""
        parts = [("mutual TLS" if self.mutual else "TLS") if self.enabled else "plain TCP"]
        if self.etcd_username:
            parts.append(f"etcd user {self.etcd_username}")
        if self.nats_credentials_file:
            parts.append(f"NATS credentials {self.nats_credentials_file.name}")
        return ", ".join(parts)


def _read_password(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        text = _read("etcd_password_file", path).decode()
    except UnicodeDecodeError:
        raise _error("etcd_password_file", f"{path} is not UTF-8 text") from None
    password = text.splitlines()[0] if text.splitlines() else ""
    if not password:
        raise _error("etcd_password_file", f"{path}: the first line (the password) is empty")
    return password


def _check_creds(path: Path | None) -> Path | None:
    if path is None:
        return None
    text = _read("nats_credentials_file", path)
    if b"NATS USER JWT" not in text or b"NKEY SEED" not in text:
        raise _error(
            "nats_credentials_file",
            f"{path} is not a NATS .creds file (a user JWT and an NKey seed block expected)",
        )
    if importlib.util.find_spec("nkeys") is None:
        raise _error(
            "nats_credentials_file",
            "needs the nkeys package (pip install 'nats-py[nkeys]')",
        )
    return path
