"""Discovery URLs: which backend a URL names, and the checks every backend applies to its
inputs (registration TTL, worker id)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from pdserve.errors import DiscoveryError

_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


ACCEPTED_FORMS = (
    "'http://HOST:PORT' (the router's embedded registry), 'etcd://HOST:PORT' (etcd, port "
    "defaults to 2379) or 'nats://HOST:PORT' (NATS JetStream, port defaults to 4222)"
)


class InvalidDiscoveryURLError(DiscoveryError, ValueError):
    """A discovery URL that no backend accepts. Also a ``ValueError`` (bad configuration)."""

    code = "invalid_discovery_url"


@dataclass(frozen=True)
class DiscoveryURL:
    """A parsed discovery URL. ``base_url`` is the HTTP base for ``http``/``https``."""

    scheme: Literal["embedded", "http", "https", "etcd", "nats"]
    host: str = ""
    port: int = 0
    base_url: str = ""


def parse_discovery_url(url: str, *, allow_embedded: bool = False) -> DiscoveryURL:
    """Parse ``url``; raise :class:`InvalidDiscoveryURLError` naming it and the accepted forms.

    ``embedded`` (the router's in-process registry) is accepted only when ``allow_embedded``.
    """
    forms = ACCEPTED_FORMS + (", or 'embedded' (in-process)" if allow_embedded else "")

    def bad(why: str) -> InvalidDiscoveryURLError:
        return InvalidDiscoveryURLError(
            f"invalid discovery URL {url!r}: {why}; accepted forms: {forms}", param="discovery"
        )

    if not isinstance(url, str) or not url.strip():
        raise bad("empty")
    url = url.strip()
    if url == "embedded":
        if not allow_embedded:
            raise bad("'embedded' names the router's in-process registry, use the router's URL")
        return DiscoveryURL("embedded")
    if "://" not in url:
        raise bad("missing scheme")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https", "etcd", "nats"):
        raise bad(f"unknown scheme {parts.scheme!r}")
    if "," in parts.netloc:
        raise bad("only one endpoint is supported")
    try:
        port = parts.port
    except ValueError as exc:
        raise bad(f"bad port ({exc})") from None
    host = parts.hostname or ""
    if not host:
        raise bad("missing host")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise bad("credentials, query and fragment are not supported")
    if scheme in ("etcd", "nats"):
        if parts.path not in ("", "/"):
            raise bad(f"{scheme} URLs take no path (got {parts.path!r})")
        default = 2379 if scheme == "etcd" else 4222
        return DiscoveryURL(scheme, host, port or default)  # type: ignore[arg-type]
    default_port = 443 if scheme == "https" else 80
    base = f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    return DiscoveryURL(scheme, host, port or default_port, base)  # type: ignore[arg-type]


def check_ttl(ttl_s: float) -> float:
    """Validate a registration TTL in seconds (finite, > 0); return it as a float."""
    if not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")
    return float(ttl_s)


def check_worker_id(worker_id: str) -> str:
    """Worker ids become URL path segments and etcd keys: 1-128 of ``[A-Za-z0-9._:@-]``."""
    if not _WORKER_ID.fullmatch(worker_id):
        raise ValueError(
            f"worker_id {worker_id!r} must be 1-128 characters of [A-Za-z0-9._:@-], "
            "starting with a letter or digit"
        )
    return worker_id
