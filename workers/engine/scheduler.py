"""Capacity scheduler with continuous batching and recompute preemption.

Two capacity policies (TensorRT-LLM's ``capacity_scheduler_policy`` names):

``max_utilization`` (the default; vLLM's scheduler): admission by *current* need. A waiting
sequence is admitted when the blocks of the tokens it must compute now (its prompt, or prompt +
output for a preempted one) fit in the free blocks with ``watermark`` blocks to spare; blocks are
then allocated step by step as the sequence grows. When a step cannot get a block, the most
recently admitted running sequence is *preempted*: it gives all its blocks back and returns to
the front of the waiting queue with ``num_computed_tokens = 0``; once readmitted it recomputes
the K/V of its prompt and of the tokens it already produced in one context phase (vLLM's
recompute preemption), and its next sampled token continues the stream exactly where it stopped
(position-keyed sampling makes seeded draws independent of the preemption)::

    running (admission order):  [ a  b  c  d ]      step needs a block for b, none free
    preempt from the tail:      [ a  b  c ]  d -> waiting[0], d's blocks freed
    still short: preempt c      [ a  b ]     c -> waiting[0]  (no new admission this step)

``guaranteed_no_evict``: a sequence is admitted only when the blocks it needs to run to
completion fit in the pool's *headroom*::

    headroom = free blocks - sum over admitted sequences of (need_blocks - blocks held)

so an admitted sequence never waits for a block and never is preempted, at the price of
reserving ``prompt + max_tokens`` up front (a request without ``max_tokens`` reserves the whole
context window).

Prefix cache: a waiting sequence that holds no blocks (new, preempted, or a choice whose fork
found no block) first takes its longest cached prefix of full blocks
(:meth:`KVCacheManager.acquire_prefix`), so its ``num_computed_tokens`` starts there and the
context phase computes only the rest (at least its last token). The admission test then runs
with those blocks held; a sequence that still does not fit drops them again (they return to the
evictable LRU) and stays first in line. A preempted sequence freed its blocks to the cache, so
when readmitted it usually finds its own prefix. Evictable cached blocks count as free
everywhere below. With a KV cache connector (host/disk tiers, :mod:`pdserve.workers.kv.offload`)
an admitted sequence then asks it for the blocks after its pool prefix: those found count as
computed, get blocks with the step's allocation, and are loaded before the step's forward.

Both policies: blocks held outside the scheduler (parked prefill results) are simply not free.
:meth:`Scheduler.reserve` (decode worker: blocks for a transferred prompt) allocates the prompt's
blocks at once (and, under ``guaranteed_no_evict``, reserves the whole completion); reserved
blocks are never preempted until their sequence runs.

Batching (nano-vllm / vLLM v1 style): each step is every running generation-phase sequence (one
token each) plus context-phase chunks, first of partially computed sequences, then of newly
admitted ones (reserved first, then FCFS), within ``max_num_batched_tokens`` tokens and
``max_num_seqs`` running sequences.

Shares (tenants): a request the router's fair queue admitted carries its tenant's
:class:`~pdserve.protocol.Share` (``sampling.share``). While any context-phase or waiting
sequence has one, the context-phase budget goes first to the tenant with the least *service*
per unit of weight (prompt tokens computed for it, decayed with a half-life of
:data:`SHARE_HALF_LIFE_S`), then by ``priority``, then in the order above; a running
sequence's next chunk yields to a waiting sequence of a less served tenant that fits. A prefill
is never interrupted inside a chunk, so a quiet tenant's short prompt waits at most one chunk
(``max_num_batched_tokens`` tokens) of a flooding tenant's long ones, not all of them: the
start-time fair queuing of Goyal et al. (SIGCOMM 1996) at chunk granularity, as Sarathi-Serve's
chunked prefill makes it possible. Without shares nothing changes.

Thread-safety: all public methods take one lock; :meth:`schedule` allocates the step's blocks
under it, so capacity decisions on other threads (``reserve``) always see a consistent pool.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.workers.engine.sampling.speculative import NgramProposer, speculates, take_turn
from pdserve.workers.engine.sequence import Sequence, SequenceStatus
from pdserve.workers.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from pdserve.config.settings import SchedulerSettings
    from pdserve.workers.kv.offload import KVConnectorScheduler

SHARE_HALF_LIFE_S = 10.0
"""Half-life of a tenant's counted service (prompt tokens computed for it), seconds."""

CapacityPolicy = Literal["max_utilization", "guaranteed_no_evict"]
"""``scheduler.capacity_policy`` (declared in :class:`~pdserve.config.settings.SchedulerSettings`)."""


@dataclass(frozen=True, eq=False)
class ScheduledSequence:
    """One sequence's work in a step, fixed when scheduled: feed ``num_new_tokens`` tokens from
    position ``start_position``; ``samples`` when the step ends on the sequence's last known
    token (so its logits give the next token). Build with :meth:`of`.

    ``draft``: speculative decoding (:mod:`pdserve.workers.engine.sampling.speculative`): tokens proposed
    to follow the last known token, fed after it and counted in ``num_new_tokens``; every fed
    row is sampled and the drafts are verified after the forward."""

    seq: Sequence
    num_new_tokens: int
    start_position: int
    samples: bool
    draft: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, seq: Sequence, num_new_tokens: int, draft: tuple[int, ...] = ()
    ) -> ScheduledSequence:
        start = seq.num_computed_tokens
        samples = start + num_new_tokens == seq.num_tokens
        return cls(seq, num_new_tokens + len(draft), start, samples, draft)

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def num_kv_tokens_after_step(self) -> int:
        """Tokens whose K/V is known right after the forward: the drafts' K/V only counts once
        verified (the engine then reports the accepted ones)."""
        return self.start_position + self.num_new_tokens - len(self.draft)

    @property
    def num_rows(self) -> int:
        """Logits rows this sequence samples: one per fed row when it has drafts, else one."""
        return len(self.draft) + 1

    def token_ids(self) -> list[int]:
        """The tokens this step feeds: a prompt chunk, the last output token (and its drafts),
        or (recompute after preemption) a chunk that may span prompt and output tokens."""
        known = self.seq.token_slice(self.start_position, self.num_new_tokens - len(self.draft))
        return known + list(self.draft) if self.draft else known


@dataclass(eq=False)
class ScheduledBatch:
    """What one step runs: ``decode`` (one token each) first, then ``prefill`` chunks. The
    model runner keeps this order; logits come back for ``sampling`` in the same order."""

    decode: list[ScheduledSequence] = field(default_factory=list)
    prefill: list[ScheduledSequence] = field(default_factory=list)

    @property
    def items(self) -> list[ScheduledSequence]:
        return self.decode + self.prefill

    @property
    def sampling(self) -> list[ScheduledSequence]:
        return [s for s in self.items if s.samples]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.items)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    """Queues ``waiting`` (not admitted, or preempted), ``running`` (admitted: context or
    generation phase) and ``reserved`` (prompt blocks held by :meth:`reserve` until the resume
    request arrives).

    ``settings``: the scheduler section, read whole (``max_num_seqs``,
    ``max_num_batched_tokens``; ``capacity_policy``: ``max_utilization``, admission by current
    need with recompute preemption, or ``guaranteed_no_evict``, admission by the whole
    completion that never preempts; see the module docstring; ``speculative_tokens`` and the
    other ``speculative_*`` fields: n-gram drafts for generation-phase sequences, see
    :mod:`pdserve.workers.engine.sampling.speculative`). ``watermark_blocks``: free blocks a
    ``max_utilization`` admission leaves for the running sequences to grow into (default: 1 %
    of the pool, at least 1, as vLLM's watermark). ``num_preemptions`` counts preemptions since
    start. Drafts never cause a preemption: a sequence whose drafts' blocks are not free runs
    without them.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        settings: SchedulerSettings,
        *,
        watermark_blocks: int | None = None,
        connector: KVConnectorScheduler | None = None,
    ):
        self.kv_cache = kv_cache
        self.settings = settings
        self.policy: CapacityPolicy = settings.capacity_policy
        self.watermark = (
            max(1, kv_cache.num_blocks // 100) if watermark_blocks is None else watermark_blocks
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.connector = connector
        self.proposer = (
            NgramProposer(
                settings.speculative_tokens,
                settings.speculative_ngram_max,
                settings.speculative_ngram_min,
            )
            if settings.speculative_tokens
            else None
        )
        self._service: dict[str, float] = {}  # tenant -> decayed prompt tokens computed
        self._service_at = time.monotonic()
        self._lock = threading.RLock()

    # --- shares (tenants) ----------------------------------------------------------------------

    def _share_key(self, seq: Sequence) -> tuple[float, int]:
        """(service per unit of weight of ``seq``'s tenant, its priority); (0, 0) without a
        share. Lower goes first."""
        share = seq.sampling.share
        if share is None:
            return (0.0, 0)
        return (self._service.get(share.tenant, 0.0) / share.weight, share.priority)

    def _decay_service(self) -> None:
        now = time.monotonic()
        factor = 0.5 ** ((now - self._service_at) / SHARE_HALF_LIFE_S)
        self._service_at = now
        for tenant in list(self._service):
            self._service[tenant] *= factor
            if self._service[tenant] < 1.0:
                del self._service[tenant]

    def _sharing(self) -> bool:
        """Whether a context-phase or waiting sequence carries a share (else: arrival order)."""
        return any(s.sampling.share is not None for s in self.waiting) or any(
            s.sampling.share is not None for s in self.running if s.in_context_phase
        )

    def _first_waiting_key(self) -> tuple[float, int] | None:
        """The best share key among waiting sequences that could be admitted now (None: none
        could): a running context-phase sequence with a worse key leaves this step's budget
        to it."""
        if len(self.running) >= self.settings.max_num_seqs:
            return None
        room = self.headroom()
        keys = [self._share_key(w) for w in self.waiting if w.reserved or self._fits(w, room)]
        return min(keys, default=None)

    # --- capacity ------------------------------------------------------------------------------

    def _outstanding(self, seq: Sequence) -> int:
        """Blocks ``seq`` may still allocate under ``guaranteed_no_evict``."""
        return seq.need_blocks - self.kv_cache.num_allocated(seq.request_id)

    def headroom(self) -> int:
        """``guaranteed_no_evict``: free blocks not promised to an admitted sequence or a
        reservation. ``max_utilization`` promises nothing: the free blocks."""
        with self._lock:
            free = self.kv_cache.get_num_free_blocks()
            if self.policy == "max_utilization":
                return free
            holders = [*self.running, *self.reserved.values()]
            holders += [seq for seq in self.waiting if seq.reserved]  # resumed, not yet running
            return free - sum(self._outstanding(seq) for seq in holders)

    def reserve(self, seq: Sequence, *, reuse_prefix: bool = False) -> list[int]:
        """Allocate blocks for ``seq``'s prompt now (and, under ``guaranteed_no_evict``, admit
        its whole completion); returns the prompt's block table (the caller fills those blocks,
        then submits the resume request, which passes the same object to :meth:`add`).

        ``reuse_prefix``: start the table with the prompt's longest cached prefix of full blocks
        (:meth:`KVCacheManager.acquire_prefix`, at least the last prompt token's block stays to
        fill); ``seq.num_cached_tokens`` says how many tokens those blocks already hold, and the
        caller fills only the blocks after them (delta transfer). The lookup counts as a prefix
        cache query.

        Raises :class:`CapacityError` when the blocks (plus the watermark) are not free now, or,
        under ``guaranteed_no_evict``, when ``seq.need_blocks`` exceeds the headroom; a refused
        reservation holds nothing (a prefix it took is released)."""
        kv = self.kv_cache
        with self._lock:
            cached = 0
            if reuse_prefix and kv.prefix_caching and not kv.num_allocated(seq.request_id):
                hashes = kv.hasher.extend(seq, seq.num_prompt_tokens)
                cached = kv.acquire_prefix(seq.request_id, hashes, seq.num_prompt_tokens)
            held = kv.num_allocated(seq.request_id)
            if self.policy == "guaranteed_no_evict":
                room, need = self.headroom(), seq.need_blocks - held
            else:
                room = kv.get_num_free_blocks() - self.watermark
                need = kv.blocks_for_tokens(seq.num_prompt_tokens) - held
            if need > room:
                if held:
                    kv.free(seq.request_id)  # the prefix goes back to the evictable LRU
                raise CapacityError(
                    f"cannot reserve {need} KV blocks for {seq.request_id}: "
                    f"{max(room, 0)} of {kv.num_blocks} available"
                )
            if reuse_prefix:
                kv.counters.record_query(seq.num_prompt_tokens, cached)
            seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RESERVED
            seq.reserved = True
            self.reserved[seq.request_id] = seq
            return kv.allocate(seq.request_id, seq.num_prompt_tokens)

    # --- peer prefix pull (workers/roles/lending.py) -------------------------------------------

    def lend(self, lend_id: str, block_hashes: list[int]) -> list[int]:
        """Lender side: pin the longest leading run of ``block_hashes`` that the prefix cache
        holds under ``lend_id`` (a reference per block: no eviction until :meth:`end_lend`)
        and return their block ids, in token order; [] (nothing held) when none is cached or
        ``lend_id`` already holds blocks."""
        kv = self.kv_cache
        with self._lock:
            if kv.num_allocated(lend_id):
                return []
            # acquire_prefix leaves the block of the last token: ask for one token more
            kv.acquire_prefix(lend_id, block_hashes, len(block_hashes) * kv.tokens_per_block + 1)
            return kv.block_table(lend_id)

    def end_lend(self, lend_id: str) -> None:
        """Drop :meth:`lend`'s references (the blocks stay cached, evictable). Idempotent."""
        with self._lock:
            self.kv_cache.free(lend_id)

    def adopt(self, request_id: str) -> int:
        """Puller side: a reservation whose blocks a peer's K/V filled (every block of its
        prompt) leaves ``reserved``; its full blocks join the prefix cache under the prompt's
        block hashes and its blocks are freed (evictable, most recently used). Returns the
        blocks indexed now (0: no such reservation, or already cached)."""
        kv = self.kv_cache
        with self._lock:
            seq = self.reserved.pop(request_id, None)
            if seq is None:
                return 0
            stored = kv.register(request_id, kv.hasher.extend(seq), seq.num_prompt_tokens, seq)
            kv.free(request_id)
            return stored

    def unreserve(self, request_id: str) -> bool:
        """Drop a reservation and free its blocks; False if there was none. Idempotent."""
        with self._lock:
            if self.reserved.pop(request_id, None) is None:
                return False
            self.kv_cache.free(request_id)
            return True

    # --- queues --------------------------------------------------------------------------------

    def add(self, seq: Sequence, *, front: bool = False) -> None:
        """Queue ``seq`` as WAITING (at the front with ``front``: a forked choice that already
        holds blocks). A reserved sequence (the same object :meth:`reserve` took) leaves
        ``reserved`` atomically and is admitted ahead of the FCFS queue; raises
        :class:`InvalidRequestError` if its reservation was released meanwhile."""
        with self._lock:
            if seq.reserved:  # its blocks move along with it
                if self.reserved.get(seq.request_id) is not seq:
                    raise InvalidRequestError(f"the reservation of {seq.request_id} was released")
                del self.reserved[seq.request_id]
            seq.status = SequenceStatus.WAITING
            if front:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)

    def remove(self, request_id: str) -> Sequence | None:
        """Take a waiting or running sequence out of the scheduler (abort, error) and free its
        blocks. Must run on the engine thread between steps. Returns it, or None if unknown."""
        with self._lock:
            for queue in (self.waiting, self.running):
                for seq in queue:
                    if seq.request_id == request_id:
                        queue.remove(seq)
                        self.kv_cache.free(request_id)
                        return seq
            return None

    def finish(self, seq: Sequence, *, free_blocks: bool = True) -> None:
        """Take a running ``seq`` out of ``running``; free its blocks unless ``free_blocks`` is
        False (a parked prefill result keeps them for the caller)."""
        with self._lock:
            self.running.remove(seq)
            if free_blocks:
                self.kv_cache.free(seq.request_id)

    # --- the step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work, preempt what does not fit, admit what fits, and allocate the
        step's KV blocks (``prepare_resources`` happens here, one sequence at a time, so a
        shortage preempts instead of failing the step)."""
        with self._lock:
            plan: dict[int, int] = {}  # id(seq) -> tokens to feed
            budget = self.settings.max_num_batched_tokens
            for seq in self.running:  # generation phase first: one token each
                if not seq.in_context_phase and budget > 0:
                    plan[id(seq)] = 1
                    budget -= 1
            drafts = self._propose(plan, budget) if self.proposer is not None else {}
            budget -= sum(len(d) for d in drafts.values())
            context = [seq for seq in self.running if seq.in_context_phase]
            sharing = self._sharing()
            ahead = None
            if sharing:  # the least served tenant's chunks first (module docstring, "Shares")
                self._decay_service()
                context.sort(key=self._share_key)  # stable: the order above within a key
                ahead = self._first_waiting_key()
            for seq in context:  # context phase continues in chunks
                if budget <= 0:
                    break
                if ahead is not None and self._share_key(seq) > ahead:
                    continue  # a less served tenant's waiting sequence takes this budget
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                plan[id(seq)] = n
                budget -= n
            scheduled: list[ScheduledSequence] = []
            preemptions = self.num_preemptions
            index = 0
            while index < len(self.running):  # allocate in admission order, preempt the tail
                seq = self.running[index]
                n = plan.get(id(seq), 0)
                draft = drafts.get(id(seq), ())
                if draft:  # drafts only where their blocks are free: they never preempt
                    missing = self.kv_cache.blocks_for_tokens(seq.num_tokens + len(draft))
                    if not self.kv_cache.can_allocate(
                        missing - self.kv_cache.num_allocated(seq.request_id)
                    ):
                        draft = ()
                if n and not self._allocate(seq, seq.num_computed_tokens + n + len(draft)):
                    break  # seq itself was preempted: it was the tail
                if n:
                    scheduled.append(ScheduledSequence.of(seq, n, draft))
                index += 1
            if self.num_preemptions == preemptions:  # vLLM: no admission in a preempting step
                budget = self.settings.max_num_batched_tokens - sum(
                    s.num_new_tokens for s in scheduled
                )
                scheduled += self._admit(budget, sharing)
            if sharing:
                for s in scheduled:
                    share = s.seq.sampling.share
                    if share is not None and s.seq.in_context_phase:
                        self._service[share.tenant] = (
                            self._service.get(share.tenant, 0.0) + s.num_new_tokens
                        )
            batch = ScheduledBatch()
            for s in scheduled:  # a drafted sequence feeds several rows: a chunk
                (batch.prefill if s.seq.in_context_phase or s.draft else batch.decode).append(s)
            return batch

    def _propose(self, plan: dict[int, int], budget: int) -> dict[int, tuple[int, ...]]:
        """N-gram drafts (``id(seq)`` -> tokens) for the generation-phase sequences in
        ``plan`` that may be speculated, within ``budget`` tokens; none when more than
        ``speculative_max_batch`` sequences are in the generation phase."""
        assert self.proposer is not None
        gen = [seq for seq in self.running if id(seq) in plan]
        if len(gen) > self.settings.speculative_max_batch:
            return {}
        drafts: dict[int, tuple[int, ...]] = {}
        for seq in gen:
            if budget <= 0:
                break
            if seq.mode == "prefill" or not speculates(seq.sampling) or not take_turn(seq):
                continue
            room = seq.sampling.max_tokens - len(seq.output_token_ids) - 1
            draft = self.proposer.propose(
                seq.prompt_token_ids + seq.output_token_ids, min(room, budget)
            )
            if draft:
                drafts[id(seq)] = tuple(draft)
                budget -= len(draft)
        return drafts

    def _allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s blocks to ``num_tokens`` tokens, preempting running sequences from the
        tail of ``running`` until they fit. False when ``seq`` itself had to be preempted."""
        missing = self.kv_cache.blocks_for_tokens(num_tokens)
        missing -= self.kv_cache.num_allocated(seq.request_id)
        while not self.kv_cache.can_allocate(missing):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.kv_cache.allocate(seq.request_id, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free all of ``seq``'s blocks and requeue it at the front of
        ``waiting``; it recomputes prompt + output K/V when readmitted."""
        self.running.remove(seq)
        self.kv_cache.free(seq.request_id)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.reserved = False
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _fits(self, seq: Sequence, room: int) -> bool:
        """Admission test of a waiting, not reserved ``seq`` against ``room``."""
        if self.policy == "guaranteed_no_evict":
            return self._outstanding(seq) <= room
        need = self.kv_cache.blocks_for_tokens(seq.num_tokens)
        need -= self.kv_cache.num_allocated(seq.request_id)
        # The watermark keeps room for running sequences to grow; an idle engine admits the
        # head of the queue whenever it fits at all, so a request as large as the pool runs.
        return need + self.watermark <= room or (not self.running and need <= room)

    def _admit(self, budget: int, sharing: bool = False) -> list[ScheduledSequence]:
        """Move waiting sequences into ``running`` while token budget, ``max_num_seqs`` and KV
        capacity allow, and allocate their first step. Reserved ones first; the FCFS rest stops
        at the first that does not fit (no overtaking, so a large request is not starved).
        ``sharing``: within those two groups, by share key first (module docstring)."""
        admitted: list[ScheduledSequence] = []
        room = self.headroom()
        if sharing:
            order = sorted(self.waiting, key=lambda s: (not s.reserved, self._share_key(s)))
        else:
            order = sorted(self.waiting, key=lambda s: not s.reserved)
        for seq in order:
            if budget <= 0 or len(self.running) >= self.settings.max_num_seqs:
                break
            looked_up = self._acquire_prefix(seq)
            cached = seq.num_cached_tokens if looked_up else 0
            if cached:
                room = self.headroom()  # evictable blocks it took are no longer free
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            step_blocks = self.kv_cache.blocks_for_tokens(seq.num_computed_tokens + n)
            step_blocks -= self.kv_cache.num_allocated(seq.request_id)
            if seq.reserved:
                if not self.kv_cache.can_allocate(step_blocks):
                    break
            elif not self._fits(seq, room):
                if cached:
                    self.kv_cache.free(seq.request_id)  # back to the LRU; looked up again later
                    seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            elif self.policy == "guaranteed_no_evict":
                room -= self._outstanding(seq)
            self.waiting.remove(seq)
            loaded = self._match_external(seq) if looked_up else 0
            seq.num_cached_tokens += loaded  # usage's cached_tokens counts tier loads too
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            table = self.kv_cache.allocate(seq.request_id, seq.num_computed_tokens + n)
            if loaded and self.connector is not None:
                self.connector.update_state_after_alloc(seq, table)
            if self.policy == "max_utilization":
                room = self.kv_cache.get_num_free_blocks()
            seq.status = SequenceStatus.PREFILL if seq.in_context_phase else SequenceStatus.DECODE
            if seq.admitted_s is None:
                seq.admitted_s = time.monotonic()
            self.running.append(seq)
            admitted.append(ScheduledSequence.of(seq, n))
            budget -= n
            if looked_up:
                self.kv_cache.counters.record_query(seq.num_tokens, cached)
        return admitted

    def _acquire_prefix(self, seq: Sequence) -> bool:
        """Give a waiting ``seq`` that holds no blocks its cached prefix (sets
        ``num_computed_tokens`` and ``num_cached_tokens``); False when no lookup applies
        (prefix caching off, reserved, already holding blocks or computed tokens)."""
        kv = self.kv_cache
        if not kv.prefix_caching or seq.reserved or seq.num_computed_tokens:
            return False
        if seq.sampling.prompt_logprobs is not None:
            return False  # every prompt position's logits are wanted: compute it whole
        if kv.num_allocated(seq.request_id):
            return False
        cached = kv.acquire_prefix(seq.request_id, kv.hasher.extend(seq), seq.num_tokens)
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        return True

    def _match_external(self, seq: Sequence) -> int:
        """KV cache connector (:mod:`pdserve.workers.kv.offload`): the tokens after ``seq``'s
        pool prefix that a tier holds; they count as computed (their blocks are loaded before
        the admitting step's forward). 0 without a connector."""
        if self.connector is None:
            return 0
        matched = self.connector.get_num_new_matched_tokens(seq, seq.num_computed_tokens)
        seq.num_computed_tokens += matched
        return matched
