"""Transceiver: one per worker; serves its parked KV blocks and pulls other workers' blocks.

Design origin: the TensorRT-LLM seed's *Transceiver* (coordinates sending and receiving of KV
cache for its executor), with the seed's outlook applied: the control plane is Python
(:mod:`~pdserve.transfer.sender`, :mod:`~pdserve.transfer.receiver` over
:mod:`~pdserve.transfer.wire` frames), the data plane a :class:`~pdserve.transfer.backend.Backend`
(NIXL WRITE of registered memory, or bytes streamed on the TCP connection).

Lifecycle: ``create_transceiver`` (validates the pool, picks and initialises the backend) ->
``await start()`` (listens on ``cfg.bind_host:cfg.port``; ``endpoint`` is then set) -> serve
(``pull`` on decode workers; connections accepted on prefill workers) -> ``await close()``
(idempotent: stops accepting, ends connection handlers, closes idle connections, releases the
backend's agent and memory registration).

Thread-safety: every method, and ``create_transceiver``, must be called from the thread of the
event loop that runs the transceiver (NIXL is not thread-safe). No pool locking happens here:
the engine never touches parked or reserved blocks while they are transferred.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections import deque
from typing import Literal

import torch

from pdserve.config.hosts import advertised_host, listening_socket
from pdserve.config.settings import TransferSettings
from pdserve.errors import ConfigError, TransferError
from pdserve.protocol import KVLayout, TransferHandle
from pdserve.security import ClusterKey
from pdserve.transfer.backend import Backend, open_backend
from pdserve.transfer.connection.admission import ConnectionSlots, SlotLimits
from pdserve.transfer.connection.auth import AuthFailures
from pdserve.transfer.connection.control import Connection
from pdserve.transfer.connection.handshake import LocalSide
from pdserve.transfer.formatter.copies import CopyCounter
from pdserve.transfer.formatter.mapping import PoolGeometry
from pdserve.transfer.formatter.staging import StagingPool
from pdserve.transfer.integrity.digests import BlockDigester
from pdserve.transfer.receiver import Receiver
from pdserve.transfer.sender import ParkedLookup, Sender

log = logging.getLogger(__name__)

_RECENT_ERRORS = 64
_ACCEPT_BURST = 16
"""Connections the accept loop takes in a row before it yields to the event loop."""


class Transceiver:
    """A worker's KV transfer endpoint (see the module docstring for the lifecycle).

    ``backend`` is ``"nixl"``, ``"ucx"`` or ``"tcp"``; ``endpoint`` is ``"host:port"`` once started.
    ``recent_errors`` holds the last TransferErrors the serving side raised (newest last),
    e.g. the LayoutMismatchError of a refused handshake. ``auth_failures.total`` counts the
    connections ended because the peer did not prove it holds the cluster secret
    (:mod:`pdserve.transfer.connection.auth`) in time, was evicted while unproven, or proved itself past
    a cap on proven connections (:mod:`pdserve.transfer.connection.admission`; those two also in
    ``refused_connections``). ``slots`` holds the admission state (``limits``: its caps).
    ``copies`` counts the payload of this worker's sends and receives and the staging copies
    its side makes of them (:mod:`pdserve.transfer.formatter.copies`); it is its backend's counter.
    """

    def __init__(
        self,
        cfg: TransferSettings,
        local: LocalSide,
        parked: ParkedLookup | None,
        digester: BlockDigester,
        advertise_host: str | None = None,
        limits: SlotLimits | None = None,
    ):
        self._cfg = cfg
        self._advertise_host = advertise_host
        self._local = local
        self._parked = parked
        self._digester = digester
        # Integrity is the pulling side's choice (cfg.integrity); serving, this side digests
        # whenever a peer asks.
        self._receiver = Receiver(local, cfg.timeout_s, digester if cfg.integrity else None)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handlers: dict[asyncio.Task[None], Connection] = {}  # served connections
        self.slots: ConnectionSlots[asyncio.Task[None]] = ConnectionSlots(limits)
        self._closed = False
        self.backend: str = local.backend.name
        self.endpoint: str = ""
        self.recent_errors: deque[TransferError] = deque(maxlen=_RECENT_ERRORS)
        self.auth_failures = AuthFailures()
        self.copies = CopyCounter()
        local.backend.copies = self.copies  # the backend and its StagingPool count into it

    @property
    def refused_connections(self) -> int:
        """Served connections ended by admission: evicted while unproven, or closed at a
        cap on proven ones."""
        return self.slots.evicted + self.slots.refused

    @property
    def late_writes(self) -> bool:
        """Whether a failed pull's destination blocks may still be written (then quarantine
        them; see :attr:`pdserve.transfer.backend.Backend.late_writes`)."""
        return self._local.backend.late_writes

    async def start(self) -> None:
        """Listen for peers on ``cfg.bind_host:cfg.port`` (port 0 picks one) and set ``endpoint``
        (the advertised host, :func:`pdserve.config.hosts.advertised_host`, and the bound port). A
        pool on a GPU first gets its digest kernel compiled (seconds, once per process).
        Raises ConfigError if the address cannot be bound."""
        if self._listener is not None:
            return
        self._digester.prepare()  # a GPU pool: mix64's kernel compiled before the first pull
        host, port = self._cfg.bind_host, self._cfg.port
        try:  # a flood fills the backlog later (the kernel caps it)
            sock = listening_socket(host, port, backlog=socket.SOMAXCONN)
        except OSError as exc:
            raise ConfigError(f"KV transceiver cannot listen on {host}:{port}: {exc}") from exc
        sock.setblocking(False)
        self._listener = sock
        bound = sock.getsockname()[1]
        shown = advertised_host(host, self._advertise_host)
        self.endpoint = f"[{shown}]:{bound}" if ":" in shown else f"{shown}:{bound}"
        self._accept_task = asyncio.create_task(self._accept_loop(sock))
        log.info("KV transceiver (%s) listening on %s", self.backend, self.endpoint)

    def communicator(self) -> dict[str, str]:
        """The discovery record's communicator handle: the backend name and the transceiver
        endpoint, nothing more. A backend's peer information (NIXL agent metadata with its
        memory registrations, a UCX worker address) travels only in the authenticated
        handshake (``wire.Hello``): published in the registry, etcd or NATS, it would let any
        host that reads them address this worker's pool."""
        return {"backend": self.backend, "endpoint": self.endpoint}

    async def pull(
        self, handle: TransferHandle, dst_block_ids: list[int], *, skip_blocks: int = 0
    ) -> None:
        """Decode side: copy the parked blocks ``handle.block_ids`` of the prefill worker into
        the local blocks ``dst_block_ids`` (every layer; element i -> element i), then release
        them on the prefill side. ``skip_blocks``: leading blocks this worker's prefix cache
        already holds, not sent (delta transfer; equal layouts only).

        Raises TransferError (peer unreachable, refused, died, timed out after
        ``cfg.timeout_s``; wrong ``dst_block_ids`` count), LayoutMismatchError, HandleError
        (unknown request, other epoch, another lease id, expired lease, blocks not parked or
        reallocated since), IntegrityError (``cfg.integrity``: the landed bytes differ from the
        sender's digests; all of them have landed, none will follow). See
        :mod:`pdserve.transfer.receiver` for what the destination blocks hold after an error.
        """
        if self._closed:
            raise TransferError("transceiver is closed")
        await self._receiver.pull(handle, dst_block_ids, skip_blocks=skip_blocks)

    async def pull_streamed(
        self, handle: TransferHandle, dst_block_ids: list[int], *, skip_blocks: int = 0
    ) -> int:
        """Decode side of the streamed hand-off (``handle.streamed``, published when the
        prefill started): receive each prefill chunk's blocks as they are computed, into
        ``dst_block_ids`` as :meth:`pull` does, and return the first token the prefill
        sampled. Lasts at most until the handle's lease deadline. Raises as :meth:`pull`
        (HandleError too when the prefill failed or ended without a decode leg)."""
        if self._closed:
            raise TransferError("transceiver is closed")
        return await self._receiver.pull_streamed(handle, dst_block_ids, skip_blocks=skip_blocks)

    async def close(self) -> None:
        """Stop serving and release everything; idempotent. Call it once this worker's own
        pulls have returned (a pull still running then fails with TransferError)."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._accept_task, *self._handlers) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._listener is not None:
            self._listener.close()
        self._receiver.close()
        if self._local.staging is not None:  # before the backend: NIXL deregisters its buffers
            self._local.staging.close()
        self._local.backend.close()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        accepted = 0
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. EMFILE: back off instead of spinning
                log.warning("transfer accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._serve(sock, f"{addr[0]}:{addr[1]}", str(addr[0]))
            accepted += 1
            if accepted % _ACCEPT_BURST == 0:
                # sock_accept returns without yielding while connections are queued: let the
                # evicted connections' handlers end and close their sockets before taking
                # more (a flood must not pile up sockets until EMFILE).
                await asyncio.sleep(0)

    def _serve(self, sock: socket.socket, peer: str, host: str) -> None:
        """Start the handler of an accepted connection, unproven (evicting the oldest
        unproven ones past their caps, :mod:`pdserve.transfer.connection.admission`)."""
        task: asyncio.Task[None]
        conn = Connection(sock, peer)
        sender = Sender(
            self._local,
            conn,
            self._parked,
            self._cfg.timeout_s,
            self.recent_errors,
            self._digester,
            self.auth_failures,
            on_proven=lambda: self.slots.promote(task),
        )
        task = asyncio.create_task(sender.serve())
        self._handlers[task] = conn
        task.add_done_callback(self._handler_done)
        for old in self.slots.admit(task, host):
            # It has read no proof: nothing of its peer is held but the socket, which
            # _handler_done closes (also when the task is cancelled before it ever ran).
            old.cancel()
            evicted = self._handlers.get(old)
            self.auth_failures.record(
                evicted.peer if evicted else "?",
                "evicted while unauthenticated (too many unauthenticated connections)",
            )

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        # A done callback runs after the handler's pending socket reads were unregistered, so
        # closing here never hands a registered fd number to the next accepted socket.
        conn = self._handlers.pop(task, None)
        if conn is not None:
            conn.close()
        self.slots.release(task)


def create_transceiver(
    cfg: TransferSettings,
    *,
    pool: torch.Tensor,
    layout: KVLayout,
    worker_id: str,
    epoch: int,
    parked: ParkedLookup | None,
    key: ClusterKey,
    advertise_host: str | None = None,
) -> Transceiver:
    """Build a worker's transceiver over its KV pool.

    ``pool``: the worker's one contiguous pool ``[num_layers, num_blocks, 2, tpb, kvh, hd]``
    of ``layout.dtype`` (CPU or CUDA: NIXL registers either, TCP stages CUDA bytes through
    pinned host memory, ucx refuses CUDA with ConfigError). It is registered with NIXL and must
    outlive the transceiver. ``parked``: the prefill worker's parked blocks (None on a pure
    decode worker: its SendBlocks are refused). ``key``: the deployment's cluster secret
    (:class:`~pdserve.security.ClusterKey`); every connection, served or dialled, proves it
    both ways before anything else (:mod:`pdserve.transfer.connection.auth`). ``advertise_host``: the
    address peers dial (default: the bind host; a wildcard bind: this machine's hostname).
    Picks the backend (``cfg.backend``; ``"auto"`` = NIXL if it imports and initialises, else
    TCP). Raises ConfigError for a pool that does not match
    ``layout`` or an unavailable explicit backend. Call from the event loop's thread.
    """
    geometry = PoolGeometry.from_pool(pool, layout)
    # Unique per incarnation: a restarted worker's agent must not be mistaken for the old one.
    agent_name = f"pdserve-{worker_id}-{epoch}-{uuid.uuid4().hex[:8]}"
    backend: Backend = open_backend(cfg, pool=pool, geometry=geometry, agent_name=agent_name)
    staging = StagingPool(pool, backend)  # used only by peers whose layout differs
    device: Literal["cpu", "cuda"] = "cuda" if pool.device.type == "cuda" else "cpu"
    local = LocalSide(
        worker_id, epoch, layout, geometry, backend, staging=staging, key=key, pool_device=device
    )
    return Transceiver(cfg, local, parked, BlockDigester(pool), advertise_host)
