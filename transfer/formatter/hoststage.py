"""Plan segments between CUDA memory and pinned host memory (the TCP backend and the digests).

Design origin: the GPU path of the TCP backend. A socket cannot ``sendmsg`` from or ``recvmsg_into`` device
memory and xxhash reads host bytes, so for a CUDA pool the bytes of a
:class:`~pdserve.transfer.formatter.mapping.TransferPlan` pass through one pinned host buffer packed in
plan order (segment ``k`` at ``sum(lengths[:k])``)::

    sender    pool (or staging buffer) on cuda --gather: one D2H copy per segment--> host[nbytes]
    receiver  host[nbytes] --scatter: one H2D copy per segment--> pool on cuda

The copies run on a side stream of the pool's device (:class:`HostStage`), so they do not queue
behind the engine's forward on the default stream. That is safe because of who owns the blocks:
the blocks a sender reads were written by a forward the engine already synchronised on (the
sampler copies the step's logits to the host before a request parks), a converting formatter's
staging buffer is synchronised by :func:`pdserve.transfer.formatter.convert.reblock`, and the blocks a
receiver fills belong to no running sequence until the pull returns, which happens only after
the copies completed. One copy per segment costs about 5-10 us of Python and launch time; a plan
has ``num_layers * num_runs`` segments, never one per block per layer. Pinned buffers come from
torch's caching host allocator, so a request after the first allocates nothing new.

Thread-safety: use one :class:`HostStage` from one thread (the transceiver's event loop).
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.errors import TransferError
from pdserve.transfer.backend import Poller
from pdserve.transfer.formatter.copies import HOST_STAGING, RECEIVE, SEND, CopyCounter


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """Flat ``uint8`` view of a contiguous tensor on any device (any dtype, bfloat16 too); no
    copy. Raises TransferError for a non-contiguous tensor."""
    if not tensor.is_contiguous():
        raise TransferError("KV memory must be contiguous to be moved as bytes")
    return tensor.view(-1).view(torch.uint8)


def packed_offsets(lengths: np.ndarray) -> np.ndarray:
    """Offsets of the segments packed back to back in plan order: ``[0, l0, l0 + l1, ...]``."""
    offsets = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    return offsets


def _check_bounds(size: int, offsets: np.ndarray, lengths: np.ndarray) -> None:
    if len(offsets) and (offsets.min() < 0 or int((offsets + lengths).max()) > size):
        raise TransferError(f"KV segment outside the {size}-byte device memory")


class HostStage:
    """Copies between one CUDA device's memory and pinned host buffers on a side stream.

    ``device``: the CUDA device of the pool (``torch.device("cuda", i)``). Raises
    TransferError from the copy methods for segments outside the device memory; torch errors
    (out of pinned memory) propagate as RuntimeError.
    """

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"HostStage needs a CUDA device, got {device}")
        self.device = device
        self._stream = torch.cuda.Stream(device=device)

    def gather(
        self,
        src: torch.Tensor,
        offsets: np.ndarray,
        lengths: np.ndarray,
        copies: CopyCounter | None = None,
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start copying ``src[offsets[k] : offsets[k] + lengths[k]]`` (``src``: 1-D uint8 on
        the device) into a new pinned host buffer ``[sum(lengths)]`` packed in plan order.
        Returns the buffer and the event that completes with the copies; the buffer must not
        be read before then (:meth:`wait`). ``copies``: the sender's counter, which counts the
        bytes as its ``host_staging`` copy (None: not a transfer's copy, e.g. a digest's)."""
        _check_bounds(src.numel(), offsets, lengths)
        nbytes = int(lengths.sum())
        if copies is not None:
            copies.copied(SEND, HOST_STAGING, nbytes)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self._stream):
            pos = 0
            for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
                host[pos : pos + n].copy_(src[o : o + n], non_blocking=True)
                pos += n
            event = torch.cuda.Event()
            event.record(self._stream)
        return host, event

    def scatter(
        self,
        host: torch.Tensor,
        dst: torch.Tensor,
        offsets: np.ndarray,
        lengths: np.ndarray,
        copies: CopyCounter | None = None,
    ) -> torch.cuda.Event:
        """Start copying ``host`` (pinned, packed in plan order) into ``dst[offsets[k] :
        offsets[k] + lengths[k]]`` (``dst``: 1-D uint8 on the device). Returns the event that
        completes with the copies; ``host`` must stay allocated until then (torch's host
        allocator also holds the block back until the copies are done). ``copies``: the
        receiver's counter, which counts the host buffer the bytes came through as its
        ``host_staging`` copy."""
        _check_bounds(dst.numel(), offsets, lengths)
        if copies is not None:
            copies.copied(RECEIVE, HOST_STAGING, int(lengths.sum()))
        with torch.cuda.stream(self._stream):
            pos = 0
            for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
                dst[o : o + n].copy_(host[pos : pos + n], non_blocking=True)
                pos += n
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    @staticmethod
    async def wait(event: torch.cuda.Event) -> None:
        """Poll ``event`` from the event loop until its copies completed (never blocks the
        loop). If cancelled, waits for the copies synchronously before re-raising, so that no
        copy lands after the caller gave up."""
        poller = Poller()
        try:
            while not event.query():
                await poller.sleep()
        except BaseException:
            event.synchronize()
            raise

    def gather_now(
        self, src: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
    ) -> torch.Tensor:
        """:meth:`gather`, then wait (blocking) for the copies: the packed host bytes."""
        host, event = self.gather(src, offsets, lengths)
        event.synchronize()
        return host
