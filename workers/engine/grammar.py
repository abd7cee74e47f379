"""Structured outputs in the engine: one grammar matcher per sequence, token masks per step.

Lifecycle of a constrained request on one engine (the grammar text comes from
:func:`pdserve.grammar.grammar_of`; llguidance does the matching):

    1 PREPARE  :meth:`GrammarCompiler.prepare`, called by the worker off the event loop and off
               the engine step (``asyncio.to_thread``) before the request is queued: builds the
               llguidance tokenizer on first use and the constraint's matcher, kept in an LRU
               cache by :meth:`~pdserve.protocol.StructuredOutput.key` (a schema is parsed
               once, however many requests carry it)
    2 ADMIT    :meth:`GrammarCompiler.state`: a copy of the cached matcher (microseconds) for
               each sequence; a decode worker resuming a request replays the tokens already
               out (the prefill's first token) through it; every one of ``n`` choices gets
               its own; a preempted sequence keeps its state (recompute does not resample)
    3 STEP     :func:`apply_masks`: each constrained row's logits outside the grammar's next
               tokens become ``-inf`` (the sampler then picks among the rest); after sampling,
               :meth:`GrammarState.consume` advances the matcher
    4 END      the grammar is complete (:attr:`GrammarState.done`: JSON closed, a choice
               matched, EOS taken) -> ``finish_reason = stop``; ``max_tokens`` first ->
               ``length`` (the text is then a prefix of a valid one)

Thread-safety: :class:`GrammarCompiler` may be called from any thread (one lock around the
cache); a :class:`GrammarState` belongs to its sequence, used on the engine thread only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pdserve.errors import InvalidRequestError
from pdserve.grammar import grammar_of
from pdserve.protocol import StructuredOutput

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

CACHE_SIZE = 256
"""Distinct constraints whose compiled matcher an engine keeps (least recently used out)."""


class GrammarState:
    """One sequence's position in its grammar (an llguidance matcher it owns)."""

    def __init__(self, matcher: LLMatcher):
        self._m = matcher

    def consume(self, token: int) -> None:
        """Advance over ``token`` (just sampled, or replayed on resume). Raises
        :class:`InvalidRequestError` when the token breaks the grammar (only a replayed token
        can: a sampled one was chosen from the mask)."""
        if not self._m.consume_token(token) or self._m.is_error():
            raise InvalidRequestError(
                f"token {token} does not fit the request's structured output: "
                f"{self._m.get_error()[:200]}"
            )

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (or ended at EOS)."""
        return bool(self._m.is_stopped())

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next allowed tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of
        word ``t // 32`` set when token ``t`` is allowed)."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)


class GrammarCompiler:
    """Compiles an engine's constraints (llguidance matchers over ``tokenizer``'s vocabulary)
    and hands out per-sequence states.

    ``tokenizer``: the model's Hugging Face fast tokenizer; the llguidance view of it (about
    0.3 s for a 49k vocabulary) is built on the first constrained request. ``vocab_size``: the
    width of the model's logits (may exceed the tokenizer's; the extra entries are masked).
    ``eos_token_ids``: the tokens that end a choice (the grammar allows them once complete).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        capacity: int = CACHE_SIZE,
    ):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.capacity = capacity
        self._tok: LLTokenizer | None = None
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # constraints compiled (cache misses), for tests and metrics

    def _tokenizer(self) -> LLTokenizer:
        if self._tok is None:
            from llguidance.hf import from_tokenizer

            eos = self.eos_token_ids or None
            self._tok = from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=eos)
        return self._tok

    def prepare(self, so: StructuredOutput) -> None:
        """Compile ``so`` into the cache unless it is there (seconds at most for a huge
        grammar, microseconds when cached). Raises InvalidRequestError when it does not
        compile. Call off the event loop and the engine thread."""
        self._template(so)

    def state(self, so: StructuredOutput, replay: Sequence[int] = ()) -> GrammarState:
        """A fresh state for one sequence, advanced over ``replay`` (tokens already out).
        Compiles ``so`` first when :meth:`prepare` was not called. Raises InvalidRequestError
        (does not compile, or ``replay`` breaks it)."""
        state = GrammarState(self._template(so).deep_copy())
        for token in replay:
            state.consume(token)
        return state

    def _template(self, so: StructuredOutput) -> LLMatcher:
        key = so.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            tokenizer = self._tokenizer()
        from llguidance import LLMatcher

        try:
            grammar = grammar_of(so)
        except Exception as exc:  # ValueError, or the library's own error types: a 400
            raise InvalidRequestError(f"structured output: {exc}") from None
        matcher = LLMatcher(tokenizer, grammar, log_level=0)  # parses; GIL released
        if matcher.is_error():
            raise InvalidRequestError(
                f"structured output does not compile: {matcher.get_error()[:300]}"
            )
        with self._lock:
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            self.compiled += 1
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return matcher


def apply_masks(logits: torch.Tensor, states: Sequence[tuple[int, GrammarState]]) -> None:
    """Mask, in place, row ``i`` of ``logits`` (``[N, V]`` float32, CPU) to the next tokens
    its grammar allows, for each ``(i, state)``; entries past the grammar's vocabulary are
    masked too. A row the grammar leaves no token for keeps only ``-inf``: the sampler then
    picks token 0, and the state's next :meth:`~GrammarState.consume` fails."""
    if not states:
        return
    from llguidance.torch import allocate_token_bitmask, apply_token_bitmask_inplace

    rows = [i for i, _ in states]
    vocab = logits.shape[-1]
    bitmask = allocate_token_bitmask(len(states), vocab)
    for r, (_, state) in enumerate(states):
        state.fill_mask(bitmask, r)
    sub = logits[rows]
    apply_token_bitmask_inplace(sub, bitmask)
    logits[rows] = sub
