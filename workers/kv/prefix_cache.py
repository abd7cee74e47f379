"""Prefix cache: hit counters and stats for :class:`KVCacheManager`.

Design origin: TensorRT-LLM's KV cache block reuse (blocks indexed by their tokens, kept after
the request ends, reused by a later request with the same prefix) and vLLM's automatic prefix
caching (a chained hash per *full* block, an LRU of unreferenced cached blocks).

The chained block hash (:class:`~pdserve.block_hash.BlockHasher`) is the contract this cache
shares with the router, in :mod:`pdserve.block_hash`; blocks are named by it in KV events,
delta transfers and the disk tier. A partial last block has no hash and is never shared.

The block index, the LRU of evictable blocks and the registration rules live in
:mod:`pdserve.workers.kv.manager`; the per-request hash list lives on
:class:`~pdserve.workers.engine.sequence.Sequence` (``block_hashes``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix cache counters since start (a snapshot).

    ``queries``: admissions that looked up their prefix; ``query_tokens``: tokens those
    lookups covered (each sequence's known tokens); ``hit_tokens``: tokens found cached (not
    computed). Hit rate = ``hit_tokens / query_tokens``. ``cached_blocks``: blocks in the index
    now (held or evictable); ``evictable_blocks``: cached blocks no request holds (counted as
    free by ``get_num_free_blocks``); ``evictions``: cached blocks reallocated so far.
    """

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    cached_blocks: int = 0
    evictable_blocks: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0.0 before the first query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCounters:
    """Thread-safe query/hit counters (the mutable side of :class:`PrefixCacheStats`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one lookup of ``query_tokens`` tokens that found ``hit_tokens`` cached."""
        with self._lock:
            self.queries += 1
            self.query_tokens += query_tokens
            self.hit_tokens += hit_tokens
