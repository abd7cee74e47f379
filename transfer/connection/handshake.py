"""The first exchange on every transfer connection: who is talking, in which layout, how.

Design origin: step 3 of the TensorRT-LLM seed's workflow ("if no prior connection exists, it is
established now; the generation phase shares its cache layout with the context phase") and vLLM's
NIXL handshake (compatibility checked before any byte moves, never silently reinterpreted).

It starts only once both sides proved that they hold the cluster secret
(:mod:`pdserve.transfer.connection.auth`; a failure raises TransferError ``kv_auth_failed``, and the
prefill side has done nothing for that peer). Then both sides run the same checks, so a
refusal raises on BOTH sides with the same message:

1. protocol version equal        else TransferError code ``kv_protocol_mismatch``
2. backend name equal            else TransferError code ``kv_backend_mismatch``
3. :meth:`Formatter.negotiate`   identity, or a converting formatter when only tokens per block,
                                 dtype and/or the tensor parallel split (``tp_size``: each side's
                                 rank layout travels in its layout) differ; else
                                 LayoutMismatchError naming the
                                 fields no formatter maps (e.g. ``num_kv_heads: 3 != 6``)
4. prefill side only: the backend prepares the peer (NIXL: ``add_remote_agent``; UCX: keeps
   the decode worker's UCX address for its endpoint)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pdserve.errors import TransferError
from pdserve.protocol import PROTOCOL_VERSION, KVLayout
from pdserve.security import ClusterKey
from pdserve.transfer import wire
from pdserve.transfer.backend import Backend, Peer
from pdserve.transfer.connection import auth
from pdserve.transfer.formatter.mapping import Formatter, PoolGeometry

if TYPE_CHECKING:
    from pdserve.transfer.connection.control import Connection
    from pdserve.transfer.formatter.staging import StagingPool


@dataclass(frozen=True)
class LocalSide:
    """This worker as its transceiver presents it to peers. Immutable for the process life.

    ``staging``: where a sender stages the bytes a converting formatter produces (layouts that
    differ in tokens per block or dtype); None refuses such sends. ``pool_device``: where the
    KV pool lives, which both sides tell each other (it chooses the block digest,
    :func:`pdserve.transfer.integrity.digests.choose_algorithm`). ``key``: the cluster
    secret's keys, which every connection proves both ways before this side trusts it."""

    worker_id: str
    epoch: int
    layout: KVLayout
    geometry: PoolGeometry
    backend: Backend
    staging: StagingPool | None = None
    key: ClusterKey = field(kw_only=True, repr=False)
    pool_device: Literal["cpu", "cuda"] = field(default="cpu", kw_only=True)

    async def connect(self, conn: Connection) -> tuple[wire.HelloAck, Formatter]:
        """Decode side, on a fresh connection to a prefill worker: authenticate both ways
        (:func:`pdserve.transfer.connection.auth.dial`), Hello, then check the HelloAck
        (:meth:`check_ack`) and that it comes from the incarnation whose proof was checked.
        Returns the ack and the negotiated formatter. Raises TransferError (``kv_auth_failed``
        among others), LayoutMismatchError; the caller closes ``conn`` on error."""
        challenge = await auth.dial(conn, self.key, self.worker_id)
        await conn.send(self.hello())  # P is proven: its Hello may carry NIXL/UCX addresses
        ack = await conn.recv()
        auth.check_refused(ack, conn.peer)
        if not isinstance(ack, wire.HelloAck):
            raise TransferError(f"expected hello_ack from {conn.peer}, got {ack.type!r}")
        formatter = self.check_ack(ack)
        if (ack.worker_id, ack.epoch) != (challenge.worker_id, challenge.epoch):
            raise TransferError(
                f"{conn.peer} authenticated as {challenge.worker_id} epoch {challenge.epoch} "
                f"but acknowledged as {ack.worker_id} epoch {ack.epoch}"
            )
        return ack, formatter

    def hello(self) -> wire.Hello:
        """Decode side: the connection's first message."""
        info = self.backend.hello_info()
        return wire.Hello(
            worker_id=self.worker_id,
            epoch=self.epoch,
            layout=self.layout,
            backend=self.backend.name,
            num_blocks=self.geometry.num_blocks,
            pool_device=self.pool_device,
            nixl=info if isinstance(info, wire.NixlPeerInfo) else None,
            ucx=info if isinstance(info, wire.UcxPeerInfo) else None,
        )

    def accept(self, hello: wire.Hello, peer_id: str) -> tuple[Formatter, Peer]:
        """Prefill side: check the Hello of a decode worker that authenticated as ``peer_id``
        (only then: this prepares the backend for the peer). Raises
        TransferError/LayoutMismatchError."""
        if hello.worker_id != peer_id:
            raise TransferError(
                f"decode worker authenticated as {peer_id!r} but says hello as {hello.worker_id!r}"
            )
        self._check(hello.protocol_version, hello.backend, hello.worker_id, role="decode")
        formatter = Formatter.negotiate(
            self.layout,
            hello.layout,
            self.geometry,
            PoolGeometry.of_layout(hello.layout, hello.num_blocks),
        )
        return formatter, self.backend.add_peer(hello)

    def ack(self, error: TransferError | None = None) -> wire.HelloAck:
        """Prefill side: the answer to a Hello (a refusal when ``error`` is given)."""
        return wire.HelloAck(
            ok=error is None,
            worker_id=self.worker_id,
            epoch=self.epoch,
            layout=self.layout,
            backend=self.backend.name,
            num_blocks=self.geometry.num_blocks,
            pool_device=self.pool_device,
            code=None if error is None else wire.error_code(error),
            message=None if error is None else error.message,
        )

    def check_ack(self, ack: wire.HelloAck) -> Formatter:
        """Decode side: the prefill worker's answer. Raises its refusal as the same error class,
        or the decode side's own finding."""
        if not ack.ok:
            raise wire.error_from_wire(ack.code, ack.message)
        self._check(ack.protocol_version, ack.backend, ack.worker_id, role="prefill")
        return Formatter.negotiate(
            ack.layout,
            self.layout,
            PoolGeometry.of_layout(ack.layout, ack.num_blocks),
            self.geometry,
        )

    def _check(self, version: int, backend: str, peer: str, *, role: str) -> None:
        if version != PROTOCOL_VERSION:
            raise TransferError(
                f"{role} worker {peer} speaks transfer protocol {version}, "
                f"this worker {PROTOCOL_VERSION}",
                code=wire.PROTOCOL_MISMATCH,
            )
        if backend != self.backend.name:
            raise TransferError(
                f"{role} worker {peer} uses transfer backend {backend!r} but this worker "
                f"{self.worker_id} uses {self.backend.name!r}; configure both with the same "
                "transfer backend",
                code=wire.BACKEND_MISMATCH,
            )
