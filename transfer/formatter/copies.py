"""How many times the KV bytes of a transfer are copied on their way from the prefill pool to the
decode pool: the intermediate buffers they pass through, counted where the copies happen.

A *stage* is one intermediate buffer (a byte passing through it is one staging copy on top of
the pool-to-pool move itself); each stage is counted on the side that fills it::

    stage               side     where                        when
    formatter_staging   send     StagingPool.fill             layouts differ (ConvertingFormatter)
    socket              send     TcpBackend.start_send        tcp: the kernel's socket buffers
    host_staging        send     HostStage.gather (tcp)       CUDA pool: pinned host buffer
    host_staging        receive  HostStage.scatter (tcp)      CUDA pool: pinned host buffer

So per byte moved: nixl and ucx (CPU pools) make 0 staging copies for equal layouts, tcp 1 (the
socket); a converting formatter adds 1 on any backend; a CUDA pool on tcp adds 1 on its side.
The payload (the plan's bytes) is counted by every backend where a send starts (``start_send``)
and where a receive starts (``receive``), failed transfers included; a probe's bytes
(:mod:`pdserve.transfer.bandwidth_probe`) and the integrity digests' host copies are not transfers and
are not counted. The conversion's own working memory inside the staging pass (dtype chunks,
head merges) is not a stage: the bytes do not wait there for the backend.

Ownership: one :class:`CopyCounter` per transceiver (``Transceiver.copies``), handed to its
backend (``Backend.copies``) and read by the worker's metrics at scrape time. Thread-safety:
the transceiver's event-loop thread writes it (a scrape on another thread may read a count one
transfer behind). Costs a few dict updates per transfer, nothing per block or per layer.
"""

from __future__ import annotations

SEND = "send"
"""The prefill side of a transfer (the Sender's backend ``start_send``)."""
RECEIVE = "receive"
"""The decode side of a transfer (the Receiver's backend ``receive``)."""
SIDES = (SEND, RECEIVE)

FORMATTER_STAGING = "formatter_staging"
"""Sender: the converting formatter's staging buffer (:class:`~pdserve.transfer.formatter.staging.StagingPool`)."""
SOCKET = "socket"
"""TCP: the kernel's socket buffers (``sendmsg`` copies the bytes in, ``recvmsg_into`` out)."""
HOST_STAGING = "host_staging"
"""CUDA pool on TCP, either side: the pinned host buffer (:mod:`pdserve.transfer.formatter.hoststage`)."""
STAGES = (FORMATTER_STAGING, SOCKET, HOST_STAGING)


class CopyCounter:
    """Bytes per stage and side, payload bytes and transfers per side, since creation.

    ``staged[(side, stage)]``: bytes copied into that stage's buffer (bytes, not copies);
    ``payload[side]``: bytes the plans of this side's transfers move; ``transfers[side]``:
    transfers started. Every key of :data:`SIDES` x :data:`STAGES` is present from the start.
    """

    __slots__ = ("payload", "staged", "transfers")

    def __init__(self) -> None:
        self.staged: dict[tuple[str, str], int] = {(s, g): 0 for s in SIDES for g in STAGES}
        self.payload: dict[str, int] = dict.fromkeys(SIDES, 0)
        self.transfers: dict[str, int] = dict.fromkeys(SIDES, 0)

    def sent(self, nbytes: int) -> None:
        """A send of ``nbytes`` payload bytes started (the backend's ``start_send``)."""
        self.payload[SEND] += nbytes
        self.transfers[SEND] += 1

    def received(self, nbytes: int) -> None:
        """A receive of ``nbytes`` payload bytes started (the backend's ``receive``)."""
        self.payload[RECEIVE] += nbytes
        self.transfers[RECEIVE] += 1

    def copied(self, side: str, stage: str, nbytes: int) -> None:
        """``nbytes`` were copied into the buffer of ``stage`` on ``side``."""
        self.staged[side, stage] += nbytes

    def copies_per_byte(self, side: str | None = None) -> float:
        """Staging copies per payload byte on ``side`` (staged bytes / payload bytes; 0.0
        before any payload), or summed over both sides (None). For a transfer path: the
        sender's ``SEND`` plus the receiver's ``RECEIVE`` (:func:`path_copies`)."""
        sides = SIDES if side is None else (side,)
        total = 0.0
        for s in sides:
            if self.payload[s]:
                staged = sum(self.staged[s, g] for g in STAGES)
                total += staged / self.payload[s]
        return total

    def __repr__(self) -> str:
        staged = {f"{s}/{g}": n for (s, g), n in self.staged.items() if n}
        return f"CopyCounter(payload={self.payload}, staged={staged})"


def path_copies(sender: CopyCounter, receiver: CopyCounter) -> float:
    """Staging copies per byte between a prefill pool (``sender``'s counter) and a decode pool
    (``receiver``'s): 0 for nixl or ucx with equal layouts, 1 for tcp, +1 for a converting
    formatter, +1 for each CUDA pool on tcp."""
    return sender.copies_per_byte(SEND) + receiver.copies_per_byte(RECEIVE)
