"""In-process transfer backend (``"inproc"``): peers in one process copy KV bytes between their
registered pools, so the Sender/Receiver/transceiver logic (handshake, fencing, digests,
release) runs in unit tests without a second process and without moving KV bytes over a
socket. The control messages still travel on the transceivers' connections.

Design: SGLang's ``disaggregation/fake/conn.py`` and httpx's ``MockTransport``: the same
:class:`~pdserve.transfer.backend.Backend` interface, a trivial data plane. It is a one-sided
WRITE like NIXL's (``inline_bytes = False``): the sender copies into the receiver's pool, then
sends TransferDone; BlockDigests follow it when asked.

Rendezvous, per transfer (``transfer_id`` is unique per pull)::

    decode:  SendBlocks -> receive(): post (transfer_id -> local pool) on the fabric,
             await TransferDone (or TransferFailed), withdraw the post (finally)
    prefill: start_send() -> poll(): once the post is there, copy every plan segment
             (pool or staging buffer -> the posted pool) and report DONE

Nothing lands after :meth:`InprocBackend.receive` returned or raised (the post is withdrawn
and the copy runs only inside ``poll`` on the same event loop thread), so ``late_writes`` is
False. Only peers in one process and on one event loop thread can pair; a peer in another
process never finds the post and its send times out.

Copies (:mod:`pdserve.transfer.formatter.copies`): like NIXL's, none beyond the pool-to-pool copy
itself (plus the converting formatter's staging, counted by the StagingPool); the backend's
counter gets each side's payload.

Fault injection for tests (:class:`InprocFabric`): ``paused`` holds every copy back (a
stalled peer), ``on_copy(dst, plan)`` runs after a copy (e.g. flip a byte: corruption).
CPU pools only (ConfigError otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from pdserve.errors import ConfigError, TransferError
from pdserve.transfer import wire
from pdserve.transfer.backend import Backend, Digests, Outbound, Peer, TransferState
from pdserve.transfer.formatter.mapping import PoolGeometry, TransferPlan, pool_bytes

if TYPE_CHECKING:
    from pdserve.config.settings import TransferSettings
    from pdserve.transfer.connection.control import Connection

log = logging.getLogger(__name__)


@dataclass
class _Post:
    """A receiver's open pull: where the bytes of ``transfer_id`` go."""

    dst: np.ndarray  # the receiver's pool as flat uint8 (a view, no copy)
    nbytes: int


class InprocFabric:
    """The "network" between in-process peers: open posts by transfer id, and fault hooks.

    Thread-safety: the event loop's thread only (as every backend).
    """

    def __init__(self) -> None:
        self._posts: dict[str, _Post] = {}
        self.paused = False
        self.on_copy: Callable[[np.ndarray, TransferPlan], None] | None = None
        self.copies = 0

    def post(self, transfer_id: str, post: _Post) -> None:
        if transfer_id in self._posts:
            raise TransferError(f"transfer {transfer_id} is already posted")
        self._posts[transfer_id] = post

    def withdraw(self, transfer_id: str) -> None:
        self._posts.pop(transfer_id, None)

    def lookup(self, transfer_id: str) -> _Post | None:
        return None if self.paused else self._posts.get(transfer_id)

    def reset(self) -> None:
        """Clear the hooks and the copy count (not the posts of running pulls)."""
        self.paused = False
        self.on_copy = None
        self.copies = 0


FABRIC = InprocFabric()
"""The process's fabric: every :class:`InprocBackend` pairs through it (it stands for the
network, which is shared by every peer in the process)."""


def _flat(memory: torch.Tensor) -> np.ndarray:
    return np.frombuffer(pool_bytes(memory), dtype=np.uint8)


class _Copy(Outbound):
    """One send: copies every segment the first time the receiver's post is there."""

    def __init__(self, src: np.ndarray, plan: TransferPlan, transfer_id: str, fabric: InprocFabric):
        self._src = src
        self._plan = plan
        self._transfer_id = transfer_id
        self._fabric = fabric
        self._state = TransferState.RUNNING

    def poll(self) -> TransferState:
        if self._state is not TransferState.RUNNING:
            return self._state
        post = self._fabric.lookup(self._transfer_id)
        if post is None:
            return TransferState.RUNNING
        plan = self._plan
        if post.nbytes != plan.nbytes:
            self.failure = f"receiver expects {post.nbytes} bytes, the plan moves {plan.nbytes}"
            self._state = TransferState.FAILED
            return self._state
        for s, d, n in zip(
            plan.src_offsets.tolist(), plan.dst_offsets.tolist(), plan.lengths.tolist(), strict=True
        ):
            post.dst[d : d + n] = self._src[s : s + n]
        self._fabric.copies += 1
        if self._fabric.on_copy is not None:
            self._fabric.on_copy(post.dst, plan)
        self._state = TransferState.DONE
        return self._state

    def abort(self) -> None:
        if self._state is TransferState.RUNNING:
            self._state = TransferState.FAILED
            self.failure = self.failure or "aborted"


class InprocBackend(Backend):
    """KV bytes copied between pools of one process (see the module docstring).

    Raises ConfigError for a pool that is not in CPU memory.
    """

    name: ClassVar[str] = "inproc"
    inline_bytes: ClassVar[bool] = False

    def __init__(
        self,
        *,
        cfg: TransferSettings,
        pool: torch.Tensor,
        geometry: PoolGeometry,
        agent_name: str,
        fabric: InprocFabric = FABRIC,
    ):
        if pool.device.type != "cpu":
            raise ConfigError(f"the inproc transfer backend needs a CPU pool, not {pool.device}")
        self._pool = _flat(pool)
        self._fabric = fabric
        self.agent_name = agent_name

    @property
    def late_writes(self) -> bool:
        """Nothing lands once :meth:`receive` ended (the copy runs only while it waits)."""
        return False

    def start_send(
        self,
        conn: Connection,
        plan: TransferPlan,
        peer: Peer,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> Outbound:
        self.copies.sent(plan.nbytes)  # copied pool (or staging) -> pool: no stage of its own
        src = self._pool if plan.source is None else _flat(plan.source)
        return _Copy(src, plan, transfer_id, self._fabric)

    async def receive(
        self,
        conn: Connection,
        plan: TransferPlan,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> None:
        self.copies.received(plan.nbytes)
        self._fabric.post(transfer_id, _Post(self._pool, plan.nbytes))
        try:
            nbytes = wire.expect_done(await conn.recv(), transfer_id)  # raises TransferFailed's
        finally:
            self._fabric.withdraw(transfer_id)
        if nbytes != plan.nbytes:
            raise TransferError(
                f"peer {conn.peer} moved {nbytes} bytes for {transfer_id}, expected {plan.nbytes}"
            )
