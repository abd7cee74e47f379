"""The control connection: framed messages and raw byte streams over one TCP connection.

Design origin: the TensorRT-LLM seed's *Connection* (send/receive over a bidirectional stream).
Every transceiver uses one :class:`Connection` per peer request for its control messages
(:mod:`pdserve.transfer.wire`), whatever the backend; the TCP backend
(:mod:`pdserve.transfer.agents.tcp`) also streams the KV bytes on it, and the bandwidth probe
(:mod:`pdserve.transfer.bandwidth_probe`) uses it as is.

Why raw non-blocking sockets and not asyncio streams: ``StreamReader`` has no ``readinto`` (every
read allocates a ``bytes`` and the pool copy is a second pass) and ``StreamWriter.write`` copies
what the kernel did not take into its own buffer. Here ``sendmsg`` / ``recvmsg_into`` move bytes
between the socket and ``memoryview`` slices of the pool with no Python-level copy, many
segments per system call (scatter-gather), waiting for readiness on the event loop in between;
reads never run ahead of a frame, so the bytes after a :class:`~pdserve.transfer.wire.BlockData`
header land directly in the pool. (Per-segment ``loop.sock_recv_into`` measured about half the
raw-socket rate on 1-16 MiB requests; see :mod:`pdserve.bench.transfer.bench_transfer`.) The Python work
per system call does not grow with the number of segments (prefix sums + bisect), and a call
that would block first polls for :data:`SPIN_S` (yielding the CPU) before waiting in epoll.

Thread-safety: use a Connection from its event loop's thread only; one coroutine at a time sends
and one receives (callers hold the connection for a whole request).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import os
import socket
import time

import numpy as np

from pdserve.errors import TransferError
from pdserve.transfer import wire

_IOV_MAX = 1024
"""Buffers per sendmsg/recvmsg_into call (Linux IOV_MAX)."""

SPIN_S = 0.0002
"""How long a send or receive that would block polls the socket (yielding the CPU and the event
loop in between) before it waits for readiness in epoll. A control answer usually comes within
that time, and waking a process from epoll costs tens of microseconds more on this 2-core VM: a
control-frame round trip between two processes measured 68-84 us p50 with it, 121-127 us
without (load average 2). A wait that outlasts it costs at most this much CPU."""

FRAME_TIMEOUT_S = 10.0
"""Seconds the rest of a control frame may take once its 4-byte header arrived (frames are a
few KiB; the largest, a Hello with NIXL metadata, is well under 1 MiB)."""
FRAME_CHUNK_BYTES = 64 * 1024
"""A frame's buffer grows by at most this much per read: a header announcing 16 MiB costs
16 MiB only once 16 MiB arrived."""

SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
"""SO_SNDBUF/SO_RCVBUF asked for (the kernel may clamp it): fewer wake-ups per MiB."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``"[::1]:port"``) -> ``(host, port)``; raises TransferError."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise TransferError(f"bad transfer endpoint {endpoint!r}, expected host:port")
    return host.strip("[]"), int(port)


KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
"""A silent peer (partition, crashed host) is declared dead after about 10 + 3 * 5 = 25 s of
silence, so neither side keeps a half-open transfer connection (an fd and a task) forever."""


def tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay on small control frames, TCP keepalive, larger kernel
    buffers."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ):
            if hasattr(socket, name):  # Linux; other systems keep their defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


class Connection:
    """One established TCP connection carrying framed control messages and raw KV bytes.

    Owns ``sock`` (closed by :meth:`close`). Every failure of the peer (reset, EOF, garbage)
    surfaces as :class:`~pdserve.errors.TransferError` naming ``peer``.
    """

    def __init__(self, sock: socket.socket, peer: str):
        tune(sock)
        self.sock = sock
        self.peer = peer
        self._loop = asyncio.get_running_loop()
        self._header = bytearray(wire.HEADER.size)
        self.closed = False

    @classmethod
    async def open(cls, endpoint: str, timeout: float) -> Connection:
        """Connect to ``endpoint`` within ``timeout`` seconds; raises TransferError."""
        host, port = split_endpoint(endpoint)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise TransferError(f"transfer peer {endpoint} unreachable: {exc}") from exc
        try:
            sock.setblocking(False)
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, addr)
        except (OSError, TimeoutError) as exc:
            sock.close()
            why = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            raise TransferError(f"transfer peer {endpoint} unreachable: {why}") from exc
        except BaseException:
            # Cancelled, e.g. by the caller's own deadline (the receiver's pull timeout always
            # ends first): close now, or the kernel keeps retrying the SYN and the connection
            # opens, unused, once a partition heals (then lingers in CLOSE_WAIT until GC).
            sock.close()
            raise
        return cls(sock, endpoint)

    async def send(self, msg: wire._Wire) -> None:
        """Send one control frame."""
        await self._sendall(wire.encode(msg))

    async def recv(self, limit: int = wire.MAX_FRAME_BYTES) -> wire.Message:
        """Receive exactly one control frame (never reads past it). A frame announcing more
        than ``limit`` bytes raises TransferError before anything is allocated for it (pass
        :data:`~pdserve.transfer.wire.PREAUTH_MAX_FRAME_BYTES` before the peer is
        authenticated).

        Waiting for a frame to *start* is the caller's business (an idle connection may stay
        silent); once its header arrived, the rest must follow within :data:`FRAME_TIMEOUT_S`
        (else TransferError and the connection closes: a peer cannot hold a handler with a
        trickle), and memory for it grows as its bytes arrive, in steps of at most
        :data:`FRAME_CHUNK_BYTES`, never to the announced length up front."""
        header = memoryview(self._header)
        if (got := self._recv_now(header)) < len(header):  # else the frame waits to start
            await self._recv_into(header[got:])
        length = wire.frame_length(bytes(self._header), limit)
        # What already arrived is read without an event-loop turn or a deadline (a control
        # answer usually is whole by now); only a frame still arriving gets its deadline.
        payload = bytearray(min(length, FRAME_CHUNK_BYTES))
        got = self._recv_now(memoryview(payload))
        if got == length:
            return wire.decode(payload)
        try:
            async with asyncio.timeout(FRAME_TIMEOUT_S):
                if got < len(payload):
                    await self._recv_into(memoryview(payload)[got:])
                while len(payload) < length:
                    chunk = bytearray(min(length - len(payload), FRAME_CHUNK_BYTES))
                    await self._recv_into(memoryview(chunk))
                    payload += chunk
        except TimeoutError:
            self.close()
            raise TransferError(
                f"transfer peer {self.peer} sent part of a {length}-byte frame but not the rest "
                f"within {FRAME_TIMEOUT_S:.0f} s"
            ) from None
        return wire.decode(payload)

    async def send_segments(
        self,
        pool: memoryview,
        offsets: np.ndarray,
        lengths: np.ndarray,
        header: wire.Message | None = None,
    ) -> None:
        """Stream the control frame ``header`` (if any), then ``pool[offsets[k] : offsets[k] +
        lengths[k]]`` for every k, in order, no copy (gathered: one ``sendmsg`` takes as many
        segments as the kernel buffer holds)."""
        views = _slices(pool, offsets, lengths)
        if header is not None:
            views.insert(0, memoryview(wire.encode(header)))
        await self._io(views, send=True)

    async def recv_segments(
        self, pool: memoryview, offsets: np.ndarray, lengths: np.ndarray
    ) -> None:
        """Fill ``pool[offsets[k] : offsets[k] + lengths[k]]`` for every k, in order, from the
        stream (scattered: the kernel copies straight into the pool, many segments per call)."""
        await self._io(_slices(pool, offsets, lengths), send=False)

    def has_input(self) -> bool:
        """True if the peer sent something or closed the connection (never blocks, consumes
        nothing). For an idle connection, or one the peer should be silent on, that means it
        is unusable or the peer wants to stop."""
        if self.closed:
            return True
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # b"" (EOF) or a byte: input either way
            return True
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        """Idempotent."""
        if not self.closed:
            self.closed = True
            self.sock.close()

    async def _sendall(self, data: bytes) -> None:
        await self._io([memoryview(data)], send=True)

    async def _recv_into(self, view: memoryview) -> None:
        await self._io([view], send=False)

    def _recv_now(self, view: memoryview) -> int:
        """Fill ``view`` from what the socket holds now, never waiting: the bytes read (less
        than ``len(view)`` when the socket ran dry). Raises TransferError (and closes) on EOF
        or a socket error, like :meth:`_io`."""
        done, size = 0, len(view)
        try:
            while done < size:
                n = self.sock.recv_into(view[done:] if done else view)
                if n == 0:
                    raise TransferError(
                        f"transfer peer {self.peer} closed the connection "
                        f"({done} of {size} bytes of a read received)"
                    )
                done += n
        except (BlockingIOError, InterruptedError):
            return done
        except OSError as exc:
            self.close()
            raise TransferError(f"transfer peer {self.peer} lost while receiving: {exc}") from exc
        except BaseException:
            self.close()
            raise
        return done

    async def _io(self, views: list[memoryview], *, send: bool) -> None:
        """Send (``sendmsg``) or fill (``recvmsg_into``) ``views`` completely, in order, waiting
        for socket readiness on the event loop in between.

        Per system call the Python work is O(log segments), not O(segments): where the kernel
        stopped is found by bisecting the prefix sums of the view lengths, and only the view it
        stopped in is re-sliced (``ends[k]`` = bytes up to the end of view k)."""
        ends = list(itertools.accumulate(map(len, views)))
        total, done, i = (ends[-1] if ends else 0), 0, 0
        spin_until: float | None = None
        try:
            while done < total:
                start = ends[i] - len(views[i])  # stream position where view i begins
                batch = views[i : i + _IOV_MAX]
                if done > start:
                    batch[0] = batch[0][done - start :]
                try:
                    n = self.sock.sendmsg(batch) if send else self.sock.recvmsg_into(batch)[0]
                except (BlockingIOError, InterruptedError):
                    now = time.monotonic()
                    if spin_until is None:
                        spin_until = now + SPIN_S
                    if now < spin_until:  # the peer is likely mid-answer: poll, yielding
                        os.sched_yield()
                        await asyncio.sleep(0)
                    else:
                        await self._ready(send)
                    continue
                if n == 0 and not send:
                    raise TransferError(
                        f"transfer peer {self.peer} closed the connection "
                        f"({done} of {total} bytes of a read received)"
                    )
                done += n
                i = bisect.bisect_right(ends, done)  # first view not yet complete
        except OSError as exc:
            self.close()
            what = "sending" if send else "receiving"
            raise TransferError(f"transfer peer {self.peer} lost while {what}: {exc}") from exc
        except BaseException:
            self.close()  # a half-done frame or stream cannot be resumed
            raise

    async def _ready(self, write: bool) -> None:
        fut = self._loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        fd = self.sock.fileno()
        if write:
            self._loop.add_writer(fd, wake)
        else:
            self._loop.add_reader(fd, wake)
        try:
            await fut
        finally:
            if write:
                self._loop.remove_writer(fd)
            else:
                self._loop.remove_reader(fd)


def _slices(pool: memoryview, offsets: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
    return [pool[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]
