"""KV cache storage tiers below the pool: host memory and a directory on disk.

Design origin: the storage behind TensorRT-LLM's KV cache connector example (one file per
block, loaded instead of recomputed; the seed, ``docs/architecture/workers.md``), vLLM's CPU
offload (an LRU of blocks in host memory) and LMCache's local disk backend (a size-capped
directory of blocks named by their hash). :mod:`pdserve.workers.kv.offload` decides what goes in and
out; this module only stores.

A block is named by its chained prefix-cache hash (:class:`~pdserve.workers.kv.prefix_cache.
BlockHasher`: model identity, KV dtype and tokens per block are hashed in), so two workers of
the same model can share a tier. Its data is the K/V of all layers, a CPU tensor::

    kv[num_layers, 2, tokens_per_block, num_kv_heads, head_dim]     (the pool's dtype)
       = pool[:, block_id]                                          (0 = K after RoPE, 1 = V)

:class:`HostTier`: an LRU ``hash -> kv`` capped in bytes (the least recently used block is
dropped to make room). :class:`DiskTier`: one safetensors file per block,
``<dir>/<32 hex digits of the hash>.safetensors``, holding the tensor ``kv`` and metadata
(format version, block hash, the layout's :meth:`~pdserve.protocol.KVLayout.compat_hash`, and
an xxh3-128 digest of layout key + hash + data). Never pickle. A file is written to a
temporary name in the same directory and renamed with :func:`os.replace` (atomic), so a reader
sees a whole file or none, and several workers of one host writing the same block at once is
harmless (the last rename wins; both wrote the same bytes). A file that fails to parse, whose
metadata names another block or layout, or whose digest does not match (a flipped byte, a
truncated write after a crash) is logged, removed, counted and treated as a miss: the block is
recomputed, never served. Disk writes run on one background thread per tier behind a queue
bounded in bytes; a save that does not fit the queue is dropped (counted), never waited for.
The directory's size is capped: before a write that would pass the cap, the directory is
scanned and the least recently used files (by mtime; a load touches its file) are removed
down to 90 % of the cap. Other workers' writes are seen at the next scan, so with several
writers the directory may pass the cap by at most what they wrote since their last scan.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pdserve.discovery.kvcache import Medium
from pdserve.protocol import KVLayout
from pdserve.workers.kv.manager import KV_DTYPES
from pdserve.workers.kv.write_queue import WriteQueue

log = logging.getLogger(__name__)

FORMAT = "pdserve-kv-block-v1"
"""The ``format`` metadata of a block file; another value is a miss (and removed)."""

_SUFFIX = ".safetensors"
_NAME = re.compile(r"^[0-9a-f]{32}\.safetensors$")
_STALE_TMP_S = 600.0  # a temporary file this old was left by a crashed writer
_LOW_WATER = 0.9  # cleanup removes files down to this share of the cap


class TierListener(Protocol):
    """Told of each block a tier stores or drops (the KV cache events' recorder,
    :class:`~pdserve.workers.kv.cache_events.KVEventRecorder`). Called on the thread that made
    the change (the engine thread, a writer thread), outside the tier's lock; must be quick and
    never call back into the tier."""

    def tier_changed(self, medium: Medium, hashes: Sequence[int], present: bool) -> None: ...


class TierListeners:
    """The listeners of one tier, told with the tier's medium."""

    def __init__(self, medium: Medium) -> None:
        self.medium = medium
        self._listeners: list[TierListener] = []

    def add(self, listener: TierListener) -> None:
        self._listeners.append(listener)

    def tell(self, hashes: Sequence[int], present: bool) -> None:
        if hashes:
            for listener in self._listeners:
                listener.tier_changed(self.medium, hashes, present)


def block_nbytes(layout: KVLayout) -> int:
    """Bytes of one block's K/V across all layers (the size of a tier entry's tensor)."""
    return layout.num_layers * layout.block_bytes_per_layer


def _digest(layout_key: str, block_hash: int, data: torch.Tensor) -> str:
    """xxh3-128 of layout key, block hash and the raw bytes of contiguous ``data``."""
    h = xxhash.xxh3_128()
    h.update(layout_key.encode())
    h.update(block_hash.to_bytes(16, "big"))
    h.update(data.view(torch.uint8).numpy().data)
    return h.hexdigest()


def encode_block(layout_key: str, block_hash: int, kv: torch.Tensor) -> bytes:
    """One block as a tier entry: safetensors bytes holding the tensor ``kv``
    (``[num_layers, 2, tpb, kvh, hd]``, CPU, any strides) and the metadata ``format``,
    ``block_hash`` (32 hex digits), ``layout`` (``layout_key``, the pool layout's
    :meth:`~pdserve.protocol.KVLayout.compat_hash`: model identity, dtype, shapes) and
    ``digest`` (xxh3-128 of layout key, hash and data). The disk and remote tiers store this."""
    data = kv.contiguous()
    meta = {
        "format": FORMAT,
        "block_hash": f"{block_hash:032x}",
        "layout": layout_key,
        "digest": _digest(layout_key, block_hash, data),
    }
    return st_save({"kv": data}, metadata=meta)


def decode_block(
    layout_key: str, shape: tuple[int, ...], dtype: torch.dtype, block_hash: int, data: bytes
) -> tuple[str | None, torch.Tensor | None]:
    """The inverse of :func:`encode_block`, checked: ``(None, kv)`` (a fresh CPU tensor the
    caller owns) when ``data`` is a whole entry of ``block_hash`` for ``layout_key`` with a
    tensor of ``shape`` and ``dtype`` and a matching digest, else ``(the problem, None)``.
    Never raises on bad bytes: cost linear in ``len(data)``."""
    try:
        size = int.from_bytes(data[:8], "little")
        if size > len(data) - 8:
            return "truncated header", None
        meta = json.loads(data[8 : 8 + size])["__metadata__"]
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')!r}", None
        if meta.get("block_hash") != f"{block_hash:032x}":
            return "the metadata names another block", None
        if meta.get("layout") != layout_key:
            return "the metadata names another KV layout", None
        kv = st_load(data)["kv"]
    except Exception as exc:  # safetensors, JSON, truncation: any parse failure
        return f"unparsable ({type(exc).__name__}: {exc})", None
    if tuple(kv.shape) != shape or kv.dtype != dtype:
        return f"tensor {tuple(kv.shape)} {kv.dtype}", None
    if _digest(layout_key, block_hash, kv) != meta.get("digest"):
        return "digest mismatch", None
    return None, kv


def layout_shape(layout: KVLayout) -> tuple[int, int, int, int, int]:
    """A tier entry's tensor shape for ``layout``: ``[num_layers, 2, tpb, kvh, hd]``."""
    return (layout.num_layers, 2, layout.tokens_per_block, layout.num_kv_heads, layout.head_dim)


@dataclass(frozen=True)
class TierStats:
    """One tier's counters since start (a snapshot). ``blocks``/``bytes``: held now (the disk
    tier: as of its last scan plus this process's writes and removals); ``stored``: blocks
    put in (host) or files written (disk); ``evicted``: blocks dropped for room (host LRU,
    disk cleanup); ``corrupt``: entries that failed their checks and were removed (disk,
    remote); ``dropped``: saves refused because the write queue was full (disk) or the store
    was unreachable (remote); ``pending``: blocks queued for writing now (disk, remote);
    ``errors``: failed reads or writes (an I/O error, a store that timed out)."""

    blocks: int = 0
    bytes: int = 0
    stored: int = 0
    evicted: int = 0
    corrupt: int = 0
    dropped: int = 0
    pending: int = 0
    errors: int = 0


class HostTier:
    """An LRU of blocks in host memory, at most ``capacity_bytes`` bytes of tensors.

    :meth:`put` takes ownership of the tensor (the caller must not write it afterwards);
    :meth:`get` returns the stored tensor itself, which callers only read. Thread-safe (one
    lock); every method is O(1) but :meth:`put`'s evictions."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host tier capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()  # LRU first
        self._bytes = 0
        self._stored = 0
        self._evicted = 0
        self.listeners = TierListeners("host")

    def put(self, block_hash: int, kv: torch.Tensor) -> bool:
        """Store ``kv`` (a CPU tensor) under ``block_hash`` as the most recently used block,
        dropping least recently used ones past the cap. False (nothing stored) when the block
        is already held or larger than the whole tier."""
        size = kv.numel() * kv.element_size()
        dropped: list[int] = []
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return False
            if size > self.capacity_bytes:
                return False
            while self._bytes + size > self.capacity_bytes:
                old_hash, old = self._blocks.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
                self._evicted += 1
                dropped.append(old_hash)
            self._blocks[block_hash] = kv
            self._bytes += size
            self._stored += 1
        self.listeners.tell(dropped, False)
        self.listeners.tell([block_hash], True)
        return True

    def hashes(self) -> list[int]:
        """Every block hash held now (least recently used first)."""
        with self._lock:
            return list(self._blocks)

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The block's tensor (now the most recently used), or None."""
        with self._lock:
            kv = self._blocks.get(block_hash)
            if kv is not None:
                self._blocks.move_to_end(block_hash)
            return kv

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(len(self._blocks), self._bytes, self._stored, self._evicted)


class DiskTier:
    """Blocks as files in ``directory`` (see the module docstring), at most
    ``capacity_bytes`` bytes of files, for blocks of ``layout``.

    The directory may be shared by the workers of one host and survives restarts: the
    constructor creates it if needed, scans it (the byte count, stale temporary files) and
    starts the writer thread. :meth:`save` queues a block (at most ``max_pending_bytes`` of
    tensors wait; more is dropped), :meth:`load` reads and verifies one (touching its file),
    :meth:`flush` waits for the queue, :meth:`close` stops the writer (idempotent). Thread-safe.
    Raises OSError when the directory cannot be created, ValueError for a non-positive cap.
    """

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        layout: KVLayout,
        *,
        max_pending_bytes: int = 256 * 2**20,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.max_pending_bytes = max_pending_bytes
        self.layout_key = layout.compat_hash()
        self.dtype = KV_DTYPES[layout.dtype]
        self.shape = layout_shape(layout)
        self._lock = threading.Lock()
        self._counts = {"stored": 0, "evicted": 0, "corrupt": 0, "dropped": 0, "errors": 0}
        self._bytes, self._blocks = self._scan(remove_stale=True)
        self.listeners = TierListeners("disk")
        self._queue = WriteQueue(
            "pdserve-kv-disk-writer",
            lambda batch: self._write(*batch[0]),
            max_pending_bytes=max_pending_bytes,
            on_error=lambda: self._count("errors"),
        )

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def path(self, block_hash: int) -> Path:
        """The file of ``block_hash``: ``<dir>/<32 hex digits>.safetensors``."""
        return self.directory / f"{block_hash:032x}{_SUFFIX}"

    # --- reading (engine thread) ----------------------------------------------------------------

    def __contains__(self, block_hash: int) -> bool:
        """True when the block is queued or its file exists (not verified: see :meth:`load`)."""
        return block_hash in self._queue or self.path(block_hash).is_file()

    def load(self, block_hash: int) -> torch.Tensor | None:
        """The block's verified tensor (``[num_layers, 2, tpb, kvh, hd]``, CPU, a fresh copy
        the caller owns), or None: no such file, or a file that failed its checks (removed and
        counted in ``corrupt``). A block still queued for writing is served from the queue."""
        queued = self._queue.get(block_hash)
        if queued is not None:
            return queued.clone()
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                before = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("KV disk tier: cannot read %s: %s", path, exc)
            return None
        problem, kv = decode_block(self.layout_key, self.shape, self.dtype, block_hash, data)
        if problem is not None or kv is None:
            self._remove_corrupt(path, before, problem or "unreadable")
            return None
        try:
            os.utime(path)  # the LRU cleanup goes by mtime
        except OSError:
            pass  # removed meanwhile by another worker's cleanup: the data is verified anyway
        return kv

    def _remove_corrupt(self, path: Path, seen: os.stat_result, problem: str) -> None:
        """Remove ``path`` unless another writer replaced it since it was read (a new inode)."""
        log.warning(
            "KV disk tier: %s failed its checks (%s); removed, will recompute", path.name, problem
        )
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_mtime_ns) == (seen.st_ino, seen.st_mtime_ns):
                os.unlink(path)
                with self._lock:
                    self._bytes -= now.st_size
                    self._blocks -= 1
        except OSError:
            pass  # already gone
        with self._lock:
            self._counts["corrupt"] += 1
        self.listeners.tell([int(path.name[:32], 16)], False)

    # --- writing ----------------------------------------------------------------------------------

    def save(self, block_hash: int, kv: torch.Tensor) -> bool:
        """Queue ``kv`` (a CPU tensor the tier now owns, ``[num_layers, 2, tpb, kvh, hd]``;
        may be a non-contiguous view) to be written as ``block_hash``'s file; returns at once.
        False when it is already queued or on disk, or the queue is full (counted in
        ``dropped``, logged) or the tier is closed."""
        if block_hash in self._queue or self.path(block_hash).is_file():
            return False
        offer = self._queue.offer(block_hash, kv)
        if offer == "full":
            with self._lock:
                self._counts["dropped"] += 1
                dropped = self._counts["dropped"]
            if dropped & (dropped - 1) == 0:  # 1st, 2nd, 4th, ...: no log flood
                log.warning(
                    "KV disk tier: write queue full (%d MiB); %d saves dropped so far",
                    self.max_pending_bytes >> 20,
                    dropped,
                )
        return offer == "queued"

    def _write(self, block_hash: int, kv: torch.Tensor) -> None:
        """Serialize, make room under the cap, write to a temporary file, rename (writer
        thread; a failure, disk full or permissions, is logged and counted by the queue)."""
        blob = encode_block(self.layout_key, block_hash, kv)
        with self._lock:
            over = self._bytes + len(blob) > self.capacity_bytes
        if len(blob) > self.capacity_bytes:
            return  # a cap smaller than one block: nothing fits
        if over:
            self._cleanup(len(blob))
        final = self.path(block_hash)
        tmp = self.directory / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._bytes += len(blob)
            self._blocks += 1
            self._counts["stored"] += 1
        self.listeners.tell([block_hash], True)

    def _scan(self, *, remove_stale: bool = False) -> tuple[int, int]:
        """Bytes and count of the block files in the directory now (and, with
        ``remove_stale``, remove temporary files a crashed writer left)."""
        total = count = 0
        for entry in os.scandir(self.directory):
            try:
                if _NAME.match(entry.name):
                    total += entry.stat().st_size
                    count += 1
                elif remove_stale and entry.name.endswith(".tmp"):
                    if time.time() - entry.stat().st_mtime > _STALE_TMP_S:
                        os.unlink(entry.path)
            except OSError:
                continue  # removed meanwhile
        return total, count

    def _cleanup(self, incoming: int) -> None:
        """Remove least recently used block files (oldest mtime first) until the directory
        holds at most 90 % of the cap minus ``incoming`` bytes (writer thread)."""
        files: list[tuple[int, int, str]] = []
        for entry in os.scandir(self.directory):
            if _NAME.match(entry.name):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                files.append((st.st_mtime_ns, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        target = int(self.capacity_bytes * _LOW_WATER) - incoming
        removed: list[int] = []
        for _, size, path in sorted(files):
            if total <= target:
                break
            try:
                os.unlink(path)
            except OSError:
                pass  # another worker removed it first: it is gone either way
            total -= size
            removed.append(int(os.path.basename(path)[:32], 16))
        with self._lock:
            self._bytes, self._blocks = total, len(files) - len(removed)
            self._counts["evicted"] += len(removed)
        self.listeners.tell(removed, False)

    def hashes(self) -> list[int]:
        """The hashes of every block file in the directory now (this worker's and the other
        workers' of the host: any of them can be loaded here); O(files)."""
        out: list[int] = []
        for entry in os.scandir(self.directory):
            if _NAME.match(entry.name):
                out.append(int(entry.name[:32], 16))
        return out

    # --- lifecycle ----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped by an error); False when
        ``timeout`` seconds passed first."""
        return self._queue.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (at most ``timeout`` seconds; the rest is lost) and stop the
        writer thread. Idempotent; :meth:`save` refuses blocks afterwards."""
        left = self._queue.close(timeout)
        if left:
            log.warning(
                "KV disk tier: %d blocks still queued after %.1f s; not written", left, timeout
            )

    def stats(self) -> TierStats:
        with self._lock:
            c = self._counts
            return TierStats(
                self._blocks,
                self._bytes,
                c["stored"],
                c["evicted"],
                c["corrupt"],
                c["dropped"],
                len(self._queue),
                c["errors"],
            )
