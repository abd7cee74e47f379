"""Per-request engine state: :class:`Sequence` (tokens, KV progress, lifecycle status),
:class:`IncrementalDetokenizer` (text deltas with stop-string hold-back) and
:class:`LiveSequence` (what the engine keeps for each sequence it runs).

The lifecycle itself (the numbered states of :class:`SequenceStatus` and the queues named after
them) is described in :mod:`pdserve.workers.engine.engine`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

from pdserve.protocol import SamplingParams

EngineMode = Literal["prefill", "full", "resume"]


class SequenceStatus(IntEnum):
    """Lifecycle states, numbered as in the engine's module docstring."""

    RESERVED = 1
    WAITING = 2
    PREFILL = 3
    DECODE = 4
    PARKED = 5
    FINISHED = 6


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    ``num_computed_tokens`` counts the tokens whose K/V is in the sequence's KV blocks. The
    context phase feeds ``tokens[num_computed_tokens:]`` in chunks (the prompt; after a
    recompute preemption, or for a migrated choice whose ``output_token_ids`` start with the
    tokens another worker produced, the prompt and those tokens), the generation phase feeds
    ``output_token_ids[-1]`` at position ``num_tokens - 1``. ``need_blocks`` is what the sequence
    may hold at most (prompt + max_tokens - 1 tokens), counted against capacity from admission
    (or :meth:`Engine.reserve`) under the ``guaranteed_no_evict`` policy.

    ``request_id`` is the sequence's own id (its block table's key); ``group_id`` is the client
    request it answers and ``index`` its choice number (``n > 1``: choice ``i`` of request ``r``
    has id ``r`` for ``i == 0``, else ``f"{r}#{i}"``).

    ``block_hashes``: chained hashes of the full blocks of prompt + output known so far
    (:class:`~pdserve.workers.kv.prefix_cache.BlockHasher`, 128-bit ints, one per
    ``tokens_per_block`` tokens), extended lazily by the KV cache manager; the prefix cache
    lookup and registration use them, and they survive preemption. ``num_cached_tokens``: the
    tokens the last admission found in the prefix cache or loaded from a KV cache connector
    tier (not computed; usage's ``cached_tokens``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mode: EngineMode
    need_blocks: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    reserved: bool = False
    num_preemptions: int = 0
    index: int = 0
    group_id: str = ""
    arrival_s: float = field(default_factory=time.monotonic)
    admitted_s: float | None = None  # monotonic: first admission into running
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    spec_backoff: int = 0  # speculative decoding: steps to skip after the next miss
    spec_skip: int = 0  # steps left without proposals (speculative.Backoff)

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_context_phase(self) -> bool:
        """True while more than the last known token's K/V is still to be computed (the prompt,
        or prompt + output after a preemption); False in the generation phase."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def cache_salt(self) -> str | None:
        """The request's cache salt (``sampling.cache_salt``): its blocks hash apart from every
        other salt's (:mod:`pdserve.block_hash`)."""
        return self.sampling.cache_salt

    def token_slice(self, start: int, count: int) -> list[int]:
        """Tokens ``[start, start + count)`` of prompt + output."""
        prompt = self.prompt_token_ids
        if start + count <= len(prompt):
            return prompt[start : start + count]
        out = self.output_token_ids
        head = prompt[start:] if start < len(prompt) else []
        return head + out[max(0, start - len(prompt)) : start + count - len(prompt)]

    @property
    def next_output_position(self) -> int:
        """Output position of the next sampled token (0 = the prefill's token)."""
        return len(self.output_token_ids)


class IncrementalDetokenizer:
    """Output token ids -> text deltas, the way vLLM's incremental detokenizer does it.

    Text is decoded over a sliding window (``prefix_offset``/``read_offset``) so multi-byte
    characters split across tokens come out whole (nothing is emitted while the window ends in
    U+FFFD). Stop strings: the full output text is searched for each stop string; on a match the
    text is cut before it (the stop string is never emitted) and :attr:`stopped` is set. While a
    request runs, the last ``max(len(stop)) - 1`` characters are held back because they could
    still begin a stop string (vLLM's ``stop_buffer_length``); :meth:`delta` with ``final=True``
    releases them.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped: str | None = None

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text

    def append(self, token_id: int) -> None:
        """Add one output token; decodes what became decodable and checks stop strings."""
        if self.stopped is not None:
            return
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._add_text(full[len(prefix) :])

    def _flush_pending(self) -> None:
        """Decode a trailing incomplete character as is (U+FFFD) when the request ends."""
        if self.stopped is not None or self._read_offset == len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        if len(full) > len(prefix):
            self._add_text(full[len(prefix) :])

    def _add_text(self, new: str) -> None:
        start = max(0, len(self.text) - self._holdback)
        self.text += new
        if not self._stop:
            return
        hits = [(self.text.find(s, start), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index]
            self.stopped = stop

    def delta(self, final: bool = False) -> str:
        """Text not emitted yet. Holds back a possible stop-string prefix unless ``final`` or a
        stop string matched (then the text is already cut)."""
        if final:
            self._flush_pending()
        end = len(self.text)
        if not final and self.stopped is None:
            end = max(self.emitted, len(self.text) - self._holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
