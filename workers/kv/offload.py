"""KV cache connector: blocks found in the host, disk or remote tier are loaded, not recomputed.

Design origin: TensorRT-LLM's KV cache connector (the seed's persistent KV cache example,
``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker``), vLLM's v1 ``KVConnectorBase``
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta`` ->
``bind_connector_metadata``), its CPU offload and LMCache for the tiers (its remote backends
for the remote one). The side that decides (:class:`KVConnectorScheduler`, called by the
scheduler) and the side that moves bytes
(:class:`KVConnectorWorker`, called by the engine around the forward) are joined by one
:class:`KVConnectorMetadata` per step. The tiers are :mod:`pdserve.workers.kv.tiers` (host,
disk) and :mod:`pdserve.workers.kv.remote` (a Redis store every host reaches).

One step of the engine thread with the connector::

    1. admission (Scheduler._admit): the sequence takes its longest prefix in the pool
       (acquire_prefix), then get_num_new_matched_tokens(seq, num_computed_tokens) looks the
       next block hashes up in the host tier, then the disk tier, stopping at the first miss,
       then fetches what follows from the remote tier in batches (again up to its first miss),
       leaving at least one token to compute; the blocks found are read and verified now (a
       corrupt entry is a miss), so a hit can always be served. The scheduler allocates the
       sequence's blocks and calls update_state_after_alloc(seq, block table).
    2. build_connector_meta(batch) -> KVConnectorMetadata(load, save): load = (block id, data)
       of step 1's hits; save = (hash, block id) of every full block this step's forward
       completes that the disk tier lacks or the remote tier wants.
    3. worker.bind_connector_meta(meta); worker.start_load_kv(): copies the loads into the pool.
    4. the model runner's forward (computes only the tokens after the loaded blocks).
    5. update_resources registers loaded and computed full blocks in the prefix index.
    6. worker.wait_for_save(): copies the saved blocks to host memory (the forward is done) and
       queues them for the disk and remote tiers' writer threads; the writes never block the
       step.

So a load stalls the batch once, in the step that admits its sequence (reading a 4,000-token
prompt's blocks: a fraction of a second, against seconds to recompute them), and a save costs
the step one copy to host memory. The host tier fills from the other direction: a cached
block evicted from the pool (:class:`~pdserve.workers.kv.manager.KVCacheListener`) is copied
there while its K/V is still intact. Tiers need the prefix cache (block hashes);
:func:`build_connector` returns None when it is off or no tier is configured.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from pdserve.block_hash import BlockHasher, TokenBlocks
from pdserve.config.settings import KVCacheSettings
from pdserve.discovery.kvcache import Medium
from pdserve.workers.kv.manager import KVCacheManager
from pdserve.workers.kv.remote import RemoteTier
from pdserve.workers.kv.tiers import DiskTier, HostTier, TierListener, TierStats

log = logging.getLogger(__name__)

Tier = Literal["host", "disk", "remote"]
TIERS: tuple[Tier, ...] = ("host", "disk", "remote")


class RequestTokens(TokenBlocks, Protocol):
    """A request's tokens as the connector's scheduler side sees them (the engine's
    :class:`~pdserve.workers.engine.sequence.Sequence`; kv/ never imports the engine)."""

    @property
    def request_id(self) -> str: ...


class StepItem(Protocol):
    """One scheduled sequence as :meth:`KVConnectorScheduler.build_connector_meta` sees it
    (:class:`~pdserve.workers.engine.scheduler.ScheduledSequence`): K/V of positions
    ``[start_position, num_kv_tokens_after_step)`` is computed by this step's forward."""

    @property
    def request_id(self) -> str: ...

    @property
    def seq(self) -> TokenBlocks: ...

    @property
    def start_position(self) -> int: ...

    @property
    def num_kv_tokens_after_step(self) -> int: ...


@dataclass(frozen=True)
class BlockLoad:
    """Copy ``kv`` (``[num_layers, 2, tpb, kvh, hd]``, CPU) into pool block ``block_id``."""

    block_id: int
    kv: torch.Tensor
    tier: Tier


@dataclass(frozen=True)
class BlockSave:
    """After the forward, copy pool block ``block_id`` out once and store it as
    ``block_hash`` in the disk tier (``disk``) and/or the remote tier (``remote``)."""

    block_hash: int
    block_id: int
    disk: bool = True
    remote: bool = False


@dataclass(frozen=True)
class KVConnectorMetadata:
    """What the worker side does around one step's forward (the seed's
    ``PersistentKvCacheConnectorMetadata``): ``load`` before it, ``save`` after it."""

    load: tuple[BlockLoad, ...] = ()
    save: tuple[BlockSave, ...] = ()


@dataclass(frozen=True)
class KVConnectorStats:
    """Connector counters since start (a snapshot): ``hit_blocks[tier]`` blocks loaded from
    each tier instead of recomputed (``hit_tokens``: times tokens per block),
    ``saved_blocks`` blocks copied out of the pool for the disk or remote tier, and each
    tier's own :class:`~pdserve.workers.kv.tiers.TierStats` (None: the tier is off)."""

    tokens_per_block: int
    hit_blocks: dict[str, int]
    saved_blocks: int
    host: TierStats | None
    disk: TierStats | None
    remote: TierStats | None = None

    def tiers(self) -> list[tuple[str, TierStats]]:
        """(name, stats) of each tier that is on, host first."""
        named = (("host", self.host), ("disk", self.disk), ("remote", self.remote))
        return [(name, t) for name, t in named if t is not None]

    def hit_tokens(self, tier: str) -> int:
        return self.hit_blocks.get(tier, 0) * self.tokens_per_block


def copy_block(pool: torch.Tensor, block_id: int) -> torch.Tensor:
    """A contiguous CPU copy of ``pool[:, block_id]`` (``[num_layers, 2, tpb, kvh, hd]``) that
    shares no storage with the pool (a block to keep after the pool block is reused)."""
    view = pool[:, block_id]
    if view.device.type == "cpu":
        return view.clone(memory_format=torch.contiguous_format)
    return view.to("cpu", memory_format=torch.contiguous_format)


@dataclass
class _PendingLoad:
    first: int  # table position of the first loaded block
    found: list[tuple[Tier, torch.Tensor]]
    block_ids: list[int] = field(default_factory=list)


class KVConnectorScheduler:
    """The deciding side: which blocks a new sequence loads, which blocks a step saves.

    Called on the engine thread only (under the scheduler's lock): ``kv_cache`` is the pool
    the blocks go into (its hasher names them), ``host``/``disk``/``remote`` the tiers (None:
    off)."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        host: HostTier | None,
        disk: DiskTier | None,
        remote: RemoteTier | None = None,
    ):
        self.hasher: BlockHasher = kv_cache.hasher
        self.tokens_per_block = kv_cache.tokens_per_block
        self.kv_cache = kv_cache
        self.host, self.disk, self.remote = host, disk, remote
        self._pending: dict[str, _PendingLoad] = {}
        self._lock = threading.Lock()
        self.hit_blocks: dict[str, int] = dict.fromkeys(TIERS, 0)

    def get_num_new_matched_tokens(self, seq: RequestTokens, num_computed_tokens: int) -> int:
        """Tokens after the first ``num_computed_tokens`` (a pool prefix, a multiple of tokens
        per block) whose blocks the tiers hold: a multiple of tokens per block, at most up to
        the last full block before ``seq``'s last known token (one token is always computed,
        so the step samples). The blocks' data is fetched and verified now and kept for
        :meth:`update_state_after_alloc`; a sequence asked twice keeps the second answer."""
        tpb = self.tokens_per_block
        if num_computed_tokens % tpb:
            return 0
        hashes = self.hasher.extend(seq)
        limit = min(len(hashes), (seq.num_tokens - 1) // tpb)
        first = num_computed_tokens // tpb
        wanted = hashes[first:limit]
        found: list[tuple[Tier, torch.Tensor]] = []
        for digest in wanted:
            kv = self.host.get(digest) if self.host is not None else None
            tier: Tier = "host"
            if kv is None and self.disk is not None:
                kv, tier = self.disk.load(digest), "disk"
            if kv is None:
                break
            found.append((tier, kv))
        if self.remote is not None and len(found) < len(wanted):
            found.extend(("remote", kv) for kv in self.remote.load_prefix(wanted[len(found) :]))
        with self._lock:
            if found:
                self._pending[seq.request_id] = _PendingLoad(first, found)
            else:
                self._pending.pop(seq.request_id, None)
        return len(found) * tpb

    def update_state_after_alloc(self, seq: RequestTokens, block_ids: list[int]) -> None:
        """``seq`` holds ``block_ids`` now (its whole block table, token order): bind the
        blocks the matched tokens go into. Raises ValueError when the table is too short."""
        with self._lock:
            pending = self._pending.get(seq.request_id)
            if pending is None:
                return
            end = pending.first + len(pending.found)
            if len(block_ids) < end:
                raise ValueError(f"{seq.request_id} holds {len(block_ids)} blocks, needs {end}")
            pending.block_ids = block_ids[pending.first : end]

    def request_finished(self, request_id: str) -> bool:
        """Forget ``request_id``'s unbound matches. Returns False: the connector never delays
        freeing a request's blocks (saves copy them to host memory within the step)."""
        with self._lock:
            self._pending.pop(request_id, None)
        return False

    def build_connector_meta(self, items: Iterable[StepItem]) -> KVConnectorMetadata:
        """This step's loads (the bound matches of sequences in ``items``; any other match is
        dropped) and saves (full blocks the step completes that the disk tier lacks or the
        remote tier wants)."""
        tpb, loads, saves = self.tokens_per_block, [], []
        with self._lock:
            pending, self._pending = self._pending, {}
        for item in items:
            p = pending.get(item.request_id)
            if p is not None and p.block_ids:
                for (tier, kv), block in zip(p.found, p.block_ids, strict=True):
                    loads.append(BlockLoad(block, kv, tier))
                    self.hit_blocks[tier] += 1
            disk, remote = self.disk, self.remote
            if disk is None and remote is None:
                continue
            first, end = item.start_position // tpb, item.num_kv_tokens_after_step // tpb
            if end <= first:
                continue
            hashes = self.hasher.extend(item.seq, item.num_kv_tokens_after_step)
            table = self.kv_cache.block_table(item.request_id)
            for i in range(first, min(end, len(table))):
                to_disk = disk is not None and hashes[i] not in disk
                to_remote = remote is not None and remote.wants(hashes[i])
                if to_disk or to_remote:
                    saves.append(BlockSave(hashes[i], table[i], to_disk, to_remote))
        return KVConnectorMetadata(tuple(loads), tuple(saves))


class KVConnectorWorker:
    """The executing side (engine thread): copies loads into the pool before the forward and
    hands saved blocks to the disk and remote tiers after it. Never reaches back to the
    scheduler side."""

    def __init__(self, disk: DiskTier | None, remote: RemoteTier | None = None) -> None:
        self.disk, self.remote = disk, remote
        self.pool: torch.Tensor | None = None
        self.saved_blocks = 0
        self._meta = KVConnectorMetadata()

    def register_kv_caches(self, pool: torch.Tensor) -> None:
        """The pool ``[num_layers, num_blocks, 2, tpb, kvh, hd]`` the blocks live in (once).
        Raises RuntimeError when a pool is already registered."""
        if self.pool is not None:
            raise RuntimeError("KV caches already registered")
        self.pool = pool

    def bind_connector_meta(self, meta: KVConnectorMetadata) -> None:
        """This step's work (replaces the previous step's)."""
        self._meta = meta

    def start_load_kv(self) -> None:
        """Copy every load into its pool block, all layers, before returning (the model
        runner has no per-layer hook, so :meth:`wait_for_layer_load` has nothing to wait
        for)."""
        assert self.pool is not None, "register_kv_caches first"
        for load in self._meta.load:
            self.pool[:, load.block_id].copy_(load.kv)

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer ``layer``'s loads are in the pool: always so once :meth:`start_load_kv`
        returned (a layer-wise backend would wait here)."""

    def save_kv_layer(self, layer: int) -> None:
        """Layer-wise save hook: nothing to do here, blocks are saved whole after the forward
        (:meth:`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """After the forward: copy each saved block to host memory once (the step's only
        cost) and queue it for the disk and/or remote writer thread (a full queue drops it,
        counted by the tier). Both tiers only read the copy."""
        if not self._meta.save:
            return
        assert self.pool is not None, "register_kv_caches first"
        for save in self._meta.save:
            kv = copy_block(self.pool, save.block_id)
            queued = False
            if save.disk and self.disk is not None:
                queued = self.disk.save(save.block_hash, kv)
            if save.remote and self.remote is not None:
                queued = self.remote.save(save.block_hash, kv) or queued
            self.saved_blocks += queued

    def get_finished(self, finished_req_ids: list[str]) -> tuple[list[str], list[str]]:
        """(requests whose saves finished, requests whose loads finished) among those the
        engine holds back: none, since loads complete before the forward and saves copy the
        blocks within the step, so no request's blocks are ever held for the connector."""
        return [], []


class _HostFiller:
    """:class:`~pdserve.workers.kv.manager.KVCacheListener` that copies evicted cached blocks
    into the host tier (called under the KV cache manager's lock, K/V still intact)."""

    def __init__(self, host: HostTier, pool: torch.Tensor) -> None:
        self.host, self.pool = host, pool

    def blocks_stored(self, hashes: list[int], block_ids: list[int]) -> None:
        pass  # the disk tier's saves follow the steps (build_connector_meta), not the index

    def blocks_evicted(self, hashes: list[int], block_ids: list[int]) -> None:
        with torch.inference_mode():
            for digest, block in zip(hashes, block_ids, strict=True):
                if digest not in self.host:
                    self.host.put(digest, copy_block(self.pool, block))


class KVConnector:
    """Both sides over one pool and its tiers (build with :func:`build_connector`): the
    scheduler passes :attr:`scheduler` its admissions, the engine calls :meth:`start_step`
    before each forward and :meth:`finish_step` after a successful one, and
    :meth:`shutdown` at the end (writes what is queued, at most ``timeout`` seconds)."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        host: HostTier | None,
        disk: DiskTier | None,
        remote: RemoteTier | None = None,
    ):
        self.host, self.disk, self.remote = host, disk, remote
        self.scheduler = KVConnectorScheduler(kv_cache, host, disk, remote)
        self.worker = KVConnectorWorker(disk, remote)
        self.worker.register_kv_caches(kv_cache.pool)
        if host is not None:
            kv_cache.add_listener(_HostFiller(host, kv_cache.pool))

    def _tiers(self) -> list[HostTier | DiskTier | RemoteTier]:
        return [t for t in (self.host, self.disk, self.remote) if t is not None]

    def add_tier_listener(self, listener: TierListener) -> None:
        """Tell ``listener`` of every block each tier stores or drops from now on (the KV
        cache events: :mod:`pdserve.workers.kv.cache_events`)."""
        for tier in self._tiers():
            tier.listeners.add(listener)

    def tier_hashes(self) -> dict[Medium, list[int]]:
        """Per tier that is on (``host``, ``disk``, ``remote``), the block hashes it holds now
        (the disk tier: its directory's files; the remote tier: what this worker knows the
        store holds). For KV cache event snapshots; O(blocks)."""
        return {tier.listeners.medium: tier.hashes() for tier in self._tiers()}

    def start_step(self, items: Iterable[StepItem]) -> None:
        """Steps 2-3 of the module docstring: build and bind the metadata, load."""
        self.worker.bind_connector_meta(self.scheduler.build_connector_meta(items))
        self.worker.start_load_kv()

    def finish_step(self) -> None:
        """Step 6: queue this step's saves. Never raises: a failed save is logged and the
        block simply stays out of the disk tier (the step's outputs must go out)."""
        try:
            self.worker.wait_for_save()
        except Exception:
            log.exception("KV connector: queueing this step's saves failed")

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats(
            self.scheduler.tokens_per_block,
            dict(self.scheduler.hit_blocks),
            self.worker.saved_blocks,
            self.host.stats() if self.host is not None else None,
            self.disk.stats() if self.disk is not None else None,
            self.remote.stats() if self.remote is not None else None,
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Write the queued saves (at most ``timeout`` s per tier) and stop the writers.
        Idempotent."""
        if self.disk is not None:
            self.disk.close(timeout)
        if self.remote is not None:
            self.remote.close(timeout)


def build_connector(settings: KVCacheSettings, kv_cache: KVCacheManager) -> KVConnector | None:
    """The connector of ``settings`` (``host_cache_mb``, ``disk_cache_dir``,
    ``disk_cache_mb``, ``remote_cache`` and its timeout and TTL) over ``kv_cache``, or None
    when no tier is on or prefix caching is off (a warning then: the tiers name blocks by their
    prefix-cache hash). Raises OSError when the disk directory cannot be created; an
    unreachable remote store is not an error (its breaker opens). Tensor parallel pools
    (``tp_size`` > 1) get no tier (warned)."""
    host_bytes = settings.host_cache_bytes(str(kv_cache.pool.device))
    disk_dir = settings.disk_cache_dir
    if not host_bytes and disk_dir is None and settings.remote_cache is None:
        return None
    if not kv_cache.prefix_caching:
        log.warning("KV cache tiers need the prefix cache; --no-prefix-caching turns them off")
        return None
    if kv_cache.layout.tp_size > 1:  # the tiers copy whole blocks of a one-shard pool
        log.warning("KV cache tiers do not hold tensor parallel pools yet; tiers off")
        return None
    host = HostTier(host_bytes) if host_bytes else None
    disk = None
    if disk_dir is not None:
        disk = DiskTier(disk_dir, int(settings.disk_cache_mb * 2**20), kv_cache.layout)
    remote = None
    if settings.remote_cache is not None:
        remote = RemoteTier(
            settings.remote_cache,
            kv_cache.layout,
            timeout_s=settings.remote_cache_timeout_ms / 1000,
            ttl_s=settings.remote_cache_ttl_s,
        )
    log.info(
        "KV cache connector: host tier %s, disk tier %s, remote tier %s",
        f"{host_bytes >> 20} MiB" if host else "off",
        f"{disk_dir} (cap {settings.disk_cache_mb} MiB)" if disk else "off",
        remote.where if remote else "off",
    )
    return KVConnector(kv_cache, host, disk, remote)
