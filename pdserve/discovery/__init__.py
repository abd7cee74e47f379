"""Discovery: how workers announce themselves and how the router finds them.

Backends, chosen by URL (see :func:`pdserve.discovery.base.parse_discovery_url`):

- ``http://host:port``: the router's embedded registry (:mod:`.registry`), reached over HTTP by
  workers (:mod:`.http`). ``embedded`` names it from inside the router process.
- ``etcd://host:port``: etcd via ``aetcd`` (:mod:`.etcd`), imported only when used.
- ``nats://host:port``: a NATS JetStream key-value bucket via ``nats-py`` (:mod:`.nats`, router
  side :mod:`.nats_watcher`), plus load / KV block events on core NATS subjects
  (:mod:`.events`); imported only when used.

Worker side::

    reg = open_registration(cfg.discovery, ttl_s=cfg.registration_ttl_s)
    await reg.start(record)        # registers, starts the refresh task (ttl_s / 3)
    await reg.update(record)       # ~1/s with fresh load
    await reg.close()              # deregisters; idempotent

Router side::

    registry = EmbeddedRegistry(ttl_s=cfg.discovery.registration_ttl_s)
    app.include_router(registry.api_router())
    watcher = open_watcher(cfg.discovery.url, registry=registry)   # 'embedded' or 'etcd://...'
    await watcher.start(); watcher.subscribe(cb); watcher.workers(); await watcher.close()
"""

from __future__ import annotations

from pdserve.discovery.base import (
    DiscoveryURL,
    InvalidDiscoveryURLError,
    RecordTable,
    Registration,
    RegistrationState,
    Subscriber,
    Watcher,
    parse_discovery_url,
)
from pdserve.discovery.registry import EmbeddedRegistry, EmbeddedWatcher

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


def open_registration(url: str, *, ttl_s: float) -> Registration:
    """Worker-side registration for ``url`` (``http://HOST:PORT``, ``etcd://HOST:PORT`` or
    ``nats://HOST:PORT``), holding the record under a TTL of ``ttl_s`` seconds.

    Raises :class:`InvalidDiscoveryURLError` (a ``DiscoveryError`` and ``ValueError``) for a bad
    URL and ``ValueError`` for a bad TTL. Nothing is contacted until ``start()``.
    """
    parsed = parse_discovery_url(url)
    if parsed.scheme == "etcd":
        from pdserve.discovery.etcd import EtcdRegistration

        return EtcdRegistration(parsed.host, parsed.port, ttl_s=ttl_s)
    if parsed.scheme == "nats":
        from pdserve.discovery.nats import NatsRegistration

        return NatsRegistration(parsed.host, parsed.port, ttl_s=ttl_s)
    from pdserve.discovery.http import HttpRegistration

    return HttpRegistration(parsed.base_url, ttl_s=ttl_s)


def open_watcher(url: str, *, registry: EmbeddedRegistry | None = None) -> Watcher:
    """Router-side watcher for ``url``.

    - ``embedded`` (or an ``http(s)://`` URL together with ``registry``): watches ``registry``
      in-process; its ``start()`` / ``close()`` also start and stop the registry's sweep task.
    - ``http(s)://HOST:PORT`` without ``registry``: polls that router's registry over HTTP.
    - ``etcd://HOST:PORT``: lists and watches etcd.
    - ``nats://HOST:PORT``: watches the NATS bucket and consumes the workers' load events.

    Raises :class:`InvalidDiscoveryURLError` for a bad URL, for ``embedded`` without a
    registry, and for ``etcd://`` or ``nats://`` with one (the two would disagree). Nothing is
    contacted until ``start()``.
    """
    parsed = parse_discovery_url(url, allow_embedded=True)
    if parsed.scheme in ("etcd", "nats"):
        if registry is not None:
            raise InvalidDiscoveryURLError(
                f"discovery URL {url!r} is {parsed.scheme}, but an embedded registry was passed "
                "too; the router hosts a registry only with 'embedded' / its own http:// URL",
                param="discovery",
            )
        if parsed.scheme == "nats":
            from pdserve.discovery.nats_watcher import NatsWatcher

            return NatsWatcher(parsed.host, parsed.port)
        from pdserve.discovery.etcd import EtcdWatcher

        return EtcdWatcher(parsed.host, parsed.port)
    if registry is not None:
        return EmbeddedWatcher(registry)
    if parsed.scheme == "embedded":
        raise InvalidDiscoveryURLError(
            "discovery URL 'embedded' needs the router's EmbeddedRegistry (registry=...)",
            param="discovery",
        )
    from pdserve.discovery.http import HttpWatcher

    return HttpWatcher(parsed.base_url)
