"""Bandwidth probe between this host and a worker's transceiver (``pdserve doctor --peer``).

Design origin: the doctor's need to measure the bandwidth between this host and a named worker, and
the raw-socket reference of :mod:`pdserve.bench.transfer.bench_transfer`: what the network path between two
hosts carries, measured through the worker's own transfer listener, so it needs no extra port,
no model and no peer configuration.

Conversation on a fresh connection to the worker's transfer endpoint
(:mod:`pdserve.transfer.wire`)::

    doctor <-> worker AuthHello, AuthChallenge, AuthProof      challenge-response on the cluster
                                                              secret, both ways, as for a decode
                                                              worker (pdserve.transfer.connection.auth)
    doctor -> worker  Probe(nbytes)                            instead of a Hello
    worker -> doctor  ProbeData(worker id, epoch, backend, layout, nbytes) + nbytes raw bytes
    ... any number of probes, one at a time; the doctor closes the connection

Safety of the serving side: only for a peer that proved it holds the cluster secret (the
doctor needs it: ``--cluster-secret-file``), read-only and bounded. The bytes are zeros from a
constant 1 MiB buffer (never the KV pool: it holds other users' K/V), at most
:data:`~pdserve.transfer.wire.PROBE_MAX_BYTES` per probe (a larger Probe fails validation and
closes the connection), at most :data:`MAX_PROBES_PER_CONNECTION` probes and
:data:`MAX_PROBE_BYTES_PER_CONNECTION` bytes per connection (then it is closed), no parked block, lease or handshake state is touched, and the
connection is served like any other (one task; closing the transceiver ends it).

What it measures: TCP between the two hosts, with the transfer connection's socket options
(:func:`pdserve.transfer.connection.control.tune`): the path of the TCP backend and of UCX's TCP transport,
not a NIXL/UCX transfer itself (that needs a registered pool on both sides).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from pdserve.errors import TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer import wire
from pdserve.transfer.connection import auth
from pdserve.transfer.connection.control import Connection

if TYPE_CHECKING:
    from pdserve.security import ClusterKey
    from pdserve.transfer.connection.handshake import LocalSide

CHUNK_BYTES = 1 << 20
MAX_PROBES_PER_CONNECTION = 64
"""Probes one connection may ask for (the doctor sends 26); the next closes it."""
MAX_PROBE_BYTES_PER_CONNECTION = 4 << 30
"""Bytes one connection's probes may ask for in all (the doctor's default run: 384 MiB)."""
_ZEROS = bytes(CHUNK_BYTES)  # immutable: the only source of probe bytes


def chunks(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """``nbytes`` as segments of one CHUNK_BYTES buffer: (offsets, lengths), int64, every
    offset 0 (the same buffer is sent, or received into, again and again)."""
    full, rest = divmod(nbytes, CHUNK_BYTES)
    lengths = np.full(full + (1 if rest else 0), CHUNK_BYTES, dtype=np.int64)
    if rest:
        lengths[-1] = rest
    return np.zeros(lengths.size, dtype=np.int64), lengths


async def serve_probes(conn: Connection, first: wire.Probe, local: LocalSide) -> NoReturn:
    """Serving side: answer ``first`` and every later Probe on ``conn`` until the doctor
    closes it. Always ends by raising TransferError (closed connection, or anything but a
    Probe, which is a protocol error)."""
    msg: wire.Message = first
    zeros = memoryview(_ZEROS)
    probes = sent = 0
    while True:
        if not isinstance(msg, wire.Probe):
            raise TransferError(f"unexpected {msg.type!r} on a probe connection from {conn.peer}")
        probes, sent = probes + 1, sent + msg.nbytes
        if probes > MAX_PROBES_PER_CONNECTION or sent > MAX_PROBE_BYTES_PER_CONNECTION:
            raise TransferError(f"probe budget of the connection from {conn.peer} exhausted")
        header = wire.ProbeData(
            worker_id=local.worker_id,
            epoch=local.epoch,
            backend=local.backend.name,
            layout=local.layout,
            nbytes=msg.nbytes,
        )
        offsets, lengths = chunks(msg.nbytes)
        await conn.send_segments(zeros, offsets, lengths, header)
        msg = await conn.recv()


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe` measured. ``rtt_s``: seconds per zero-byte probe (request + answer);
    ``transfer_s``: seconds per ``nbytes`` probe (request + answer + bytes)."""

    endpoint: str
    worker_id: str
    epoch: int
    backend: str
    layout: KVLayout
    protocol_version: int
    nbytes: int
    rtt_s: list[float]
    transfer_s: list[float]

    @property
    def rtt_p50_ms(self) -> float:
        return statistics.median(self.rtt_s) * 1e3

    @property
    def gbps_p50(self) -> float:
        """GB/s (1e9 bytes) of the median ``nbytes`` probe."""
        return self.nbytes / statistics.median(self.transfer_s) / 1e9

    @property
    def gbps_best(self) -> float:
        return self.nbytes / min(self.transfer_s) / 1e9


async def probe(
    endpoint: str,
    *,
    key: ClusterKey,
    nbytes: int = 64 * CHUNK_BYTES,
    reps: int = 5,
    rtt_reps: int = 20,
    timeout_s: float = 30.0,
) -> ProbeResult:
    """Measure round trips (``rtt_reps`` zero-byte probes) and bandwidth (one warm-up and
    ``reps`` probes of ``nbytes``) to the transceiver at ``endpoint`` ("host:port"), all
    within ``timeout_s``, after authenticating both ways with ``key`` (the deployment's
    cluster secret). Raises TransferError (``kv_auth_failed``: the worker holds another
    secret or cannot prove it holds ours; unreachable, timeout, not a pdserve transceiver that
    knows probes) and ValueError for ``nbytes`` outside 1 .. PROBE_MAX_BYTES."""
    if not 0 < nbytes <= wire.PROBE_MAX_BYTES:
        raise ValueError(f"probe size must be 1 .. {wire.PROBE_MAX_BYTES} bytes, got {nbytes}")
    conn = await Connection.open(endpoint, timeout_s)
    buf = memoryview(bytearray(CHUNK_BYTES))
    try:
        async with asyncio.timeout(timeout_s):
            await auth.dial(conn, key, auth.PROBE_PEER_ID)
            info, _ = await _one(conn, 0, buf)
            rtt = [(await _one(conn, 0, buf))[1] for _ in range(rtt_reps)]
            await _one(conn, nbytes, buf)  # warm-up: socket buffers, page faults
            times = [(await _one(conn, nbytes, buf))[1] for _ in range(reps)]
    except TimeoutError as exc:
        raise TransferError(f"probe of {endpoint} timed out after {timeout_s:.1f} s") from exc
    finally:
        conn.close()
    return ProbeResult(
        endpoint=endpoint,
        worker_id=info.worker_id,
        epoch=info.epoch,
        backend=info.backend,
        layout=info.layout,
        protocol_version=info.protocol_version,
        nbytes=nbytes,
        rtt_s=rtt,
        transfer_s=times,
    )


async def _one(conn: Connection, nbytes: int, buf: memoryview) -> tuple[wire.ProbeData, float]:
    t0 = time.perf_counter()
    await conn.send(wire.Probe(nbytes=nbytes))
    try:
        msg = await conn.recv()
    except TransferError as exc:
        raise TransferError(
            f"{conn.peer} closed the probe ({exc.message}); is it a pdserve transfer endpoint "
            "of this version?"
        ) from exc
    auth.check_refused(msg, conn.peer)  # the answer to the first probe carries the verdict
    if not isinstance(msg, wire.ProbeData) or msg.nbytes != nbytes:
        raise TransferError(f"{conn.peer} answered a probe with {msg.type!r}")
    offsets, lengths = chunks(nbytes)
    await conn.recv_segments(buf, offsets, lengths)
    return msg, time.perf_counter() - t0
