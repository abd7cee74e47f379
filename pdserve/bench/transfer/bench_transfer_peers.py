"""The processes of the transfer benchmark (:mod:`pdserve.bench.transfer.bench_transfer`), one role each.

Each measurement runs in fresh child processes started by the benchmark with an environment of
its own (e.g. ``UCX_TLS=tcp`` for "NIXL over TCP"), because UCX reads its transports from the
environment when a context is created and the benchmark's own process must not be configured
through ``os.environ``. Roles (``python -m pdserve.bench.transfer.bench_transfer_peers ROLE SPEC``)::

    serve    a prefill-side transceiver over a pool of ``max(blocks)`` blocks that all count as
             parked (:class:`AllParked`); prints {"endpoint", "backend"}; runs until stdin closes
    pull     a decode-side transceiver pulling 0..n-1 -> 0..n-1 from ``spec.endpoint`` for every
             n of ``spec.blocks``, once per integrity setting; prints the times and checks bytes
    source   raw-socket reference, sending side: answers an 8-byte size with that many bytes
    sink     raw-socket reference, receiving side: asks for each size, ``recv_into`` a buffer
    memcpy   in-process reference: ``numpy.copyto`` of the same byte counts

The transceivers authenticate each other like workers do (:mod:`pdserve.transfer.connection.auth`), with
the cluster secret the parent hands down in :data:`SECRET_ENV` (a fresh one per case); the
handshake runs once per connection, so the timed pulls carry no authentication cost.

:class:`PatternPeer` is the same serving side for ``pdserve bench gpu`` and the GPU tests: a
spawned process whose pool lives on a chosen device (CPU or CUDA) filled with :func:`pattern`,
with the blocks to serve parked through a pipe, so the calling process can pull and check them.

Results are one line ``PDSERVE-BENCH <json>`` on stdout (libraries may print there too). Every
timing is a list of seconds per repetition after one warm-up: at least ``min_reps`` and until
``min_seconds`` have passed (at most ``max_reps``). Timing starts right before the call that
moves the bytes (``Transceiver.pull``, the size request, ``copyto``) and stops when the bytes
are in the destination buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from pdserve.config.settings import TransferSettings
from pdserve.errors import HandleError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.security import ClusterKey, generate_secret
from pdserve.transfer.connection.control import SOCKET_BUFFER_BYTES
from pdserve.transfer.transceiver import create_transceiver

RESULT_PREFIX = "PDSERVE-BENCH "
SECRET_ENV = "PDSERVE_SECURITY__CLUSTER_SECRET"
"""The environment variable that carries the cluster secret to the serve and pull roles (the
same variable as a worker's ``security.cluster_secret``; never on the command line)."""
BENCH_EPOCH = 1
"""The epoch of every benchmark transceiver :class:`AllParked` serves."""


class PeerSpec(BaseModel):
    """What one child process measures (JSON on its command line).

    ``blocks``: request sizes in KV blocks of ``layout`` (one block = all layers); ``backend``:
    a transfer backend name (serve/pull); ``integrity``: the settings to pull with (only when
    ``TransferSettings`` has the field); ``ucx_devices``: ``TransferSettings.ucx_devices``;
    ``dst_layout``: the decode (pulling) side's layout when it differs from the prefill
    side's ``layout`` (another tensor parallel split; the same tokens per block).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layout: KVLayout
    dst_layout: KVLayout | None = None
    blocks: list[int]
    backend: str = "tcp"
    ucx_devices: str | None = None
    integrity: list[bool] = []
    endpoint: str = ""
    min_reps: int = 5
    max_reps: int = 200
    min_seconds: float = 0.3


def block_bytes(layout: KVLayout) -> int:
    """Bytes of one KV block across all layers and ranks (``layout.block_bytes``)."""
    return layout.block_bytes


def emit(result: dict[str, Any]) -> None:
    """Print one result line for the parent."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def empty_pool(layout: KVLayout, num_blocks: int, device: str = "cpu") -> torch.Tensor:
    """Zeroed pool ``[L, num_blocks, 2, tpb, kvh, hd]`` of ``layout.dtype`` on ``device``
    (``[tp, L, num_blocks, 2, tpb, kvh_r, hd]`` for a tensor parallel layout)."""
    shape = (layout.num_layers, num_blocks, 2, layout.tokens_per_block, layout.kv_heads_per_rank)
    ranks = (layout.tp_size,) if layout.tp_size > 1 else ()
    dtype = getattr(torch, layout.dtype)
    return torch.zeros((*ranks, *shape, layout.head_dim), dtype=dtype, device=device)


def _blocks(pool: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``pool`` with the block dimension first (every rank, layer and element behind it)."""
    return pool.movedim(2 if layout.tp_size > 1 else 1, 0)


def pattern(layout: KVLayout, num_blocks: int, device: str = "cpu") -> torch.Tensor:
    """A pool whose element i is (i mod 2**24) + 1 (exact in float32; distinct for pools under
    2**24 elements, which a misplaced byte then shows): what :class:`PatternPeer` serves."""
    pool = empty_pool(layout, num_blocks, device)
    values = torch.arange(pool.numel(), dtype=torch.float32, device=device) % (1 << 24) + 1
    pool.view(-1).copy_(values)
    return pool


def transfer_settings(
    backend: str,
    *,
    ucx_devices: str | None = None,
    integrity: bool | None = None,
    timeout_s: float | None = None,
) -> TransferSettings:
    """Transfer settings of a benchmark transceiver: ``backend``, ``ucx_devices`` and, when
    given, ``integrity`` and ``timeout_s`` (seconds); the rest default."""
    fields: dict[str, Any] = {"backend": backend, "ucx_devices": ucx_devices}
    if integrity is not None:
        fields["integrity"] = integrity
    if timeout_s is not None:
        fields["timeout_s"] = timeout_s
    return TransferSettings.model_validate(fields)


def _config(spec: PeerSpec, integrity: bool | None = None) -> TransferSettings:
    return transfer_settings(spec.backend, ucx_devices=spec.ucx_devices, integrity=integrity)


def cluster_key() -> ClusterKey:
    """The key of the secret in :data:`SECRET_ENV`; RuntimeError when it is not set."""
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise RuntimeError(f"{SECRET_ENV} is not set (the benchmark passes a fresh secret)")
    return ClusterKey(secret.encode())


class AllParked:
    """The serving side's parked blocks: request ``bench-<n>-<k>`` has blocks 0..n-1 parked
    (any lease id); release does nothing. Raises HandleError for other ids or epochs."""

    def lookup(self, request_id: str, epoch: int, lease_id: str | None = None) -> list[int]:
        parts = request_id.split("-")
        if epoch != BENCH_EPOCH or len(parts) != 3 or parts[0] != "bench":
            raise HandleError(f"unknown request {request_id}")
        return list(range(int(parts[1])))

    def release(self, request_id: str, lease_id: str | None = None) -> None:
        pass


async def _times(spec: PeerSpec, once: Callable[[], Awaitable[None]]) -> list[float]:
    """Seconds per repetition of ``once`` after one warm-up (see the module docstring)."""
    await once()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < spec.min_reps or (
        len(times) < spec.max_reps and time.perf_counter() - started < spec.min_seconds
    ):
        t0 = time.perf_counter()
        await once()
        times.append(time.perf_counter() - t0)
    return times


async def serve(spec: PeerSpec) -> None:
    """Role ``serve``: prefill transceiver until stdin closes."""
    pool = empty_pool(spec.layout, max(spec.blocks)).fill_(1.0)
    t = create_transceiver(
        _config(spec),
        pool=pool,
        layout=spec.layout,
        worker_id="bench-prefill",
        epoch=BENCH_EPOCH,
        parked=AllParked(),
        key=cluster_key(),
    )
    await t.start()
    try:
        emit({"endpoint": t.endpoint, "backend": t.backend})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        await t.close()


async def pull(spec: PeerSpec) -> None:
    """Role ``pull``: one result per integrity setting: ``{"integrity", "backend", "times":
    {blocks: [seconds]}}``. Raises RuntimeError if the bytes did not arrive."""
    settings: list[bool | None] = [*spec.integrity] or [None]
    layout = spec.dst_layout or spec.layout
    for integrity in settings:
        pool = empty_pool(layout, max(spec.blocks))
        blocks = _blocks(pool, layout)
        t = create_transceiver(
            _config(spec, integrity),
            pool=pool,
            layout=layout,
            worker_id="bench-decode",
            epoch=BENCH_EPOCH,
            parked=None,
            key=cluster_key(),
        )
        await t.start()
        try:
            times = {}
            for n in spec.blocks:
                times[n] = await _times(spec, _puller(t, spec, n))
                if not bool(blocks[n - 1].eq(1.0).all()):
                    raise RuntimeError(f"{n}-block pulls did not deliver the bytes")
                blocks[:n].zero_()
        finally:
            await t.close()
        emit({"integrity": integrity, "backend": t.backend, "times": times})


def _puller(t: Any, spec: PeerSpec, n: int) -> Callable[[], Awaitable[None]]:
    """One pull of blocks 0..n-1 into 0..n-1. The handle is reused: :class:`AllParked` holds
    every request forever, so only the transfer itself is timed."""
    ids = list(range(n))
    handle = TransferHandle(
        worker_id="bench-prefill",
        epoch=BENCH_EPOCH,
        request_id=f"bench-{n}-0",
        lease_id="bench",
        block_ids=tuple(ids),
        num_tokens=n * spec.layout.tokens_per_block,
        lease_deadline=time.time() + 3600,
        layout=spec.layout,
        backend=t.backend,
        transfer_endpoint=spec.endpoint,
    )

    async def once() -> None:
        await t.pull(handle, ids)

    return once


def _tune(sock: socket.socket) -> None:
    """The same socket options the TCP backend uses (:func:`pdserve.transfer.connection.control.tune`), so
    the reference and the backend differ only in what runs above the socket."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


def source(spec: PeerSpec) -> None:
    """Role ``source``: blocking sockets, one connection, ``sendall`` of a prefilled buffer."""
    buf = memoryview(np.ones(max(spec.blocks) * block_bytes(spec.layout), np.uint8).data)
    with socket.create_server(("127.0.0.1", 0)) as server:
        emit({"endpoint": f"127.0.0.1:{server.getsockname()[1]}"})
        conn, _ = server.accept()
        with conn:
            _tune(conn)
            while len(request := conn.recv(8)) == 8:
                conn.sendall(buf[: int.from_bytes(request, "big")])


async def sink(spec: PeerSpec) -> None:
    """Role ``sink``: ``{"times": {blocks: [seconds]}}`` of request + ``recv_into`` loops."""
    host, _, port = spec.endpoint.rpartition(":")
    buf = memoryview(np.zeros(max(spec.blocks) * block_bytes(spec.layout), np.uint8).data)
    with socket.create_connection((host, int(port))) as sock:
        _tune(sock)
        times = {}
        for n in spec.blocks:
            size = n * block_bytes(spec.layout)

            async def once(size: int = size) -> None:
                sock.sendall(size.to_bytes(8, "big"))
                pos = 0
                while pos < size:
                    pos += sock.recv_into(buf[pos:size])

            times[n] = await _times(spec, once)
    emit({"times": times})


async def memcpy_times(spec: PeerSpec) -> dict[int, list[float]]:
    """``numpy.copyto`` between two preallocated buffers, the same byte counts as the transfers
    (and, like them, the same bytes each repetition): seconds per repetition per size."""
    total = max(spec.blocks) * block_bytes(spec.layout)
    src, dst = np.ones(total, np.uint8), np.zeros(total, np.uint8)
    times = {}
    for n in spec.blocks:
        size = n * block_bytes(spec.layout)

        async def once(size: int = size) -> None:
            np.copyto(dst[:size], src[:size])

        times[n] = await _times(spec, once)
    return times


async def memcpy(spec: PeerSpec) -> None:
    """Role ``memcpy``: ``{"times": {blocks: [seconds]}}`` of :func:`memcpy_times`."""
    emit({"times": await memcpy_times(spec)})


# --- a serving side on any device, driven through a pipe ------------------------------------------

PATTERN_PEER_ID = "pattern-prefill"
PATTERN_EPOCH = 11


class _ParkedTable:
    """The pattern peer's parked blocks: what the parent parked, by request id; release keeps
    them (the same handle can be pulled again, as the benchmark's loops do)."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def lookup(self, request_id: str, epoch: int, lease_id: str | None = None) -> list[int]:
        if epoch != PATTERN_EPOCH or request_id not in self.blocks:
            raise HandleError(f"no parked request {request_id} at epoch {epoch}")
        return self.blocks[request_id]

    def release(self, request_id: str, lease_id: str | None = None) -> None:
        pass


def _pattern_child(
    pipe: Connection, backend: str, layout: KVLayout, num_blocks: int, device: str, secret: str
) -> None:  # pragma: no cover - runs in the spawned process
    asyncio.run(_pattern_serve(pipe, backend, layout, num_blocks, device, secret))


async def _pattern_serve(
    pipe: Connection, backend: str, layout: KVLayout, num_blocks: int, device: str, secret: str
) -> None:  # pragma: no cover - runs in the spawned process
    parked = _ParkedTable()
    t = create_transceiver(
        transfer_settings(backend, ucx_devices="lo"),
        pool=pattern(layout, num_blocks, device),
        layout=layout,
        worker_id=PATTERN_PEER_ID,
        epoch=PATTERN_EPOCH,
        parked=parked,
        key=ClusterKey(secret.encode()),
    )
    await t.start()
    pipe.send((t.endpoint, t.backend))
    loop = asyncio.get_running_loop()
    while (msg := await loop.run_in_executor(None, pipe.recv))[0] != "stop":
        if msg[0] == "park":
            parked.blocks[msg[1]] = list(msg[2])
            pipe.send("ok")
        elif msg[0] == "errors":
            pipe.send([f"{type(e).__name__}: {e.message}" for e in t.recent_errors])
    await t.close()


class PatternPeer:
    """A prefill-side transceiver in a spawned process, its pool of ``num_blocks`` blocks of
    ``layout`` on ``device`` filled with :func:`pattern`, UCX on loopback; the caller plays the
    decode side with :attr:`key` (of ``secret``, a fresh one when None; it reaches the child
    through the pipe, never a command line). Owns the process: :meth:`stop` ends it. Raises
    RuntimeError when it does not start within 120 s (CUDA initialisation and a NIXL agent
    included)."""

    def __init__(
        self,
        backend: str,
        layout: KVLayout,
        num_blocks: int,
        device: str,
        secret: str | None = None,
    ) -> None:
        self.layout = layout
        secret = secret or generate_secret()
        self.key = ClusterKey(secret.encode())
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_pattern_child,
            args=(child, backend, layout, num_blocks, device, secret),
            daemon=True,
        )
        self.proc.start()
        if not self._pipe.poll(120):
            self.stop()
            raise RuntimeError("the pattern peer did not start within 120 s")
        self.endpoint, self.backend = self._pipe.recv()

    def park(self, request_id: str, block_ids: list[int]) -> TransferHandle:
        """Park ``block_ids`` (all full: ``len * tpb`` tokens) under ``request_id``; the handle
        that pulls them (lease one hour)."""
        self._pipe.send(("park", request_id, block_ids))
        if self._pipe.recv() != "ok":
            raise RuntimeError("the pattern peer did not park the blocks")
        return TransferHandle(
            worker_id=PATTERN_PEER_ID,
            epoch=PATTERN_EPOCH,
            request_id=request_id,
            lease_id="pattern-lease",
            block_ids=tuple(block_ids),
            num_tokens=len(block_ids) * self.layout.tokens_per_block,
            lease_deadline=time.time() + 3600,
            layout=self.layout,
            backend=self.backend,
            transfer_endpoint=self.endpoint,
        )

    def errors(self) -> list[str]:
        """The transfer errors the peer's serving side recorded, as ``"Type: message"``."""
        self._pipe.send(("errors",))
        errors: list[str] = self._pipe.recv()
        return errors

    def stop(self) -> None:
        """End the process (SIGKILL after 15 s); idempotent."""
        with contextlib.suppress(OSError, BrokenPipeError):
            self._pipe.send(("stop",))
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def main(argv: list[str] | None = None) -> None:
    """``python -m pdserve.bench.transfer.bench_transfer_peers ROLE SPEC_JSON``."""
    role, raw = (argv if argv is not None else sys.argv[1:])[:2]
    spec = PeerSpec.model_validate_json(raw)
    if role == "source":
        source(spec)
        return
    roles = {"serve": serve, "pull": pull, "sink": sink, "memcpy": memcpy}
    asyncio.run(roles[role](spec))


if __name__ == "__main__":
    main()
