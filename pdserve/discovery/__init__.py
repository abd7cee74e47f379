"""Discovery: how workers announce themselves and how the router finds them.

Modules, in reading order:

- ``url``: which backend a URL names; the checks every backend applies to its inputs
- ``registration``: worker side: :class:`Registration`, its lifecycle once for every backend
- ``records``: router side: :class:`Watcher`, :class:`RecordTable` (signed records only)
- the backends: ``registry`` + ``http`` (the router's embedded registry and its HTTP
  client side; ``registry_store``: its SQLite store, shared by the router replicas of a host), ``etcd`` + ``etcd_client`` (etcd, TLS and a user), ``nats`` + ``nats_watcher``
  (a NATS JetStream key-value bucket, router side)
- ``load_events``: load and KV block counters on core NATS subjects; ``kvcache``: KV cache
  events (stored / removed block hashes) on the wire, toward the router's KV index
- ``tls``: TLS and user credentials toward etcd and NATS; ``retry``: backoff, task cancel

Backends, chosen by URL (see :func:`pdserve.discovery.url.parse_discovery_url`):

- ``http://host:port``: the router's embedded registry (:mod:`.registry`), reached over HTTP by
  workers (:mod:`.http`). ``embedded`` names it from inside the router process.
- ``etcd://host:port``: etcd via ``aetcd`` (:mod:`.etcd`), imported only when used.
- ``nats://host:port``: a NATS JetStream key-value bucket via ``nats-py`` (:mod:`.nats`, router
  side :mod:`.nats_watcher`), plus load / KV block events on core NATS subjects
  (:mod:`.load_events`); imported only when used.

etcd and NATS take TLS (CA, client certificate) and user credentials (etcd user + password
file, NATS ``.creds`` file) from ``DiscoverySettings``, passed as ``discovery=`` to
:func:`open_registration` / :func:`open_watcher` and checked there (:mod:`.tls`).

Every process of a deployment holds the cluster key (:class:`pdserve.security.ClusterKey`, from
the cluster secret): registrations sign their records and authenticate to the embedded
registry with it, watchers authenticate with it and drop records it did not sign.

Worker side::

    key = ClusterKey.from_settings(cfg.security)
    reg = open_registration(url, ttl_s=cfg.registration_ttl_s, key=key)
    await reg.start(record)        # registers, starts the refresh task (ttl_s / 3)
    await reg.update(record)       # ~1/s with fresh load
    await reg.close()              # deregisters; idempotent

Router side::

    registry = EmbeddedRegistry(ttl_s=cfg.discovery.registration_ttl_s, key=key)
    app.include_router(registry.api_router())      # internal: bearer token, not in OpenAPI
    watcher = open_watcher(cfg.discovery.url, registry=registry, key=key)  # or 'etcd://...'
    await watcher.start(); watcher.subscribe(cb); watcher.workers(); await watcher.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.discovery.records import RecordTable, Subscriber, Watcher
from pdserve.discovery.registration import Registration, RegistrationState
from pdserve.discovery.registry import EmbeddedRegistry, EmbeddedWatcher
from pdserve.discovery.url import DiscoveryURL, InvalidDiscoveryURLError, parse_discovery_url

if TYPE_CHECKING:
    from pdserve.config.settings import DiscoverySettings
    from pdserve.discovery.tls import ControlPlaneTLS
    from pdserve.security import ClusterKey

__all__ = [
    "DiscoveryURL",
    "EmbeddedRegistry",
    "EmbeddedWatcher",
    "InvalidDiscoveryURLError",
    "Registration",
    "RegistrationState",
    "Subscriber",
    "Watcher",
    "RecordTable",
    "open_registration",
    "open_watcher",
    "parse_discovery_url",
]


def open_registration(
    url: str,
    *,
    ttl_s: float,
    key: ClusterKey,
    discovery: DiscoverySettings | None = None,
) -> Registration:
    """Worker-side registration for ``url`` (``http://HOST:PORT``, ``etcd://HOST:PORT`` or
    ``nats://HOST:PORT``), holding the record under a TTL of ``ttl_s`` seconds, signed with
    the cluster ``key`` (which also authenticates it to the embedded registry).

    ``discovery``: the TLS and user credentials toward etcd / NATS (``ca_file``, ``cert_file``,
    ``key_file``, ``etcd_username`` + ``etcd_password_file``, ``nats_credentials_file``; see
    :mod:`pdserve.discovery.tls`); its files are read here. Ignored for ``http://``.

    Raises :class:`InvalidDiscoveryURLError` (a ``DiscoveryError`` and ``ValueError``) for a bad
    URL, ``ValueError`` for a bad TTL and :class:`~pdserve.errors.ConfigError` (naming the
    setting) for a missing, unreadable or malformed credentials file or half a pair. Nothing
    is contacted until ``start()``.
    """
    parsed = parse_discovery_url(url)
    tls = _control_plane_tls(parsed, discovery)
    if parsed.scheme == "etcd":
        from pdserve.discovery.etcd import EtcdRegistration

        return EtcdRegistration(parsed.host, parsed.port, ttl_s=ttl_s, key=key, tls=tls)
    if parsed.scheme == "nats":
        from pdserve.discovery.nats import NatsRegistration

        return NatsRegistration(parsed.host, parsed.port, ttl_s=ttl_s, key=key, tls=tls)
    from pdserve.discovery.http import HttpRegistration

    return HttpRegistration(parsed.base_url, ttl_s=ttl_s, key=key)


def open_watcher(
    url: str,
    *,
    registry: EmbeddedRegistry | None = None,
    key: ClusterKey,
    discovery: DiscoverySettings | None = None,
) -> Watcher:
    """Router-side watcher for ``url``; it keeps only records signed with the cluster ``key``
    (and authenticates with it to a remote embedded registry).

    - ``embedded`` (or an ``http(s)://`` URL together with ``registry``): watches ``registry``
      in-process; its ``start()`` / ``close()`` also start and stop the registry's sweep task.
    - ``http(s)://HOST:PORT`` without ``registry``: polls that router's registry over HTTP.
    - ``etcd://HOST:PORT``: lists and watches etcd.
    - ``nats://HOST:PORT``: watches the NATS bucket and consumes the workers' load events.

    ``discovery``: TLS and user credentials toward etcd / NATS, as for
    :func:`open_registration`.

    Raises :class:`InvalidDiscoveryURLError` for a bad URL, for ``embedded`` without a
    registry, and for ``etcd://`` or ``nats://`` with one (the two would disagree);
    :class:`~pdserve.errors.ConfigError` for unusable credentials files. Nothing is contacted
    until ``start()``.
    """
    parsed = parse_discovery_url(url, allow_embedded=True)
    tls = _control_plane_tls(parsed, discovery)
    if parsed.scheme in ("etcd", "nats"):
        if registry is not None:
            raise InvalidDiscoveryURLError(
                f"discovery URL {url!r} is {parsed.scheme}, but an embedded registry was passed "
                "too; the router hosts a registry only with 'embedded' / its own http:// URL",
                param="discovery",
            )
        if parsed.scheme == "nats":
            from pdserve.discovery.nats_watcher import NatsWatcher

            return NatsWatcher(parsed.host, parsed.port, key=key, tls=tls)
        from pdserve.discovery.etcd import EtcdWatcher

        return EtcdWatcher(parsed.host, parsed.port, key=key, tls=tls)
    if registry is not None:
        return EmbeddedWatcher(registry)  # the registry holds its own key
    if parsed.scheme == "embedded":
        raise InvalidDiscoveryURLError(
            "discovery URL 'embedded' needs the router's EmbeddedRegistry (registry=...)",
            param="discovery",
        )
    from pdserve.discovery.http import HttpWatcher

    return HttpWatcher(parsed.base_url, key=key)


def _control_plane_tls(
    parsed: DiscoveryURL, discovery: DiscoverySettings | None
) -> ControlPlaneTLS | None:
    """The checked TLS / credentials settings for an etcd or NATS URL (None otherwise)."""
    if parsed.scheme not in ("etcd", "nats"):
        return None
    from pdserve.discovery.tls import ControlPlaneTLS

    return ControlPlaneTLS.from_settings(discovery)
