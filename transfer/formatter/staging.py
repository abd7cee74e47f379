"""Staging memory of a converting sender: the buffers a converting send reads from.

:class:`StagingPool` lends them, one per send in flight, kept for reuse (the NIXL backend must
register memory it sends from, which costs more than a request) and grown when a larger
request comes. The kernel that fills them is :func:`pdserve.transfer.formatter.convert.reblock`, run by
the formatter (:meth:`pdserve.transfer.formatter.mapping.Formatter.stage`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pdserve.errors import TransferError
from pdserve.transfer.backend import Backend
from pdserve.transfer.formatter.copies import FORMATTER_STAGING, SEND
from pdserve.transfer.formatter.mapping import Formatter, TransferPlan

log = logging.getLogger(__name__)

_GRANULE = 1 << 20
"""Staging buffers are whole MiB, with a quarter headroom, so growth re-registers rarely."""


class StagingPool:
    """Staging buffers of one sender (its transceiver), lent one per converting send.

    Ownership: the pool owns every buffer; :meth:`fill` lends one to the returned plan (as
    ``plan.source``) until :meth:`release`, which the caller must reach once the backend has
    stopped reading it (the send is done, failed or aborted). Buffers are 1-D ``uint8`` on the
    KV pool's device, registered with the backend (``Backend.register_staging``) for as long as
    the pool keeps them; at most ``max_idle`` stay allocated between sends. Memory in use is
    bounded by the concurrent converting sends times the largest request's staging size.

    Thread-safety: the transceiver's event-loop thread only. :meth:`close` is idempotent.
    """

    def __init__(self, pool: torch.Tensor, backend: Backend, max_idle: int = 2):
        self._pool = pool
        self._backend = backend
        self._max_idle = max_idle
        self._idle: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> buffer
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory allocated now (idle + lent)."""
        return sum(b.numel() for b in (*self._idle, *self._lent.values()))

    def fill(
        self,
        formatter: Formatter,
        src_ids: Sequence[int],
        dst_ids: Sequence[int],
        plan: TransferPlan,
    ) -> TransferPlan:
        """Stage ``plan`` when ``formatter`` needs it: returns the plan reading from a lent
        buffer that holds the K/V of ``src_ids`` in the destination layout; else ``plan``.
        Raises TransferError (closed, allocation or registration failure).

        The kernel runs here, on the event loop's thread (about a memcpy of the output:
        measured 4-8 ms for 512 tokens and 14-15 ms for 2048 of SmolLM2, one torch thread, on
        a busy 2-core machine; prefilling those tokens takes seconds), which keeps
        cancellation simple: nothing else writes a lent buffer. The staged bytes (the plan's)
        are counted as the ``formatter_staging`` copy of the backend's counter
        (:mod:`pdserve.transfer.formatter.copies`)."""
        if not formatter.staged:
            return plan
        if self._closed:
            raise TransferError("transceiver is closed; no staging buffer")
        buf = self._checkout(formatter.staging_nbytes(len(dst_ids)))
        try:
            source = formatter.stage(self._pool, src_ids, len(dst_ids), buf)
        except (RuntimeError, IndexError) as exc:  # torch refused the gather or the copy
            self._give_back(buf)
            raise TransferError(f"KV staging failed: {exc}") from exc
        except BaseException:
            self._give_back(buf)
            raise
        self._lent[buf.data_ptr()] = buf
        self._backend.copies.copied(SEND, FORMATTER_STAGING, source.numel())  # uint8: bytes
        return plan.with_source(source)

    def release(self, plan: TransferPlan) -> None:
        """Take back the buffer ``plan`` reads from (idempotent; no-op for a pool plan)."""
        if plan.source is None:
            return
        buf = self._lent.pop(plan.source.data_ptr(), None)
        if buf is not None:
            self._give_back(buf)

    def close(self) -> None:
        """Deregister and drop every buffer; call once no send reads one. Idempotent."""
        self._closed = True
        for buf in (*self._idle, *self._lent.values()):
            self._drop(buf)
        self._idle.clear()
        self._lent.clear()

    def _checkout(self, nbytes: int) -> torch.Tensor:
        fits = [b for b in self._idle if b.numel() >= nbytes]
        if fits:
            buf = min(fits, key=torch.Tensor.numel)
            self._idle.remove(buf)
            return buf
        if self._idle:  # too small for this request: replace the largest by a larger one
            old = max(self._idle, key=torch.Tensor.numel)
            self._idle.remove(old)
            self._drop(old)
        size = -(-(nbytes + nbytes // 4) // _GRANULE) * _GRANULE
        try:
            buf = torch.empty(size, dtype=torch.uint8, device=self._pool.device)
            self._backend.register_staging(buf)
        except TransferError:
            raise
        except Exception as exc:  # out of memory, or the backend's library refused it
            raise TransferError(f"cannot set up a {size} byte KV staging buffer: {exc}") from exc
        log.debug("KV staging buffer of %.1f MiB allocated", size / 2**20)
        return buf

    def _give_back(self, buf: torch.Tensor) -> None:
        if self._closed:
            self._drop(buf)
            return
        self._idle.append(buf)
        if len(self._idle) > self._max_idle:
            smallest = min(self._idle, key=torch.Tensor.numel)
            self._idle.remove(smallest)
            self._drop(smallest)

    def _drop(self, buf: torch.Tensor) -> None:
        try:
            self._backend.deregister_staging(buf)
        except Exception as exc:  # best effort: the memory goes either way
            log.warning("could not deregister a KV staging buffer: %s", exc)
