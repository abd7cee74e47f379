"""Capacity scheduler with continuous batching.

Admission (TensorRT-LLM's ``GUARANTEED_NO_EVICT`` capacity policy over the seed's
``get_max_resource_count`` / ``get_needed_resource_to_completion``): a request is admitted only
when the blocks it needs to run to completion fit in the pool's *headroom*::

    headroom = free blocks - sum over admitted requests of (need_blocks - blocks held)

so every admitted request (and every reservation made by :meth:`Scheduler.reserve`) can always
finish without preemption, and a step's allocation can never fail. Blocks held outside the
scheduler (parked prefill results) are simply not free.

Batching (nano-vllm / vLLM v1 style): each step is every running generation-phase sequence (one
token each) plus context-phase chunks, first of partially prefilled sequences, then of newly
admitted ones (reserved first, then FCFS), within ``max_num_batched_tokens`` tokens and
``max_num_seqs`` running sequences. Waiting requests join between steps.

Thread-safety: all public methods take one lock; :meth:`schedule` allocates the step's blocks
(``prepare_resources``) under it, so capacity decisions on other threads (``reserve``) always see
a consistent pool.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.workers.kv_cache import KVCacheManager
from pdserve.workers.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, eq=False)
class ScheduledSequence:
    """One sequence's work in a step, fixed when scheduled: feed ``num_new_tokens`` tokens from
    position ``start_position``; ``samples`` when the step ends on the sequence's last known
    token (so its logits give the next token). Build with :meth:`of`."""

    seq: Sequence
    num_new_tokens: int
    start_position: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        return cls(seq, num_new_tokens, start, start + num_new_tokens == seq.num_tokens)

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def num_kv_tokens_after_step(self) -> int:
        return self.start_position + self.num_new_tokens

    def token_ids(self) -> list[int]:
        """The tokens this step feeds (a prompt chunk, or the last output token)."""
        seq, start = self.seq, self.start_position
        if start >= seq.num_prompt_tokens:
            return [seq.output_token_ids[start - seq.num_prompt_tokens]]
        return seq.prompt_token_ids[start : start + self.num_new_tokens]


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
    """Queues ``waiting`` (not admitted), ``running`` (admitted: context or generation phase)
    and ``reserved`` (capacity held by :meth:`reserve` until the resume request arrives)."""

    def __init__(self, kv_cache: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved: dict[str, Sequence] = {}
        self._lock = threading.RLock()

    # --- capacity ------------------------------------------------------------------------------

    def headroom(self) -> int:
        """Free blocks not promised to an admitted request or a reservation."""
        with self._lock:
            holders = [*self.running, *self.reserved.values()]
            holders += [seq for seq in self.waiting if seq.reserved]  # resumed, not yet running
            outstanding = sum(
                seq.need_blocks - self.kv_cache.num_allocated(seq.request_id) for seq in holders
            )
            return self.kv_cache.get_num_free_blocks() - outstanding

    def reserve(self, seq: Sequence) -> list[int]:
        """Admit ``seq``'s whole completion now and allocate blocks for its prompt; returns the
        prompt's block table (the caller fills those blocks, then submits the resume request,
        which passes the same object to :meth:`add`). Raises :class:`CapacityError` when
        ``seq.need_blocks`` exceeds the headroom."""
        with self._lock:
            room = self.headroom()
            if seq.need_blocks > room:
                raise CapacityError(
                    f"cannot reserve {seq.need_blocks} KV blocks for {seq.request_id}: "
                    f"{room} of {self.kv_cache.num_blocks} available"
                )
            seq.status = SequenceStatus.RESERVED
            seq.reserved = True
            self.reserved[seq.request_id] = seq
            return self.kv_cache.allocate(seq.request_id, seq.num_prompt_tokens)

    def unreserve(self, request_id: str) -> bool:
        """Drop a reservation and free its blocks; False if there was none. Idempotent."""
        with self._lock:
            if self.reserved.pop(request_id, None) is None:
                return False
            self.kv_cache.free(request_id)
            return True

    # --- queues --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` as WAITING. A reserved sequence (the same object :meth:`reserve` took)
        leaves ``reserved`` atomically and is admitted ahead of the FCFS queue; raises
        :class:`InvalidRequestError` if its reservation was released meanwhile."""
        with self._lock:
            if seq.reserved:  # its capacity moves along with it
                if self.reserved.get(seq.request_id) is not seq:
                    raise InvalidRequestError(f"the reservation of {seq.request_id} was released")
                del self.reserved[seq.request_id]
            seq.status = SequenceStatus.WAITING
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
        """Pick this step's work, admit what fits, and allocate the step's KV blocks."""
        with self._lock:
            batch = ScheduledBatch()
            budget = self.max_num_batched_tokens
            for seq in self.running:
                if not seq.in_context_phase and budget > 0:
                    batch.decode.append(ScheduledSequence.of(seq, 1))
                    budget -= 1
            for seq in self.running:  # context phase continues in chunks
                if seq.in_context_phase and budget > 0:
                    n = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
                    batch.prefill.append(ScheduledSequence.of(seq, n))
                    budget -= n
            for seq in self._admit(budget):
                if seq.in_context_phase:
                    n = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
                    batch.prefill.append(ScheduledSequence.of(seq, n))
                else:  # resumed: prompt K/V already in place, feed the first token
                    n = 1
                    batch.decode.append(ScheduledSequence.of(seq, 1))
                budget -= n
            self.kv_cache.prepare_resources(batch.items)
            return batch

    def _admit(self, budget: int) -> list[Sequence]:
        """Move waiting sequences into ``running`` while token budget, ``max_num_seqs`` and KV
        headroom allow. Reserved ones first; the FCFS rest stops at the first that does not fit
        (no overtaking, so a large request is not starved)."""
        admitted: list[Sequence] = []
        if not self.waiting:
            return admitted
        room = self.headroom()
        for seq in sorted(self.waiting, key=lambda s: not s.reserved):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not seq.reserved:
                if seq.need_blocks > room:
                    break
                room -= seq.need_blocks
            self.waiting.remove(seq)
            seq.status = SequenceStatus.PREFILL if seq.in_context_phase else SequenceStatus.DECODE
            self.running.append(seq)
            admitted.append(seq)
            budget -= min(seq.num_prompt_tokens - seq.num_computed_tokens, budget) or 1
        return admitted
