"""TransferAgent over NIXL (UCX backend) and the NIXL transfer backend.

Design origin: the TensorRT-LLM seed's *TransferAgent* (one-sided read/write of registered
memory; NIXL is its reference library) and vLLM's NIXL connector (agent metadata exchanged at
handshake, one WRITE per request with a notification). The library is imported inside
:class:`NixlAgent`, so importing this module does not import NIXL.

Per request (prefill P initiates, decode D is passive)::

    D: register pool -> Hello{agent metadata, pool addr}  P: add_remote_agent(metadata)
    P: initialize_xfer(WRITE, local segs, remote segs, notif=transfer_id); transfer(); poll
    P: state DONE -> TransferDone over the control connection
    D: poll get_new_notifs until transfer_id arrives AND TransferDone arrived -> bytes landed
       (integrity on: D hashes them once the notification arrived, P after its WRITE)

Settings (measured on the development machines): the progress thread is OFF and both sides
poll from the event loop (with it on, UCX over TCP drops to ~0.3 GB/s on 2 cores; the passive
side must keep polling or transfers stall; :class:`~pdserve.transfer.backend.Poller` yields the
CPU while it polls); ``cfg.net_devices`` (``ucx_devices``, or ``"lo"`` on a loopback bind; passed
as the UCX context's ``NET_DEVICES``, so its listeners open on those devices only) limits UCX's
*network* devices only:
two workers on one host still WRITE by CMA (shared-memory devices are not network devices;
checked with ``UCX_PROTO_INFO=y``: ``ucp_put* ... zero-copy cma/memory`` with ``lo``), and
:data:`UCX_OPTIONS` lets the notifications take shared memory too. WRITE (push), never READ,
because UCX emulates READ in software over TCP.

Per-request descriptors: two Nx3 arrays -> ``get_xfer_descs`` -> ``initialize_xfer``, about 20 us
for a 30-segment request. Descriptor lists prepared once per peer over every (layer, block)
(``prep_xfer_dlist`` + ``make_prepped_xfer`` with indices) measured slower here (about 50 us),
because turning a plan into per-block indices costs more in numpy than the validation it saves;
NIXL merges consecutive descriptors either way.

Thread-safety: NIXL is used from the owning event loop's thread only.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from pdserve.config.settings import TransferSettings
from pdserve.errors import TransferError
from pdserve.transfer import wire
from pdserve.transfer.backend import Backend, Digests, Outbound, Peer, Poller, TransferState
from pdserve.transfer.connection.control import Connection
from pdserve.transfer.formatter.mapping import PoolGeometry, TransferPlan

log = logging.getLogger(__name__)

UCX_OPTIONS: dict[str, str] = {
    # UCX's shared-memory transports take part in peer-failure handling (NIXL's default error
    # mode) only when asked to. Without it, two workers on one host move the data by CMA but
    # every NIXL notification (one per transfer) over TCP loopback, which needs the receiver's
    # progress through the socket stack: one-block pulls measured 2.8-3.2 ms instead of
    # 0.9-1.1 ms (2 cores under load). Comma-free values only (``engine_config`` is
    # ``KEY=VALUE,KEY=VALUE``).
    "MM_ERROR_HANDLING": "y",
}
"""UCX context options of every NIXL agent (``UCX_`` prefix dropped), passed as the UCX
backend's ``engine_config`` (applied over the environment, like ucx.py's ``UCX_OPTIONS``)."""

_MAX_PENDING_NOTIFS = 4096
_ABORT_WAIT_S = 2.0
"""How long an aborted WRITE that NIXL cannot cancel may take to end (prefill side), and how long
a decode that gave up waits for the prefill side to confirm its Abort."""


class NixlAgent:
    """One NIXL agent with the UCX backend and this worker's KV pool registered.

    ``name`` must be unique among the agents that will talk to each other.
    Raises ImportError if NIXL is not installed, RuntimeError/other if it does not initialise.
    """

    def __init__(self, name: str, pool: torch.Tensor, ucx_devices: str | None):
        from nixl._api import nixl_agent, nixl_agent_config  # lazy: heavy optional dependency

        conf = nixl_agent_config(enable_prog_thread=False, backends=[])
        self._agent: Any = nixl_agent(name, conf)
        params = {"ucx_devices": ucx_devices} if ucx_devices else {}
        options = dict(UCX_OPTIONS)
        # NIXL's ucx_devices does not reach the UCX context's NET_DEVICES (seen: its TCP
        # listener bound every interface's address with ucx_devices="lo"); the engine
        # config does, for one device (its values cannot hold a comma).
        if ucx_devices and "," not in ucx_devices:
            options["NET_DEVICES"] = ucx_devices
        elif ucx_devices:
            log.warning(
                "NIXL takes one UCX network device in its engine config, not %r: its UCX "
                "listeners may open on every interface (set UCX_NET_DEVICES in the worker's "
                "environment to limit them)",
                ucx_devices,
            )
        engine_config = ",".join(f"{k}={v}" for k, v in options.items())
        try:
            self._agent.create_backend("UCX", {**params, "engine_config": engine_config})
        except Exception as exc:  # a NIXL without engine_config: correct, only slower
            log.warning("NIXL UCX backend refused engine_config (%s); creating it without", exc)
            self._agent.create_backend("UCX", params)
        self.name = name
        self.mem_type = "DRAM" if pool.device.type == "cpu" else "VRAM"
        self.device_id = max(pool.get_device(), 0)
        self._pool: torch.Tensor | None = (
            pool  # registered memory must stay allocated while the agent lives
        )
        self._reg = self._agent.register_memory(pool)
        self._pending: OrderedDict[bytes, None] = OrderedDict()
        self._closed = False

    def metadata(self) -> bytes:
        """Agent metadata (connection info + pool registration) for :meth:`add_peer`."""
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its agent name."""
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        self._agent.remove_remote_agent(name)

    def register(self, buf: torch.Tensor) -> Any:
        """Register more local memory (a staging buffer) as a WRITE source; returns the handle
        for :meth:`deregister`. The caller keeps ``buf`` allocated until then."""
        if self._agent is None:
            raise TransferError("NIXL agent is closed")
        return self._agent.register_memory(buf)

    def deregister(self, reg: Any) -> None:
        if self._agent is not None:
            self._agent.deregister_memory(reg)

    def write(
        self, peer: str, local: np.ndarray, remote: np.ndarray, remote_mem: str, notif: bytes
    ) -> NixlWrite:
        """Post ONE WRITE of ``local`` rows (this agent's memory, :attr:`mem_type`) into
        ``remote`` rows (the peer's ``remote_mem``, ``"DRAM"`` or ``"VRAM"``: a CPU and a CUDA
        worker pair freely) (Nx3 uint64: addr, bytes, device id) with ``notif`` delivered to
        the peer after the data."""
        if self._agent is None:
            raise TransferError("NIXL agent is closed")
        descs_l = self._agent.get_xfer_descs(local, self.mem_type)
        descs_r = self._agent.get_xfer_descs(remote, remote_mem)
        handle = self._agent.initialize_xfer("WRITE", descs_l, descs_r, peer, notif)
        return NixlWrite(self._agent, handle)

    def take_notif(self, tag: bytes) -> bool:
        """Poll for notifications (this also progresses incoming transfers); True once
        ``tag`` has arrived, consuming it. Unclaimed notifications are kept (bounded)."""
        if self._agent is None:
            raise TransferError("NIXL agent is closed")
        for messages in self._agent.get_new_notifs().values():
            for msg in messages:
                self._pending[bytes(msg)] = None
        while len(self._pending) > _MAX_PENDING_NOTIFS:
            self._pending.popitem(last=False)
        if tag in self._pending:
            del self._pending[tag]
            return True
        return False

    def close(self) -> None:
        """Deregister the pool and drop the agent; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as exc:  # best effort at shutdown
            log.warning("NIXL deregister failed: %s", exc)
        self._agent = None
        self._pool = None


class NixlWrite(Outbound):
    """One posted NIXL WRITE; ``poll`` calls check_xfer_state (which progresses UCX)."""

    def __init__(self, agent: Any, handle: Any):
        self._agent = agent
        self._handle = handle
        self._state = self._map(agent.transfer(handle))

    @staticmethod
    def _map(status: str) -> TransferState:
        return {"DONE": TransferState.DONE, "PROC": TransferState.RUNNING}.get(
            status, TransferState.FAILED
        )

    def poll(self) -> TransferState:
        if self._state is TransferState.RUNNING:
            self._state = self._map(self._agent.check_xfer_state(self._handle))
            if self._state is TransferState.FAILED:
                self.failure = "NIXL transfer state ERR"
        if self._state is not TransferState.RUNNING:
            self.abort()
        return self._state

    def abort(self) -> None:
        # Releasing an active handle asks NIXL to cancel it; it raises if it cannot, and then
        # the WRITE is finished first (rare path, bounded, blocks the loop) so that nothing
        # lands in the peer's blocks after this returns.
        try:
            self._handle.release()
            return
        except Exception as exc:
            log.warning("NIXL could not cancel a WRITE (%s); waiting for it to end", exc)
        deadline = time.monotonic() + _ABORT_WAIT_S
        while self._agent.check_xfer_state(self._handle) == "PROC":
            if time.monotonic() > deadline:
                log.error("NIXL WRITE still running %.1f s after abort", _ABORT_WAIT_S)
                return
            time.sleep(0.0005)
        try:
            self._handle.release()
        except Exception as exc:
            log.error("NIXL could not release an ended transfer handle: %s", exc)


class _NixlPeer(Peer):
    def __init__(self, agent_name: str, info: wire.NixlPeerInfo, worker_id: str):
        self.agent_name = agent_name
        self.info = info
        self.worker_id = worker_id


class NixlBackend(Backend):
    """WRITE into the peer's registered pool, one NIXL transfer per request."""

    name = "nixl"
    inline_bytes = False

    def __init__(
        self, *, cfg: TransferSettings, pool: torch.Tensor, geometry: PoolGeometry, agent_name: str
    ):
        self._agent = NixlAgent(agent_name, pool, cfg.net_devices)
        self._geometry = geometry
        self._metadata_b64 = base64.b64encode(self._agent.metadata()).decode()
        self._peers: dict[str, str] = {}  # loaded remote agent name -> its decode worker id
        self._staging: dict[int, Any] = {}  # staging buffer address -> its registration

    def hello_info(self) -> wire.NixlPeerInfo:
        return wire.NixlPeerInfo(
            agent_name=self._agent.name,
            metadata_b64=self._metadata_b64,
            pool_addr=self._geometry.base_addr,
            pool_bytes=self._geometry.nbytes,
            mem_type=self._agent.mem_type,
            device_id=self._agent.device_id,
        )

    def add_peer(self, hello: wire.Hello) -> Peer:
        info = hello.nixl
        if info is None:
            raise TransferError(f"decode worker {hello.worker_id} sent no NIXL agent metadata")
        if info.agent_name not in self._peers:
            stale = [n for n, w in self._peers.items() if w == hello.worker_id]
            for name in stale:  # the same decode worker restarted: forget its old agent
                self._agent.remove_peer(name)
                del self._peers[name]
        peer = _NixlPeer(info.agent_name, info, hello.worker_id)
        self._load(peer)
        return peer

    def _load(self, peer: _NixlPeer) -> None:
        """Load ``peer``'s agent metadata unless it is loaded; raises TransferError."""
        if peer.agent_name in self._peers:
            return
        try:
            loaded = self._agent.add_peer(base64.b64decode(peer.info.metadata_b64))
        except Exception as exc:
            raise TransferError(f"cannot load NIXL metadata of {peer.worker_id}: {exc}") from exc
        self._peers[loaded] = peer.worker_id

    def start_send(
        self,
        conn: Connection,
        plan: TransferPlan,
        peer: Peer,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> Outbound:
        assert isinstance(peer, _NixlPeer)
        self.copies.sent(plan.nbytes)  # one-sided WRITE pool (or staging) -> pool: no stage
        info = peer.info
        n = len(plan)
        local = np.empty((n, 3), dtype=np.uint64)
        base = self._geometry.base_addr if plan.source is None else plan.source.data_ptr()
        local[:, 0] = plan.src_offsets + base
        local[:, 1] = plan.lengths
        local[:, 2] = self._agent.device_id
        remote = np.empty((n, 3), dtype=np.uint64)
        remote[:, 0] = plan.dst_offsets + info.pool_addr
        remote[:, 1] = plan.lengths
        remote[:, 2] = info.device_id
        tag = transfer_id.encode()
        self._load(peer)  # again after a disconnect (below), whichever connection asks
        try:
            return self._agent.write(peer.agent_name, local, remote, info.mem_type, tag)
        except Exception as exc:
            if "REMOTE_DISCONNECT" not in f"{type(exc).__name__} {exc}".upper():
                raise TransferError(
                    f"NIXL WRITE to {peer.agent_name} failed to start: {exc}"
                ) from exc
            # NIXL keeps a loaded agent's failed UCX endpoint (e.g. once UCX's keepalive gave
            # up during a network partition): every later WRITE to it would fail at once, even
            # with the network back. Unload the agent, load it afresh (a new connection) and
            # try once more.
            log.warning("NIXL lost %s (%s); reconnecting", peer.agent_name, exc)
            self._peers.pop(peer.agent_name, None)
            try:
                self._agent.remove_peer(peer.agent_name)
            except Exception as rm_exc:
                log.warning("NIXL could not unload %s: %s", peer.agent_name, rm_exc)
        self._load(peer)
        try:
            return self._agent.write(peer.agent_name, local, remote, info.mem_type, tag)
        except Exception as exc:
            raise TransferError(f"NIXL WRITE to {peer.agent_name} failed to start: {exc}") from exc

    async def receive(
        self,
        conn: Connection,
        plan: TransferPlan,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> None:
        # Poll notifications (progressing UCX) until the WRITE's notification arrived, while
        # the control message TransferDone/TransferFailed is awaited on the connection. The
        # notification comes after the bytes: with integrity on they are hashed right then,
        # while the sender's TransferDone and digests are on their way.
        self.copies.received(plan.nbytes)
        tag = transfer_id.encode()
        answer = asyncio.ensure_future(conn.recv())
        poller = Poller()
        notified = False
        try:
            while True:
                if not notified and self._agent.take_notif(tag):
                    notified = True
                    if digests is not None:
                        digests.update(len(plan))
                if answer.done():
                    wire.expect_done(answer.result(), transfer_id)  # or the peer's error
                    if notified:
                        return
                await poller.sleep()
        except BaseException:
            if not answer.done():  # the WRITE may still be running: stop it before returning
                await asyncio.shield(_abort(conn, transfer_id, answer))
            raise
        finally:
            answer.cancel()

    def register_staging(self, buf: torch.Tensor) -> None:
        self._staging[buf.data_ptr()] = self._agent.register(buf)

    def deregister_staging(self, buf: torch.Tensor) -> None:
        reg = self._staging.pop(buf.data_ptr(), None)
        if reg is not None:
            self._agent.deregister(reg)

    def close(self) -> None:
        for reg in self._staging.values():  # normally none left: the StagingPool closed first
            self._agent.deregister(reg)
        self._staging.clear()
        self._agent.close()


async def _abort(conn: Connection, transfer_id: str, answer: asyncio.Future[Any]) -> None:
    """Decode side gave up on ``transfer_id`` before the answer: send Abort and wait (bounded)
    for the answer, after which the prefill side writes nothing more. Closes ``conn``."""
    try:
        async with asyncio.timeout(_ABORT_WAIT_S):
            await conn.send(wire.Abort(transfer_id=transfer_id))
            await answer
    except TimeoutError:
        log.error(
            "prefill side %s did not confirm abort of %s; late NIXL writes may land",
            conn.peer,
            transfer_id,
        )
    except (TransferError, asyncio.CancelledError):
        # Connection lost (a prefill side that sees EOF cancels its WRITE too), or ``answer``
        # cancelled by the caller being cancelled again while this runs shielded.
        pass
    finally:
        conn.close()
