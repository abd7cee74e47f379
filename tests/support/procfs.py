"""What ``/proc`` tells a test about a process: its children, its argv, its listening sockets.

Linux only (the suites that use it start real processes). Every function answers an empty
value for a process that is gone rather than raising, so a caller may poll a process that is
exiting.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def children(pid: int) -> list[int]:
    """The child pids of ``pid`` (every thread's), [] when it is gone."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (children, their children, ...), parents first."""
    found: list[int] = []
    todo = children(pid)
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo += children(child)
    return found


def cmdline(pid: int) -> list[str]:
    """The argv of ``pid`` ([] when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _address(hex_addr: str) -> str:
    """``/proc/net/tcp{,6}``'s hex address (32-bit words in host order, little-endian here)
    as text: ``0100007F`` -> ``127.0.0.1``."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listeners(pid: int) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket ``pid`` listens on now (its socket fds matched
    to the LISTEN rows of its network namespace's ``/proc/<pid>/net/tcp{,6}``; ``0.0.0.0`` or
    ``::``: every interface), empty when it is gone."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                addr, port = cols[1].rsplit(":", 1)
                found.add((_address(addr), int(port, 16)))
    return found


def listening_ports(pid: int) -> set[int]:
    """The TCP ports ``pid`` listens on now (:func:`listeners`), empty when it is gone."""
    return {port for _, port in listeners(pid)}
