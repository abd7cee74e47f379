"""KV cache remote tier: blocks in a Redis (or Valkey) store that every host reaches.

Design origin: LMCache's remote backends and SGLang HiCache's shared storage tier (a store
outside the workers, keyed by the prefix hash of each block, read before recomputing); the
entry format is the disk tier's (:func:`~pdserve.workers.kv.tiers.encode_block`), so a block
carries its model identity, dtype and layout (the layout's ``compat_hash``) and an xxh3-128
digest, and a wrong or corrupt entry is a miss, never wrong output.

Keys and values::

    pdserve:kv:<layout key, 16 hex>:<block hash, 32 hex>  ->  encode_block(layout key, hash, kv)
    kv[num_layers, 2, tokens_per_block, num_kv_heads, head_dim]   (the pool's dtype)

The block hash is the chained prefix-cache hash (model, KV dtype, block size and any cache
salt are hashed in), so workers of one model on any host share entries and a salted prompt
never reads another salt's blocks.

Reads (:meth:`RemoteTier.load_prefix`, the engine thread, when a sequence is admitted): the
blocks after what the pool and the local tiers hold are fetched with ``MGET`` in batches of
``read_batch`` keys, stopping at the first miss; each entry is decoded and verified, and one
that fails (another layout, a flipped byte, a truncated value) is deleted, counted and ends
the prefix there. Writes (:meth:`RemoteTier.save`) go on a queue bounded in bytes; one writer
thread takes up to ``write_batch`` blocks, asks ``EXISTS`` for all of them in one pipeline and
``SET``s the missing ones (``NX``, with a TTL when configured) in a second, so a block another
worker already stored costs one key's round trip, not its bytes. Hashes this worker wrote or
read are remembered (an LRU of ``known_max``) and never queued again.

Failures never stall the engine: every command runs under the client's socket timeout
(``timeout_s``) with no client-side retries, and a connection error or timeout opens a
breaker: for 1 s (doubling to 30 s while the store keeps failing) reads return misses at once
and saves are dropped (counted), then one command tries the store again. So a store that is
down or slow costs at most one timeout per backoff interval and misses otherwise.

At fleet scale (docs/architecture/workers.md says more): the store is sized by memory with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` (Redis evicts the least recently used
blocks; pdserve sets no TTL unless ``kv_cache.remote_cache_ttl_s`` asks), sharded by key with
Redis Cluster or a proxy (keys spread evenly: they are hashes), and each block costs its K/V
bytes plus about 200 bytes of safetensors header and 100 of key and Redis overhead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.protocol import KVLayout
from pdserve.workers.kv.manager import KV_DTYPES
from pdserve.workers.kv.tiers import (
    TierListeners,
    TierStats,
    decode_block,
    encode_block,
    layout_shape,
)
from pdserve.workers.kv.write_queue import WriteQueue

log = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:kv:"
"""Every key of the remote tier starts with this (a store may hold other data)."""

SCHEMES = ("redis", "rediss", "unix")
"""URL schemes of ``--kv-remote-cache`` (redis-py's: TCP, TLS, a Unix socket)."""

_BACKOFF_MIN_S = 1.0
_BACKOFF_MAX_S = 30.0


def redact_url(url: str) -> str:
    """``url`` without its password (for logs): ``redis://user:***@host:6379/0``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


class RemoteTier:
    """Blocks of ``layout`` in the Redis-protocol store at ``url`` (see the module docstring).

    ``timeout_s``: socket timeout of every command (connect, read, write); ``ttl_s``: expiry of
    stored blocks (None: none; the store's eviction policy bounds it); ``max_pending_bytes``:
    tensors waiting for the writer (more is dropped); ``read_batch``/``write_batch``: keys per
    ``MGET`` / per write pipeline. Thread-safe: the engine thread reads, the writer thread
    writes, both through redis-py's connection pool. The constructor never fails on an
    unreachable store (it is logged and the breaker opens); it raises ValueError for a URL
    redis-py cannot parse."""

    def __init__(
        self,
        url: str,
        layout: KVLayout,
        *,
        timeout_s: float = 0.5,
        ttl_s: float | None = None,
        max_pending_bytes: int = 256 * 2**20,
        read_batch: int = 16,
        write_batch: int = 16,
        known_max: int = 65536,
    ) -> None:
        self.where = redact_url(url)
        self.layout_key = layout.compat_hash()
        self.shape = layout_shape(layout)
        self.dtype = KV_DTYPES[layout.dtype]
        self.block_bytes = layout.num_layers * layout.block_bytes_per_layer
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.read_batch, self.known_max = read_batch, known_max
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # one try per command: the breaker decides when to retry
            retry_on_timeout=False,
        )
        self._lock = threading.Lock()
        self._known: OrderedDict[int, None] = OrderedDict()  # LRU of hashes the store holds
        self._down_until = 0.0
        self._backoff = 0.0
        self._counts = {"stored": 0, "corrupt": 0, "dropped": 0, "errors": 0, "bytes": 0}
        self.listeners = TierListeners("remote")
        try:
            self.client.ping()
            log.info("KV remote tier: %s reachable", self.where)
        except redis.RedisError as exc:
            self._failed(exc, "the first ping")
        self._queue = WriteQueue(
            "pdserve-kv-remote-writer",
            self._write,
            max_pending_bytes=max_pending_bytes,
            batch=write_batch,
            on_error=lambda: self._count("errors"),
        )

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def key(self, block_hash: int) -> str:
        """The store key of ``block_hash`` for this tier's layout."""
        return f"{KEY_PREFIX}{self.layout_key}:{block_hash:032x}"

    # --- the breaker ------------------------------------------------------------------------

    def available(self) -> bool:
        """False while the breaker is open (the store failed lately): reads miss, saves drop."""
        return time.monotonic() >= self._down_until

    def _failed(self, exc: BaseException, doing: str) -> None:
        with self._lock:
            self._counts["errors"] += 1
            now = time.monotonic()
            if now < self._down_until:
                return  # already open (the other thread failed too)
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S) or _BACKOFF_MIN_S
            self._down_until = now + self._backoff
            backoff = self._backoff
        log.warning(
            "KV remote tier %s: %s failed (%s: %s); misses for the next %.0f s",
            self.where,
            doing,
            type(exc).__name__,
            exc,
            backoff,
        )

    def _succeeded(self) -> None:
        if self._backoff:
            with self._lock:
                was, self._backoff = self._backoff, 0.0
            if was:
                log.info("KV remote tier %s: reachable again", self.where)

    def _remember(self, hashes: Sequence[int]) -> None:
        """The store holds ``hashes`` (written or read here): remember them, most recent last;
        listeners hear of the new ones and of those the bound makes this worker forget."""
        new: list[int] = []
        forgotten: list[int] = []
        with self._lock:
            for digest in hashes:
                if digest not in self._known:
                    new.append(digest)
                self._known[digest] = None
                self._known.move_to_end(digest)
            while len(self._known) > self.known_max:
                forgotten.append(self._known.popitem(last=False)[0])
        self.listeners.tell(forgotten, False)
        self.listeners.tell(new, True)

    def hashes(self) -> list[int]:
        """The hashes this worker knows the store holds (at most ``known_max``)."""
        with self._lock:
            return list(self._known)

    # --- reading (engine thread) ------------------------------------------------------------

    def load_prefix(self, hashes: Sequence[int]) -> list[torch.Tensor]:
        """The verified tensors (``[num_layers, 2, tpb, kvh, hd]``, CPU, owned by the caller)
        of the longest prefix of ``hashes`` the store holds, fetched in ``MGET`` batches.
        Empty when the breaker is open; a failed command or a corrupt entry ends the prefix
        (the failure is counted and logged, the corrupt entry deleted). Never raises a store
        error."""
        out: list[torch.Tensor] = []
        if not hashes or not self.available():
            return out
        for start in range(0, len(hashes), self.read_batch):
            chunk = list(hashes[start : start + self.read_batch])
            try:
                values = self.client.mget([self.key(h) for h in chunk])
            except redis.RedisError as exc:
                self._failed(exc, "a read")
                return out
            self._succeeded()
            for digest, data in zip(chunk, values, strict=True):
                if data is None:
                    self._remember(chunk[: len(out) - start])
                    return out
                problem, kv = (
                    decode_block(self.layout_key, self.shape, self.dtype, digest, data)
                    if isinstance(data, bytes)
                    else ("not a byte string", None)
                )
                if problem is not None or kv is None:
                    self._remove_corrupt(digest, problem or "unreadable")
                    return out
                out.append(kv)
            self._remember(chunk)
        return out

    def _remove_corrupt(self, block_hash: int, problem: str) -> None:
        log.warning(
            "KV remote tier %s: block %032x failed its checks (%s); deleted, will recompute",
            self.where,
            block_hash,
            problem,
        )
        with self._lock:
            self._counts["corrupt"] += 1
            self._known.pop(block_hash, None)
        self.listeners.tell([block_hash], False)
        try:
            self.client.delete(self.key(block_hash))
        except redis.RedisError as exc:
            self._failed(exc, "deleting a corrupt block")

    # --- writing ----------------------------------------------------------------------------

    def wants(self, block_hash: int) -> bool:
        """True when a :meth:`save` of ``block_hash`` would be taken now: not known to be in
        the store, not queued, the breaker closed. The connector asks before copying a block."""
        with self._lock:
            if block_hash in self._known or time.monotonic() < self._down_until:
                return False
        return block_hash not in self._queue

    def save(self, block_hash: int, kv: torch.Tensor) -> bool:
        """Queue ``kv`` (a CPU tensor the tier now owns and only reads, ``[num_layers, 2, tpb,
        kvh, hd]``) to be stored as ``block_hash``; returns at once. False when the block is
        known or queued, the tier is closed, or it is dropped (the queue is full or the
        breaker open; counted in ``dropped``)."""
        with self._lock:
            if block_hash in self._known:
                return False
            down = time.monotonic() < self._down_until
        offer = "full" if down else self._queue.offer(block_hash, kv)
        if offer == "full":
            self._count("dropped")
        return offer == "queued"

    def _write(self, batch: list[tuple[int, torch.Tensor]]) -> None:
        """Store the blocks of ``batch`` the store lacks (writer thread; two round trips)."""
        if not self.available():
            self._count("dropped", len(batch))
            return
        keys = [self.key(digest) for digest, _ in batch]
        written: list[int] = []
        nbytes = 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            present = pipe.execute()
            pipe = self.client.pipeline(transaction=False)
            for (digest, kv), key, there in zip(batch, keys, present, strict=True):
                if there:
                    continue
                blob = encode_block(self.layout_key, digest, kv)
                pipe.set(key, blob, px=self.ttl_ms, nx=True)
                written.append(digest)
                nbytes += len(blob)
            if written:
                pipe.execute()
        except redis.RedisError as exc:
            self._failed(exc, "a write")
            self._count("dropped", len(batch))
            return
        self._succeeded()
        self._remember([digest for digest, _ in batch])
        with self._lock:
            self._counts["stored"] += len(written)
            self._counts["bytes"] += nbytes

    # --- lifecycle --------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written or dropped; False when ``timeout`` seconds
        passed first."""
        return self._queue.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (at most ``timeout`` seconds; the rest is lost), stop the
        writer and close the connections. Idempotent; :meth:`save` refuses blocks afterwards."""
        left = self._queue.close(timeout)
        if left:
            log.warning(
                "KV remote tier %s: %d blocks still queued after %.1f s; not written",
                self.where,
                left,
                timeout,
            )
        else:
            self.client.close()

    def stats(self) -> TierStats:
        """Counters since start. ``blocks``/``bytes``: the blocks this worker knows the store
        holds (written or read by it, at most ``known_max``), not the store's total (its
        ``INFO memory`` says that); ``stored``: blocks this worker wrote; ``corrupt``: entries
        that failed their checks (deleted); ``dropped``: saves not made (queue full, store
        unreachable); ``errors``: failed commands."""
        with self._lock:
            c = self._counts
            known = len(self._known)
            return TierStats(
                blocks=known,
                bytes=known * self.block_bytes,
                stored=c["stored"],
                corrupt=c["corrupt"],
                dropped=c["dropped"],
                pending=len(self._queue),
                errors=c["errors"],
            )
