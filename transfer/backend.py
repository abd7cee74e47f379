"""The data-plane interface every transfer backend implements, and the lazy backend registry.

Design origin: SGLang's disaggregation ``conn.py`` (a sender with ``poll()`` returning a state
enum) and the TensorRT-LLM seed's split between *Connection* (bidirectional send/receive: our
TCP and UCX backends) and *TransferAgent* (one-sided read/write of registered memory: our NIXL
backend). vLLM's ``kv_connector/factory.py`` is the model for the registry: a backend's module
is imported only when that backend is chosen, so importing :mod:`pdserve.transfer` never
imports NIXL or ucxx.

Roles: the prefill side calls :meth:`Backend.add_peer` once per connection and
:meth:`Backend.start_send` once per request, then drives the returned :class:`Outbound` to
DONE/FAILED; the decode side calls :meth:`Backend.receive` once per request. The control
messages around them (SendBlocks, TransferDone, Release) belong to the Sender/Receiver.

Thread-safety: everything here runs on the owning transceiver's event loop thread (NIXL is
treated as not thread-safe).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from pdserve.config.settings import TransferSettings
from pdserve.errors import ConfigError, TransferError
from pdserve.transfer import wire
from pdserve.transfer.formatter.copies import CopyCounter
from pdserve.transfer.formatter.mapping import PoolGeometry, TransferPlan

if TYPE_CHECKING:
    from pdserve.transfer.connection.control import Connection

log = logging.getLogger(__name__)


class TransferState(StrEnum):
    """State of one request's outbound transfer, as :meth:`Outbound.poll` reports it."""

    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Poller:
    """Polling schedule for transfers that progress only when polled (NIXL without its
    progress thread): for ``spin_s`` seconds give the CPU away (``sched_yield``) and yield to
    the event loop (``sleep(0)``) between polls, then sleep ``idle_s`` between polls. Other
    tasks on the loop still run while it spins.

    Why spin: an asyncio sleep shorter than 1 ms is rounded up to 1 ms by epoll, and polling
    every 1 ms measured (dev box, NIXL, 2 processes) 0.4-0.5 GB/s instead of 1.2-1.5 GB/s for
    1.4 MiB requests, and 1.4 instead of 3.4 GB/s for 16 MiB over UCX_TLS=tcp. NIXL's own
    progress thread is worse still on few cores: it busy-spins (the Python API fixes its
    delay at 0). Why ``sched_yield``: the peer process that must make progress (the prefill
    side posting, the decode side's UCX receiving) may be waiting for this very core; with
    more runnable processes than cores, a spin that only yields to its own event loop held
    the core for whole scheduler slices and one-block NIXL pulls took 8-12 ms instead of
    1-3 ms (2 cores, load average 3-4). On an idle core the call returns at once
    (about 1 us) and costs nothing. It releases the GIL, so an engine thread in the same
    process runs too. The idle phase stops a stalled peer from burning a core until the
    timeout."""

    def __init__(self, spin_s: float = 0.25, idle_s: float = 0.001):
        self._spin_until = time.monotonic() + spin_s
        self._idle_s = idle_s

    async def sleep(self) -> None:
        if time.monotonic() < self._spin_until:
            os.sched_yield()
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(self._idle_s)


class Digests(Protocol):
    """The integrity digests of one transfer's plan segments, computed as they are touched
    (:class:`pdserve.transfer.integrity.digests.SegmentDigests`): ``update(stop)`` hashes segments
    ``done .. stop - 1``; what a backend leaves, the sender or receiver finishes."""

    done: int

    def update(self, stop: int) -> None: ...


class Outbound(ABC):
    """The prefill side of one request's transfer, started by :meth:`Backend.start_send`."""

    failure: str | None = None

    @abstractmethod
    def poll(self) -> TransferState:
        """Advance (where the backend needs it) and report the state; never blocks."""

    @abstractmethod
    def abort(self) -> None:
        """Stop and release resources; idempotent. Bytes may have partly landed, but none land
        after it returns."""

    async def wait(self, timeout: float, abandoned: Callable[[], bool] | None = None) -> None:
        """Poll until DONE. Raises TransferError (after :meth:`abort`) on FAILED, on timeout, or
        as soon as ``abandoned()`` (the receiver closed or asked to stop) is true."""
        poller = Poller()
        deadline = time.monotonic() + timeout
        while (state := self.poll()) is TransferState.RUNNING:
            if abandoned is not None and abandoned():
                self.abort()
                raise TransferError("KV send abandoned: the receiver stopped waiting")
            if time.monotonic() > deadline:
                self.abort()
                raise TransferError(f"KV send did not complete within {timeout:.1f} s")
            await poller.sleep()
        if state is TransferState.FAILED:
            self.abort()
            raise TransferError(f"KV send failed: {self.failure or 'backend error'}")


class Peer:
    """What the sender keeps about one connected receiver (backend-specific subclasses)."""


class Backend(ABC):
    """One transfer backend of one transceiver; owns its backend resources until :meth:`close`.

    ``inline_bytes``: the KV bytes travel on the control connection (TCP): their announced
    count completes a transfer (no TransferDone), and a failed send leaves the stream unusable,
    so the connection must be closed.

    ``copies``: where the backend counts its payload and staging copies
    (:mod:`pdserve.transfer.formatter.copies`); the transceiver sets its own counter right after
    :func:`open_backend`, and a backend without one makes its own on first use.
    """

    name: ClassVar[str]
    inline_bytes: ClassVar[bool]
    _copies: CopyCounter | None = None

    @property
    def copies(self) -> CopyCounter:
        if self._copies is None:
            self._copies = CopyCounter()
        return self._copies

    @copies.setter
    def copies(self, counter: CopyCounter) -> None:
        self._copies = counter

    @property
    def late_writes(self) -> bool:
        """Receiver side: whether bytes of a pull may still land in the pool after
        :meth:`receive` failed or was cancelled (a remote WRITE, a posted receive, a copy still
        queued on a GPU stream). Then the destination blocks must be quarantined before reuse;
        otherwise they can go back at once. Default: True (the safe answer)."""
        return True

    def hello_info(self) -> wire.NixlPeerInfo | wire.UcxPeerInfo | None:
        """What the receiving side advertises in its Hello (None: nothing needed)."""
        return None

    def add_peer(self, hello: wire.Hello) -> Peer:
        """Sender side, at handshake: prepare to send to this receiver; raises TransferError."""
        return Peer()

    @abstractmethod
    def start_send(
        self,
        conn: Connection,
        plan: TransferPlan,
        peer: Peer,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> Outbound:
        """Sender side: start moving ``plan`` to the peer; its src offsets index the local pool,
        or ``plan.source`` when set (a registered staging buffer, see :meth:`register_staging`).
        ``digests`` (integrity on): the source digests, which a backend that touches the bytes
        itself (TCP) computes group by group as it sends them; the sender finishes the rest."""

    @abstractmethod
    async def receive(
        self,
        conn: Connection,
        plan: TransferPlan,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> None:
        """Receiver side, after SendBlocks went out: return once every byte of ``plan`` is in
        the local pool (NIXL: and TransferDone arrived). ``digests`` (integrity on): the
        landed bytes' digests, which a backend that receives the bytes itself (TCP) computes
        as they land; the receiver finishes the rest. Raises TransferError (or the peer's
        subclass)."""

    def register_staging(self, buf: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Sender side: make ``buf`` (1-D uint8, contiguous, on the pool's device; a staging
        buffer of :class:`pdserve.transfer.formatter.staging.StagingPool`) a valid ``plan.source`` for
        :meth:`start_send` until :meth:`deregister_staging`. Default: nothing to do (backends
        that send from any memory). Raises TransferError (NIXL: registration refused)."""

    def deregister_staging(self, buf: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`register_staging`; called once no send reads ``buf``."""

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release backend resources; idempotent."""


_REGISTRY: dict[str, str] = {
    "tcp": "pdserve.transfer.agents.tcp:TcpBackend",
    "nixl": "pdserve.transfer.agents.nixl_agent:NixlBackend",
    "ucx": "pdserve.transfer.agents.ucx:UcxBackend",
    # Peers in one process (unit tests): not a deployment choice, so not offered by the config.
    "inproc": "pdserve.transfer.agents.inproc:InprocBackend",
}
"""Backend name -> ``module:class``; a backend's module is imported only when it is chosen."""


def registered_backends() -> tuple[str, ...]:
    """The backend names this build registers (their modules are not imported)."""
    return tuple(_REGISTRY)


def _load(name: str) -> type[Backend]:
    module, _, attr = _REGISTRY[name].partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module), attr)
    return cls


def open_backend(
    cfg: TransferSettings, *, pool: torch.Tensor, geometry: PoolGeometry, agent_name: str
) -> Backend:
    """Create the backend ``cfg.backend`` names; ``"auto"`` = NIXL if it imports and
    initialises, else TCP (logged). An explicit choice that fails raises ConfigError."""
    kwargs: dict[str, Any] = {
        "cfg": cfg,
        "pool": pool,
        "geometry": geometry,
        "agent_name": agent_name,
    }
    if cfg.backend != "auto":
        try:
            return _load(cfg.backend)(**kwargs)
        except (ImportError, RuntimeError, OSError) as exc:
            raise ConfigError(f"transfer backend {cfg.backend!r} unavailable: {exc}") from exc
    try:
        return _load("nixl")(**kwargs)
    except Exception as exc:  # any import or init failure of the optional library
        log.warning("NIXL unavailable (%s); using the TCP transfer backend", exc)
        return _load("tcp")(**kwargs)
