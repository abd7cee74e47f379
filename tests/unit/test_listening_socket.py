"""A server's port cannot be taken from under it (:mod:`pdserve.config.hosts`).

Linux lets two sockets with SO_REUSEADDR bind one port while neither listens, and the first to
listen wins. CI lost a test stack's worker to that: the worker bound port 0, loaded its model for
seconds before listening, and a server given a port picked a moment earlier bound and listened
on the same one (``OSError: [Errno 98] Address already in use`` from the worker's ``listen``).
:func:`pdserve.config.hosts.listening_socket` listens at once (SO_REUSEADDR kept, for restarts);
:func:`pdserve.config.hosts.free_port` picks ports for servers started later out of the kernel's
ephemeral range, where no ``bind(0)`` or outgoing connection lands in the meantime.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest

from pdserve.config import hosts
from pdserve.config.hosts import listening_socket


def _rival(port: int) -> socket.socket:
    """A fixed-port server's socket on ``port`` (bound and listening with SO_REUSEADDR, as
    uvicorn binds a host and port); raises OSError when the port is taken."""
    rival = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rival.bind(("127.0.0.1", port))
        rival.listen(1)
    except OSError:
        rival.close()
        raise
    return rival


def test_the_race_exists_for_a_socket_that_binds_and_listens_later() -> None:
    """The control: the way the worker bound its socket before loses the port."""
    late = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    late.bind(("127.0.0.1", 0))
    rival = _rival(late.getsockname()[1])
    try:
        with pytest.raises(OSError) as err:
            late.listen(1)
        assert err.value.errno == errno.EADDRINUSE
    finally:
        rival.close()
        late.close()


def test_a_port_the_os_picked_stays_with_its_socket() -> None:
    sock = listening_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert port != 0
        with pytest.raises(OSError) as err:
            _rival(port).close()
        assert err.value.errno == errno.EADDRINUSE
        client = socket.create_connection(("127.0.0.1", port), timeout=5)  # queued: listening
        conn, _ = sock.accept()
        conn.close()
        client.close()
    finally:
        sock.close()


def test_a_restart_rebinds_the_port_over_its_old_connections_time_wait() -> None:
    """A transceiver restarted on the port it had picked (the fencing tests' prefill restart):
    the first listener's accepted connection, closed by the server side first, sits in
    TIME_WAIT with the listener's SO_REUSEADDR, which the new listener needs."""
    first = listening_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn, _ = first.accept()
    conn.close()  # the server closes first: its side goes to TIME_WAIT
    assert client.recv(1) == b""
    client.close()
    first.close()
    again = listening_socket("127.0.0.1", port)
    try:
        assert again.getsockname()[1] == port
    finally:
        again.close()


def test_nodelay_is_set_on_a_tcp_socket() -> None:
    sock = listening_socket("localhost", 0, nodelay=True)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_free_port_is_out_of_the_range_the_os_picks_from() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {hosts.free_port() for _ in range(20)}
    assert all(hosts.FREE_PORT_FLOOR <= p < low for p in ports)
    assert len(ports) > 1  # random, not one port every time
    for port in ports:  # each one binds
        listening_socket("127.0.0.1", port).close()


def test_free_port_skips_a_taken_port_and_falls_back_to_the_os(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = listening_socket("127.0.0.1", hosts.free_port())
    try:
        port = taken.getsockname()[1]
        monkeypatch.setattr(hosts, "FREE_PORT_FLOOR", port)
        monkeypatch.setattr(hosts, "_ephemeral_low", lambda: port + 1024)
        picks = {hosts.free_port() for _ in range(20)}
        assert port not in picks
        assert all(port < p < port + 1024 for p in picks)
        monkeypatch.setattr(hosts, "_ephemeral_low", lambda: port + 1)  # no room below
        assert hosts.free_port() >= 1024  # the OS's pick
    finally:
        taken.close()
