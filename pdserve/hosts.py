"""Host names and addresses as pdserve binds and advertises them (a leaf of the settings).

- :data:`WILDCARD_HOSTS`: bind addresses meaning every interface
- :func:`is_loopback`: whether a bind address stays on this machine
- :func:`url_host`: a host as it goes into a URL (IPv6 in brackets)
- :func:`advertised_host`: the address peers dial for a bind address
"""

from __future__ import annotations

import ipaddress
import socket

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
"""Bind addresses that mean every interface."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def url_host(host: str) -> str:
    """``host`` as it goes into a URL: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The address peers dial: ``advertise_host``, else ``host``, else (wildcard bind) this
    machine's hostname, which compose and Kubernetes DNS resolve."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in WILDCARD_HOSTS else host
