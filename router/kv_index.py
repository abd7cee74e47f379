"""The router's index of the KV blocks each worker holds, fed by the workers' KV cache events.

Design origin: Dynamo's KV router (its ``KvIndexer`` applies the workers' ``stored`` /
``removed`` events and answers "how many leading blocks of this prompt does each worker hold").
Here the index is a set of block hashes per worker incarnation; a prompt's hashes are computed
the way each worker computes them (:class:`pdserve.workers.kv.prefix_cache.BlockHasher`, seeded
by the worker's ``KVLayout.model``, ``dtype`` and ``tokens_per_block``), so a match is exact.

Per worker id the index keeps ``(epoch, last seq, synced, hashes per medium)``: a worker holds
a block in its KV pool (``device``) or in a tier of its KV cache connector (``host``, ``disk``,
``remote``), each event naming one medium. :meth:`KVIndex.apply`
takes one :class:`~pdserve.discovery.kvcache.KVCacheEvent`:

- a signature that does not verify under the cluster key (missing, made with another key, or
  the event changed after signing): dropped before anything else (``unsigned``; a warning at
  most once per worker id per minute). This is the one check for every transport (embedded
  registry, NATS, etcd): events enter the router only here. One HMAC per event;
- an older epoch than the entry's: dropped (``stale``);
- a newer epoch (the worker restarted) or an unknown worker: a fresh, *unsynced* entry;
- ``seq`` not above the last one: dropped (``stale``: a duplicate or reordered message);
- ``seq`` not the next one and no ``reset``: a ``gap`` (a lost message): the entry is cleared
  and unsynced;
- ``reset``: every medium's set is cleared and the entry is synced (a snapshot starts);
- otherwise, on a synced entry: ``removed`` then ``stored`` are applied to the event's medium
  (``applied``); on an unsynced one nothing is (``unsynced``).

It returns whether a snapshot of that worker is wanted (the entry is unsynced), which the
transport passes on. Conservative: an unsynced worker counts as holding nothing until its next
snapshot, so a lost message can cost a cache miss, never a wrong answer (a worker recomputes
what it does not hold). :meth:`KVIndex.forget` drops a worker that left discovery.

:func:`expected_cached_tokens` answers, per candidate worker, how many leading prompt tokens it
is expected to hold, credited by what loading them costs: each matched leading block (in its
cheapest medium) counts ``tokens per block x (1 - MEDIUM_LOAD_COST[medium])``, up to the last
full block strictly below the prompt's length (the worker always computes one token, as its
scheduler does). Prompt hashes are computed once per distinct (model, dtype, tokens per block).
The chain is walked across media as if any block could follow any other; the worker's
admission takes the pool's prefix first and the tiers' after it, so a prompt whose pool blocks
follow a tier gap is credited a little more than the worker will load (a miss, never an error).

Thread-safety: none; the router's event loop only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.block_hash import BlockHasher
from pdserve.discovery.kvcache import MEDIA, KVCacheEvent, Medium, UnsignedWarnings
from pdserve.protocol import KVLayout, WorkerRecord
from pdserve.security import ClusterKey

log = logging.getLogger(__name__)

MAX_WORKERS = 4096
"""Most worker entries the index keeps (ids come from whoever can publish events)."""

MEDIUM_LOAD_COST: dict[str, float] = {"device": 0.0, "host": 0.01, "disk": 0.03, "remote": 0.05}
"""Loading a block from each medium, as a fraction of computing it (its prefill). Measured
with ``pdserve bench kv-restart`` (docs/benchmarks.md, "KV remote tier"; SmolLM2-135M
bfloat16, AMD EPYC, 2 cores, one sitting): a 4,032-token prompt computes in 15-17 s; loaded
whole from the disk tier its TTFT is 0.023x of that, from a Redis remote tier on loopback
0.034x (both include the request's own overheads; a store across a network costs more, hence
0.05); a host-tier block is one memory copy. So a worker holding a prefix in a tier still wins
over one that holds nothing, and loses to one that holds it in its pool."""

OUTCOMES = ("applied", "gap", "stale", "unsynced", "malformed", "unsigned")
"""Outcomes of :meth:`KVIndex.apply`, the ``outcome`` label of
``pdserve_router_kv_events_total``."""


@dataclass
class _Entry:
    epoch: int
    seq: int = -1
    synced: bool = False
    media: dict[Medium, set[int]] = field(default_factory=dict)

    def clear(self) -> None:
        self.media.clear()


@dataclass(frozen=True)
class KVIndexStats:
    """A snapshot for metrics: event outcomes since start, workers and synced workers now,
    block hashes held over all workers."""

    outcomes: dict[str, int]
    workers: int
    synced: int
    blocks: int


class KVIndex:
    """Block hashes per worker incarnation (see the module docstring); ``key`` (the cluster
    key) checks every event's signature."""

    def __init__(self, *, key: ClusterKey, max_workers: int = MAX_WORKERS) -> None:
        self.max_workers = max_workers
        self._key = key
        self._entries: dict[str, _Entry] = {}
        self._unsigned = UnsignedWarnings(log)
        self.outcomes: Counter[str] = Counter()

    def apply(self, event: KVCacheEvent) -> bool:
        """Apply one event; return whether a snapshot of its worker is wanted (never for an
        event whose signature does not verify: nothing is asked of whoever sent it)."""
        if not self._key.event_signed(event):
            self.outcomes["unsigned"] += 1
            self._unsigned.dropped("KV cache events", event.worker_id, event.signature)
            return False
        outcome = self._apply(event)
        self.outcomes[outcome] += 1
        if outcome in ("gap", "malformed"):
            log.debug("KV events of %s: %s at seq %d", event.worker_id, outcome, event.seq)
        entry = self._entries.get(event.worker_id)
        return entry is not None and not entry.synced

    def _apply(self, event: KVCacheEvent) -> str:
        entry = self._entries.get(event.worker_id)
        if entry is not None and event.epoch < entry.epoch:
            return "stale"
        if entry is None or event.epoch > entry.epoch:
            if entry is None and len(self._entries) >= self.max_workers:
                return "stale"  # full: ids beyond the bound are not tracked
            entry = self._entries[event.worker_id] = _Entry(event.epoch)
        elif event.seq <= entry.seq:
            return "stale"
        gap = entry.seq >= 0 and event.seq != entry.seq + 1
        entry.seq = event.seq
        try:
            stored, removed = event.stored_hashes(), event.removed_hashes()
        except ValueError:
            entry.synced = False
            entry.clear()
            return "malformed"
        if event.reset:
            entry.clear()
            entry.synced = True
        elif gap:
            entry.synced = False
            entry.clear()
            return "gap"
        if not entry.synced:
            return "unsynced"
        held = entry.media.setdefault(event.medium, set())
        held.difference_update(removed)
        held.update(stored)
        return "applied"

    def forget(self, worker_id: str) -> None:
        """Drop ``worker_id`` (it left discovery); no-op when unknown."""
        self._entries.pop(worker_id, None)

    def synced(self, worker_id: str, epoch: int) -> bool:
        """Whether the index holds a usable view of this worker incarnation."""
        entry = self._entries.get(worker_id)
        return entry is not None and entry.epoch == epoch and entry.synced

    def overlap(self, worker_id: str, epoch: int, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` (a prompt's chained block hashes, in order) that this
        worker incarnation holds in any medium; stops at the first missing one (a chained
        hash names the whole prefix). 0 for an unknown, other-epoch or unsynced worker."""
        return len(self.overlap_media(worker_id, epoch, hashes))

    def overlap_media(self, worker_id: str, epoch: int, hashes: Sequence[int]) -> list[Medium]:
        """For each leading block of ``hashes`` the worker holds, the cheapest medium it is in
        (``MEDIA`` order); stops at the first block held nowhere. Empty for an unknown,
        other-epoch or unsynced worker. O(leading blocks x media)."""
        entry = self._entries.get(worker_id)
        if entry is None or entry.epoch != epoch or not entry.synced:
            return []
        held = [(m, entry.media[m]) for m in MEDIA if entry.media.get(m)]
        out: list[Medium] = []
        for h in hashes:
            medium = next((m for m, blocks in held if h in blocks), None)
            if medium is None:
                break
            out.append(medium)
        return out

    def stats(self) -> KVIndexStats:
        """Counters and sizes for ``/metrics``."""
        return KVIndexStats(
            outcomes={o: self.outcomes[o] for o in OUTCOMES},
            workers=len(self._entries),
            synced=sum(e.synced for e in self._entries.values()),
            blocks=sum(len(h) for e in self._entries.values() for h in e.media.values()),
        )


class PromptHashes:
    """One prompt's block hashes per KV layout, computed once per distinct (model, dtype,
    tokens per block) and only up to the blocks a worker could reuse (all but the last
    token); ``salt``: the request's cache salt (its blocks hash as the workers' do)."""

    def __init__(self, token_ids: Sequence[int], salt: str | None = None) -> None:
        self.token_ids = list(token_ids)
        self.salt = salt
        self._by_layout: dict[tuple[str, str, int], list[int]] = {}

    def for_layout(self, layout: KVLayout) -> list[int]:
        """Hashes of the full blocks before the prompt's last token, under ``layout``."""
        key = (layout.model, layout.dtype, layout.tokens_per_block)
        hashes = self._by_layout.get(key)
        if hashes is None:
            tpb = layout.tokens_per_block
            usable = max(len(self.token_ids) - 1, 0) // tpb * tpb
            hasher = BlockHasher(layout.model, layout.dtype, tpb)
            hashes = self._by_layout[key] = hasher.hash_tokens(self.token_ids[:usable], self.salt)
        return hashes


def follow_kv_events(watcher: object, key: ClusterKey | None = None) -> KVIndex | None:
    """A :class:`KVIndex` fed by ``watcher``'s KV cache events (its ``subscribe_kv_events``:
    the embedded, etcd and NATS watchers have one) that forgets a worker when its record is
    deleted (``subscribe``); None for a watcher without KV events (then routing is
    least-loaded).

    ``key``: the cluster key the index checks each event's signature with; by default the
    watcher's own (the one its records are checked with: ``watcher.key``, or the embedded
    watcher's ``registry.key``). A watcher with KV events but no key gives None (a warning):
    unverifiable events are never used."""
    feed = getattr(watcher, "subscribe_kv_events", None)
    if feed is None:
        return None
    if key is None:
        key = _watcher_key(watcher)
    if key is None:
        log.warning(
            "KV-aware routing is off: the watcher %r has no cluster key to check KV cache "
            "events with",
            type(watcher).__name__,
        )
        return None
    index = KVIndex(key=key)
    feed(index.apply)

    def on_record(worker_id: str, record: WorkerRecord | None) -> None:
        if record is None:
            index.forget(worker_id)

    subscribe = getattr(watcher, "subscribe", None)
    if subscribe is not None:
        subscribe(on_record)
    return index


def _watcher_key(watcher: object) -> ClusterKey | None:
    """The cluster key a watcher checks its records with: its ``key`` (the etcd and NATS
    watchers) or its registry's (the embedded watcher); None when it has neither."""
    for holder in (watcher, getattr(watcher, "registry", None)):
        key = getattr(holder, "key", None)
        if isinstance(key, ClusterKey):
            return key
    return None


def expected_cached_tokens(
    index: KVIndex, workers: Iterable[WorkerRecord], prompt: PromptHashes
) -> dict[str, int]:
    """Per worker id, the leading prompt tokens the worker is expected to hold cached, each
    block credited by its medium's load cost (``MEDIUM_LOAD_COST``: a block in the pool counts
    whole, one on disk 0.97 of its tokens), rounded down; below the prompt's length. Workers
    the index has no synced view of get 0."""
    out: dict[str, int] = {}
    for record in workers:
        media = index.overlap_media(
            record.worker_id, record.epoch, prompt.for_layout(record.layout)
        )
        credit = sum(1.0 - MEDIUM_LOAD_COST[m] for m in media)
        out[record.worker_id] = int(credit * record.layout.tokens_per_block + 1e-9)
    return out
