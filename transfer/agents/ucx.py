"""Connection over UCX (ucxx tagged send/receive) and the UCX transfer backend.

Design origin: the TensorRT-LLM seed's *Connection* ("bidirectional byte-stream protocol
facility ... UCX accesses the system through this facility"), over ``ucxx`` (ucx-py's
successor). Peers find each other the way NIXL agents do (vLLM's NIXL connector): by UCX *worker
addresses* exchanged in the handshake, so a worker needs no second listening port and the
control conversation stays the TCP one of :mod:`pdserve.transfer.wire`.

Per control connection and per request (decode D pulls from prefill P)::

    handshake  D -> P  Hello{ucx: D's worker address}
               P: UcxConnection to D's worker (made at the first send on this control connection)
    request    D -> P  SendBlocks
               D: posts one tagged receive per plan segment, straight into its pool
               P: posts one tagged send per plan segment, from its pool (or staging buffer)
                  tag of segment k = transfer_tag(transfer_id) | k
               P -> D  TransferDone            once every send completed
               D: returns once every receive completed AND TransferDone arrived
               (then BlockDigests if asked, Release: the Sender/Receiver's business)

Why tagged messages: UCX moves each one with the best protocol it has for the pair of
processes (same host: shared memory; other hosts: TCP, or RDMA where there is some), straight
into the posted buffer; receives are matched on tags, so all segments of a request are in
flight at once, in any order. There is one message per plan segment (``num_layers *
num_runs``; 30 for a SmolLM2 request of one run), never one per block per layer. Posting costs
about 5-10 us per message and side through ucxx's Python API (no descriptor-list call as in
NIXL), so a request has a fixed cost of roughly 0.5-1 ms; gathering the segments into one
message (two extra copies) showed no clear gain in measurements on this (loaded) machine.

Progress: no progress thread and no ucxx asyncio progress task. The worker is progressed from
the owning event loop (``UCXWorker.progress``), and only while a request of this backend is in
flight (:class:`~pdserve.transfer.backend.Poller`: spin with ``sched_yield``, then 1 ms sleeps).
This is ucxx's "polling" mode (measured several times faster than its default thread mode on 2
cores) without its permanent spin task, which would burn a core on an idle worker; the
``sched_yield`` roughly tripled GB/s with more runnable processes than cores. So the ucxx
asyncio API (``create_listener``/``create_endpoint``, whose progress mode comes from
``UCXPY_PROGRESS_MODE`` or ``ucxx.init``) is not used at all: this module drives ucxx's core
objects (``UCXContext``, ``UCXWorker``, ``UCXEndpoint``, requests polled for completion).
UCX options are passed to the UCX context (:data:`UCX_OPTIONS`, ``cfg.net_devices`` as
``NET_DEVICES``: ``ucx_devices``, or ``lo`` when the transceiver binds loopback); nothing
writes ``os.environ``, and ``UCX_*`` variables still apply to what the options leave unset
(e.g. ``UCX_TLS``).

Same host and across hosts: UCX picks the transports per peer from the worker addresses.
On one host that is shared memory (``sysv``; large messages go as a rendezvous through
shared-memory fragments); CMA is not used because it offers no peer-failure handling, and
with error handling off a prefill worker dying during a CMA read aborts the decode process
(seen). Across hosts it is TCP on the devices ``cfg.net_devices`` names (all by default).

Failures: endpoints have peer error handling on, so a dying peer fails requests. The control
connection is the failure detector: EOF, TransferFailed or the receiver's deadline end the
wait. ucxx exposes no per-request cancel, but closing an endpoint cancels every request posted
through it that is not yet under way, so each control connection has its own
:class:`UcxConnection` on both sides and abandoning a request closes it (a new one is made for
the next request). On the decode side, whose receives need no remote endpoint (tag matching is
per worker), the endpoint is one to its own worker: the cancellation scope of that connection's
receives. A receive already under way completes, or fails once UCX keepalive (every second
while progressed) finds its sender gone or its send cancelled; :meth:`UcxRequests.settle`
waits for that, bounded (a dead sender not yet reaped by its parent, a zombie, still looks
alive to UCX on one host; ``pdserve up`` reaps within 0.5 s). Without RDMA hardware, bytes land in the pool only inside this
process's progress calls, so once a receive has completed nothing more lands in its segment.

One UCX per process: a process that loaded another UCX first (NIXL bundles its own) owns the
memory hooks, so this UCX runs without its registration cache, and UCX 1.21 then crashes
(segfault, seen) when closing an endpoint cancels a rendezvous send. pdserve workers load one
backend; :class:`UcxWorker` logs a warning where NIXL is already loaded (test processes).

Import side effect (of ucxx, not of this module): importing ``ucxx`` sets ``UCX_MEMTYPE_CACHE``,
``UCX_RNDV_THRESH`` and ``UCX_RNDV_FRAG_MEM_TYPE`` in ``os.environ`` when unset. ucxx is imported
lazily in :class:`UcxWorker`, so only a process that uses this backend is affected.

Thread-safety: everything runs on the owning event loop's thread (UCX worker not shared).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import sys
import time
from typing import Any

import numpy as np
import torch

from pdserve.config.settings import TransferSettings
from pdserve.errors import ConfigError, TransferError
from pdserve.transfer import wire
from pdserve.transfer.backend import Backend, Digests, Outbound, Peer, Poller, TransferState
from pdserve.transfer.connection.control import Connection
from pdserve.transfer.formatter.mapping import PoolGeometry, TransferPlan, pool_bytes

log = logging.getLogger(__name__)

SEGMENT_BITS = 20
"""Low bits of a tag that number the segments of one transfer (at most 2**20 segments)."""

UCX_OPTIONS: dict[str, str] = {
    # UCX's shared-memory transports claim peer-failure handling only when asked to; without
    # it, an endpoint with error handling never uses them and two workers on one host talk TCP
    # over loopback (measured 0.2-0.5 GB/s instead of 6-9 GB/s at 16-64 MiB).
    "MM_ERROR_HANDLING": "y",
    # ucxx's import exports UCX_MEMTYPE_CACHE (a CUDA setting this UCX no longer knows), which
    # UCX would warn about at every start.
    "WARN_UNUSED_ENV_VARS": "n",
    # A request under way whose peer died, or cancelled its send, fails when keepalive finds
    # out (default: every 20 s). Keepalive runs only while the worker is progressed.
    "KEEPALIVE_INTERVAL": "1s",
    # TCP (across hosts): 256 KiB segments instead of 64 KiB, fewer wake-ups per MiB; measured
    # 2-4x GB/s for 1-64 MiB requests over UCX_TLS=tcp. Every worker sets the same sizes (a
    # receive segment must hold the peer's send segment).
    "TCP_TX_SEG_SIZE": "256k",
    "TCP_RX_SEG_SIZE": "256k",
}
"""UCX context options (``UCX_`` prefix dropped) of every worker; they override the
environment. ``cfg.ucx_devices`` adds ``NET_DEVICES``."""

_SETTLE_S = 2.0
"""How long cancelled requests may take to complete (they normally do at once)."""

_MAX_ORPHANS = 1 << 16
"""Bound on the unreceived messages dropped at close."""


def transfer_tag(transfer_id: str) -> int:
    """The 64-bit tag base of a transfer: 44 bits of a hash of ``transfer_id`` (unique per pull),
    the low :data:`SEGMENT_BITS` left zero for the segment index."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ~((1 << SEGMENT_BITS) - 1) & (2**64 - 1)


class UcxWorker:
    """One UCX context and worker with the tag feature; one per transceiver, owning both until
    :meth:`close`. ``devices`` restricts UCX's network devices (e.g. ``"lo"``; None: all).

    Raises ImportError without ucxx, ConfigError if UCX does not initialise.
    """

    def __init__(self, devices: str | None):
        if any(name.split(".")[0].startswith("nixl") for name in sys.modules):
            log.warning(
                "NIXL is loaded in this process: UCX runs without its registration cache, and "
                "cancelling a transfer under way may crash it (see pdserve.transfer.agents.ucx)"
            )
        import ucxx._lib.libucxx as ucx_api  # lazy: heavy optional dependency
        from ucxx._lib.arr import Array

        self.api: Any = ucx_api
        self.array: Any = Array
        options = dict(UCX_OPTIONS)
        if devices:
            options["NET_DEVICES"] = devices
        try:
            self._context: Any = ucx_api.UCXContext(options, feature_flags=(ucx_api.Feature.TAG,))
            self.worker: Any = ucx_api.UCXWorker(self._context)
            self.address: bytes = self.worker.address.tobytes()
        except Exception as exc:  # ucxx raises its own UCXXError family
            raise ConfigError(f"UCX did not initialise: {exc}") from exc
        self.closed = False

    def progress(self) -> None:
        """Advance every request of this worker (non-blocking)."""
        self.worker.progress()

    def close(self) -> None:
        """Drop the worker and context (after every UcxConnection closed); idempotent.

        Messages that arrived for receives already cancelled (a transfer abandoned while its
        sends were on the way) are dropped unreceived first: ucxx's worker destructor receives
        every pending message, and waits forever on one whose sender cancelled it and no longer
        progresses."""
        if self.closed:
            return
        self.closed = True
        anything, mask = self.api.UCXXTag(0), self.api.UCXXTagMask(0)
        try:
            for _ in range(_MAX_ORPHANS):
                if not self.worker.tag_probe(anything, mask, True).matched:
                    break
        except Exception as exc:  # best effort at shutdown
            log.warning("UCX: could not drop unreceived messages: %s", exc)
        self.worker = None
        self._context = None


class UcxConnection:
    """The seed's Connection on UCX: one endpoint from this worker to the worker at ``address``.

    :meth:`send` posts tagged sends to that worker; :meth:`recv` posts tagged receives, matched
    on this worker whoever sends. Both are tracked by the endpoint, so :meth:`close` cancels
    whatever is still in flight. Raises TransferError if the endpoint cannot be made.
    """

    def __init__(self, worker: UcxWorker, address: bytes, peer: str):
        self._worker = worker
        self.peer = peer
        api = worker.api
        try:
            self._ep: Any = worker.worker.create_endpoint_from_worker_address(
                api.UCXAddress.create_from_buffer(address), True
            )
        except Exception as exc:
            raise TransferError(f"UCX endpoint to {peer} failed: {exc}") from exc
        self.closed = False

    def send(
        self, buf: memoryview, offsets: np.ndarray, lengths: np.ndarray, tag: int
    ) -> UcxRequests:
        """Post the sends of ``buf[offsets[k] : offsets[k] + lengths[k]]`` with tag ``tag | k``
        (no copy: UCX reads ``buf`` until the requests complete). Raises TransferError."""
        return self._post(buf, offsets, lengths, tag, send=True)

    def recv(
        self, buf: memoryview, offsets: np.ndarray, lengths: np.ndarray, tag: int
    ) -> UcxRequests:
        """Post the receives of the messages tagged ``tag | k`` straight into ``buf[offsets[k] :
        offsets[k] + lengths[k]]`` (an exact length: a longer message fails the receive)."""
        return self._post(buf, offsets, lengths, tag, send=False)

    def close(self) -> None:
        """Cancel the requests in flight through this endpoint and close it; idempotent. The
        cancelled requests complete with status CANCELED (see :meth:`UcxRequests.abort`)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._ep.close_blocking()
        except Exception as exc:  # a failed peer's endpoint may refuse a clean close
            log.debug("UCX endpoint to %s closed with %s", self.peer, exc)

    def _post(
        self, buf: memoryview, offsets: np.ndarray, lengths: np.ndarray, tag: int, *, send: bool
    ) -> UcxRequests:
        if self.closed:
            raise TransferError(f"UCX connection to {self.peer} is closed")
        if lengths.size >> SEGMENT_BITS:
            raise TransferError(f"{lengths.size} segments exceed one transfer's tag space")
        api, array, ep = self._worker.api, self._worker.array, self._ep
        post = ep.tag_send if send else ep.tag_recv
        requests: list[Any] = []
        try:
            for k, (o, n) in enumerate(zip(offsets.tolist(), lengths.tolist(), strict=True)):
                requests.append(post(array(buf[o : o + n]), api.UCXXTag(tag | k)))
        except Exception as exc:
            self.close()  # cancels what was posted
            raise TransferError(f"UCX could not post a transfer to {self.peer}: {exc}") from exc
        return UcxRequests(self, self._worker, requests)


class UcxRequests(Outbound):
    """The posted sends (prefill side) or receives (decode side) of one request.

    :meth:`poll` progresses the worker and reports DONE once every request completed, FAILED
    as soon as one completed with an error (``failure`` says which). To stop early,
    :meth:`abort` (blocking) or :meth:`settle` (awaitable) close the request's
    :class:`UcxConnection`, which cancels every request not yet under way, and wait, bounded by
    :data:`_SETTLE_S`, until every request completed (finished, cancelled, or failed: one under
    way fails once UCX's keepalive finds its peer gone or its send cancelled). None reads or
    writes its buffer after that.
    """

    def __init__(self, conn: UcxConnection, worker: UcxWorker, requests: list[Any]):
        self._conn = conn
        self._worker = worker
        self._requests = requests
        self._done = 0  # requests[:_done] completed successfully
        self._state = TransferState.RUNNING

    def poll(self) -> TransferState:
        if self._state is not TransferState.RUNNING:
            return self._state
        self._worker.progress()
        requests = self._requests
        while self._done < len(requests) and requests[self._done].completed:
            request = requests[self._done]
            if request.status != 0:  # UCS_OK
                self.failure = f"UCX request to/from {self._conn.peer}: {_error_text(request)}"
                self._state = TransferState.FAILED
                return self._state
            self._done += 1
        if self._done == len(requests):
            self._state = TransferState.DONE
        return self._state

    def abort(self) -> None:
        if not self._cancel():
            return
        deadline = time.monotonic() + _SETTLE_S
        while self._pending():
            if time.monotonic() > deadline:
                self._give_up()
                return
            self._worker.progress()

    async def settle(self) -> None:
        """:meth:`abort` without blocking the event loop."""
        if not self._cancel():
            return
        deadline = time.monotonic() + _SETTLE_S
        poller = Poller()
        while self._pending():
            if time.monotonic() > deadline:
                self._give_up()
                return
            self._worker.progress()
            await poller.sleep()

    def _cancel(self) -> bool:
        """Close the connection if a request is still pending; False if none is."""
        if not self._pending():
            return False
        self._conn.close()
        return True

    def _pending(self) -> bool:
        return not all(r.completed for r in self._requests[self._done :])

    def _give_up(self) -> None:
        log.error(
            "UCX requests with %s still pending %.1f s after cancel; their buffers may still "
            "be written",
            self._conn.peer,
            _SETTLE_S,
        )


def _error_text(request: Any) -> str:
    try:
        request.check_error()
    except Exception as exc:  # ucxx's UCXXError family names the UCS status
        return f"{type(exc).__name__}: {exc}"
    return f"status {request.status}"


class _UcxPeer(Peer):
    """A decode worker connected to this prefill worker: its UCX worker address."""

    def __init__(self, worker_id: str, address: bytes):
        self.worker_id = worker_id
        self.address = address


class UcxBackend(Backend):
    """KV bytes as tagged UCX messages, one per plan segment, zero-copy on both ends (CPU).

    Owns a :class:`UcxWorker` and one :class:`UcxConnection` per control connection in use
    (sender: to the decode worker; receiver: its cancellation scope), closed when that control
    connection is found closed, when a request on it is abandoned, and at :meth:`close`.
    Raises ConfigError for a CUDA pool or a UCX that does not initialise.
    """

    name = "ucx"
    inline_bytes = False

    def __init__(
        self, *, cfg: TransferSettings, pool: torch.Tensor, geometry: PoolGeometry, agent_name: str
    ):
        if pool.device.type != "cpu":  # ucxx here is a CUDA 12 build; device memory untested
            raise ConfigError(
                f"the ucx transfer backend moves KV from CPU pools only, this pool is on "
                f"{pool.device}: use transfer backend 'nixl' (registers GPU memory) or 'tcp' "
                "(stages through pinned host memory)"
            )
        self._bytes = pool_bytes(pool)
        self._worker = UcxWorker(cfg.net_devices)
        self._address_b64 = base64.b64encode(self._worker.address).decode()
        self._links: dict[Connection, UcxConnection] = {}

    def hello_info(self) -> wire.UcxPeerInfo:
        return wire.UcxPeerInfo(address_b64=self._address_b64)

    def add_peer(self, hello: wire.Hello) -> Peer:
        if hello.ucx is None:
            raise TransferError(f"decode worker {hello.worker_id} sent no UCX worker address")
        try:
            address = base64.b64decode(hello.ucx.address_b64, validate=True)
        except ValueError as exc:
            raise TransferError(f"bad UCX address from {hello.worker_id}: {exc}") from exc
        return _UcxPeer(hello.worker_id, address)

    def start_send(
        self,
        conn: Connection,
        plan: TransferPlan,
        peer: Peer,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> Outbound:
        assert isinstance(peer, _UcxPeer)
        self.copies.sent(plan.nbytes)  # tagged sends pool (or staging) -> pool: no stage
        src = self._bytes if plan.source is None else pool_bytes(plan.source)  # staged bytes
        link = self._link(conn, peer.address, peer.worker_id)
        return link.send(src, plan.src_offsets, plan.lengths, transfer_tag(transfer_id))

    async def receive(
        self,
        conn: Connection,
        plan: TransferPlan,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> None:
        # Receives first (the sends may already be on their way), then poll them while the
        # control answer (TransferDone / TransferFailed) is awaited on the connection.
        self.copies.received(plan.nbytes)
        link = self._link(conn, self._worker.address, conn.peer)
        inbound = link.recv(self._bytes, plan.dst_offsets, plan.lengths, transfer_tag(transfer_id))
        answer = asyncio.ensure_future(conn.recv())
        poller = Poller()
        try:
            while True:
                state = inbound.poll()
                if state is TransferState.FAILED:
                    raise TransferError(
                        f"UCX transfer {transfer_id} from {conn.peer} lost: {inbound.failure}"
                    )
                if answer.done():
                    nbytes = wire.expect_done(answer.result(), transfer_id)  # or peer's error
                    if nbytes != plan.nbytes:
                        raise TransferError(
                            f"peer {conn.peer} sent {nbytes} bytes for {transfer_id}, "
                            f"expected {plan.nbytes}"
                        )
                    if state is TransferState.DONE:
                        return
                await poller.sleep()
        except BaseException:
            # Nothing lands in the destination blocks after this (bounded; see settle). Shielded:
            # a second cancellation must not cut it short.
            await asyncio.shield(inbound.settle())
            raise
        finally:
            answer.cancel()

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._worker.close()

    def _link(self, conn: Connection, address: bytes, peer: str) -> UcxConnection:
        """The UcxConnection of control connection ``conn`` (made on first use, and again after
        an abandoned request closed it); closes those of control connections now closed."""
        for stale in [c for c, link in self._links.items() if c.closed or link.closed]:
            self._links.pop(stale).close()
        link = self._links.get(conn)
        if link is None:
            if self._worker.closed:
                raise TransferError("UCX transfer backend is closed")
            link = self._links[conn] = UcxConnection(self._worker, address, peer)
        return link
