"""The write-behind queue of the KV tiers that store blocks away from the engine thread (the disk
tier, :class:`~pdserve.workers.kv.tiers.DiskTier`, and the remote tier,
:class:`~pdserve.workers.kv.remote.RemoteTier`): blocks wait in a FIFO bounded in bytes and
one background thread hands them to the tier's write function, ``batch`` at a time. A block
stays visible in the queue (:meth:`WriteQueue.get`) until its write returned, so a reader
never misses a block that is on its way.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import torch

log = logging.getLogger(__name__)

Batch = list[tuple[int, torch.Tensor]]
"""``(block hash, kv)`` pairs in queue order."""

Offer = Literal["queued", "refused", "full"]
"""What :meth:`WriteQueue.offer` did: queued it; refused it (already queued, or the queue is
closed); or dropped it because it would pass the byte bound."""


class WriteQueue:
    """Blocks waiting for ``write`` (called on one daemon thread named ``name`` with up to
    ``batch`` blocks; it owns its failures, and one that still raises is logged and reported
    to ``on_error``), at most ``max_pending_bytes`` of tensors. The queue owns the tensors it
    took until their write returned. Thread-safe; every method is O(1) but :meth:`flush` and
    :meth:`close`, which wait."""

    def __init__(
        self,
        name: str,
        write: Callable[[Batch], None],
        *,
        max_pending_bytes: int,
        batch: int = 1,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self.max_pending_bytes = max_pending_bytes
        self._write, self._batch, self._on_error = write, batch, on_error
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: OrderedDict[int, torch.Tensor] = OrderedDict()  # FIFO
        self._pending_bytes = 0
        self._writing = 0  # blocks taken off the queue, not yet written
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._pending

    def __len__(self) -> int:
        """Blocks queued or being written now."""
        with self._lock:
            return len(self._pending)

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The queued tensor of ``block_hash`` (the queue's own; callers only read it), or
        None."""
        with self._lock:
            return self._pending.get(block_hash)

    def offer(self, block_hash: int, kv: torch.Tensor) -> Offer:
        """Queue ``kv`` (a CPU tensor the queue now owns) as ``block_hash``'s; see :data:`Offer`."""
        size = kv.numel() * kv.element_size()
        with self._lock:
            if self._closed or block_hash in self._pending:
                return "refused"
            if self._pending_bytes + size > self.max_pending_bytes:
                return "full"
            self._pending[block_hash] = kv
            self._pending_bytes += size
            self._wake.notify()
            return "queued"

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return  # closed and drained
                batch = list(itertools.islice(self._pending.items(), self._batch))
                self._writing += len(batch)
            try:
                self._write(batch)
            except Exception:  # a bug in the writer: log, count, carry on with the next
                log.exception(
                    "%s: writing %d block(s) from %032x failed",
                    self._thread.name,
                    len(batch),
                    batch[0][0],
                )
                self._on_error()
            with self._lock:
                for digest, kv in batch:
                    self._pending.pop(digest, None)
                    self._pending_bytes -= kv.numel() * kv.element_size()
                self._writing -= len(batch)
                self._wake.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or failed); False when ``timeout``
        seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(left)
            return True

    def close(self, timeout: float = 10.0) -> int:
        """Refuse new blocks, write what is queued (at most ``timeout`` seconds) and stop the
        thread; returns the blocks left unwritten (0: all written). Idempotent."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout)
        return len(self) if self._thread.is_alive() else 0
