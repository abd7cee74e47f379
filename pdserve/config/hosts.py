"""Host names and addresses as pdserve binds and advertises them (a leaf of the settings).

- :data:`WILDCARD_HOSTS`: bind addresses meaning every interface
- :func:`is_loopback`: whether a bind address stays on this machine
- :func:`url_host`: a host as it goes into a URL (IPv6 in brackets)
- :func:`advertised_host`: the address peers dial for a bind address
- :func:`listening_socket`: a TCP socket bound and listening at once (port 0 without a race)
- :func:`free_port`: a port for a server started later, out of the way of OS-picked ports
"""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
"""Bind addresses that mean every interface."""

FREE_PORT_FLOOR = 10_000
"""The lowest port :func:`free_port` picks from (below it: well-known services' habits)."""
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICKS = random.SystemRandom()  # not the random module's state, which a test may seed


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


def listening_socket(
    host: str,
    port: int,
    *,
    nodelay: bool = False,
    backlog: int = 2048,
    reuse_port: bool = False,
    listen: bool = True,
) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` and already listening (``backlog`` connections;
    the kernel caps it at ``somaxconn``). ``port`` 0: the OS picks (read it back with
    ``getsockname()``); ``host`` ``""``: every interface. ``nodelay``: TCP_NODELAY, which the
    connections it accepts inherit. The caller owns the socket (uvicorn or asyncio may listen on
    it again, which only resets the backlog).

    It listens before it is returned. Linux lets a socket with SO_REUSEADDR (set here, so that
    a restart rebinds a fixed port over its old connections' TIME_WAIT: those inherit the
    listener's flag) bind a port another such socket holds as long as neither listens, and the
    first ``listen()`` wins: a worker that bound port 0 and listened only after its model loaded
    (seconds) lost its port to a router given the same number a moment before (CI saw
    ``OSError: [Errno 98] Address already in use`` from the worker's ``listen``). A listening
    socket's port cannot be bound by anyone else.

    ``reuse_port``: SO_REUSEPORT, so that other processes of this user that set it too listen on
    the same port, the kernel spreading new connections over the listeners (router replicas).
    ``listen=False`` (with ``reuse_port`` only) returns it bound but not listening: it gets no
    connection until its server listens (asyncio's ``create_server`` does, once the app has
    started), so a replica that is still starting takes no share of the port.

    Raises OSError (``socket.gaierror`` when ``host`` does not resolve; EADDRINUSE when a fixed
    port is taken)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        if listen or not reuse_port:
            sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: ``ip_local_port_range``, 32768
    by default; elsewhere assumed 32768)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` (``""``: every interface) that nothing held a moment ago, for a
    server that binds it later (a child process given the number).

    It is picked at random between :data:`FREE_PORT_FLOOR` and the kernel's ephemeral range,
    not by binding port 0: a port the OS picked is one the OS picks again, for the next
    ``bind(0)`` or outgoing connection, so in the moment before the server binds it, a worker
    of the same stack could take it (the server then fails with EADDRINUSE). Out of the
    ephemeral range only another caller of this function can, which needs the same random
    pick. When the ephemeral range leaves no room below it, the OS picks. Raises OSError when
    ``host`` cannot be bound at all."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    top = _ephemeral_low()
    for _ in range(64 if top - FREE_PORT_FLOOR >= 1024 else 0):
        port = _PICKS.randrange(FREE_PORT_FLOOR, top)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
