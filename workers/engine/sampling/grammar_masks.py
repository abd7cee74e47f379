"""Structured outputs in the engine: one grammar matcher per sequence, token masks per step.

Lifecycle of a constrained request on one engine (the grammar text comes from
:func:`pdserve.grammar.grammar_of`; llguidance does the matching):

    1 PREPARE  :meth:`GrammarCompiler.prepare`, called by the worker off the event loop and off
               the engine step (``asyncio.to_thread``) before the request is queued: builds the
               llguidance tokenizer on first use, the constraint's matcher (with
               :func:`pdserve.grammar.parser_limits`) and its first token mask (where a
               lexer spends its build fuel: up to ~0.1 s that must not stall a batch), on
               the compiler's own thread (:data:`GRAMMAR_STACK_BYTES` of stack); kept in an
               LRU cache by :meth:`~pdserve.protocol.StructuredOutput.key` (a schema is parsed
               once, however many requests carry it), bounded by the bytes the matchers hold
               (:data:`CACHE_BYTES`, measured at compile time)
    2 ADMIT    :meth:`GrammarCompiler.state`: a copy of the cached matcher (microseconds) for
               each sequence; a decode worker resuming a request replays the tokens already
               out (the prefill's first token) through it; every one of ``n`` choices gets
               its own; a preempted sequence keeps its state (recompute does not resample)
    3 STEP     :func:`apply_masks`: each constrained row's logits outside the grammar's next
               tokens become ``-inf`` (the sampler then picks among the rest); after sampling,
               :meth:`GrammarState.consume` advances the matcher. A grammar that fails here (a
               parser limit hit mid-way) raises :class:`GrammarError`: the request's own
               error, a 400 at once (never a worker failure to retry elsewhere)
    4 END      the grammar is complete (:attr:`GrammarState.done`: JSON closed, a choice
               matched, EOS taken) -> ``finish_reason = stop``; ``max_tokens`` first ->
               ``length`` (the text is then a prefix of a valid one)

Thread-safety: :class:`GrammarCompiler` may be called from any thread (one lock around the
cache); a :class:`GrammarState` belongs to its sequence, used on the engine thread only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pdserve.errors import InvalidRequestError
from pdserve.grammar import first_line, grammar_of, matcher_of
from pdserve.protocol import StructuredOutput
from pdserve.workers.engine.omp import thread_stack

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

T = TypeVar("T")

CACHE_SIZE = 256
"""Distinct constraints whose compiled matcher an engine keeps at most (least recently used
out)."""

CACHE_BYTES = 128 << 20
"""Memory the cached matchers may hold together, as measured when each was compiled (a typical
JSON Schema: well under 1 MiB; the worst a constraint within the parser limits reaches: about
20 MiB)."""

MIN_ENTRY_BYTES = 64 << 10
"""What one cached matcher is charged at least (where malloc statistics are unavailable, or
read less than the grammar's text)."""

GRAMMAR_STACK_BYTES = 64 << 20
"""Stack of the threads that compile and mask grammars on a worker (the compiler thread, the
engine's step thread): llguidance recurses once per chained rule or ``$ref``; the router's
checker compiles on 8 MiB, so every constraint that reaches a worker has eight times the room
it was seen to need."""


class GrammarError(InvalidRequestError):
    """A request's structured output failed while decoding (a token broke it, or a parser
    limit was hit mid-way): the request's own error, never retried on another worker."""

    code = "grammar_failed"


class GrammarState:
    """One sequence's position in its grammar (an llguidance matcher it owns)."""

    def __init__(self, matcher: LLMatcher):
        self._m = matcher

    def consume(self, token: int) -> None:
        """Advance over ``token`` (just sampled, or replayed on resume). Raises
        :class:`GrammarError` when the token breaks the grammar (a replayed token, or a
        sampled one after the grammar failed to give a mask: a parser limit hit mid-way); the
        message holds the first line of llguidance's error only (never the grammar's text)."""
        if not self._m.consume_token(token) or self._m.is_error():
            raise GrammarError(
                f"the structured output failed at token {token}: {first_line(self._m.get_error())}"
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
    ``capacity`` / ``capacity_bytes``: the cache's bounds in entries and in measured bytes.

    Compilation runs on the compiler's one thread (:data:`GRAMMAR_STACK_BYTES` of stack), one
    constraint at a time, so its memory can be measured (glibc's malloc statistics, before and
    after: llguidance allocates through malloc).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        capacity: int = CACHE_SIZE,
        capacity_bytes: int = CACHE_BYTES,
    ):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._tok: LLTokenizer | None = None
        self._cache: OrderedDict[str, tuple[LLMatcher, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.compiled = 0  # constraints compiled (cache misses), for tests and metrics
        self.cached_bytes = 0  # what the cached matchers are charged, together

    def _tokenizer(self) -> LLTokenizer:
        if self._tok is None:
            from llguidance.hf import from_tokenizer

            eos = self.eos_token_ids or None
            self._tok = from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=eos)
        return self._tok

    def prepare(self, so: StructuredOutput) -> None:
        """Compile ``so`` into the cache unless it is there (about 0.1 s at most within the
        parser limits, microseconds when cached), its first mask included. Raises
        InvalidRequestError when it does not compile. Blocking: call off the event loop and the
        engine thread."""
        self._template(so)

    def state(self, so: StructuredOutput, replay: Sequence[int] = ()) -> GrammarState:
        """A fresh state for one sequence, advanced over ``replay`` (tokens already out).
        Compiles ``so`` first when :meth:`prepare` was not called. Raises InvalidRequestError
        (does not compile) or GrammarError (``replay`` breaks it)."""
        state = GrammarState(self._template(so).deep_copy())
        for token in replay:
            state.consume(token)
        return state

    def close(self) -> None:
        """Stop the compiler thread (idempotent; a later compile starts a new one)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def _template(self, so: StructuredOutput) -> LLMatcher:
        key = so.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached[0]
        matcher, cost = self._on_compiler_thread(lambda: self._compile(so))
        with self._lock:
            if key not in self._cache:
                self._cache[key] = (matcher, cost)
                self.cached_bytes += cost
                self.compiled += 1
            self._cache.move_to_end(key)
            evicted = []
            while len(self._cache) > 1 and (
                len(self._cache) > self.capacity or self.cached_bytes > self.capacity_bytes
            ):
                _, entry = self._cache.popitem(last=False)
                self.cached_bytes -= entry[1]
                evicted.append(entry)
        if evicted:  # freed outside the lock; malloc keeps freed pages unless asked
            del evicted, entry
            _malloc_trim()
        return matcher

    def _on_compiler_thread(self, work: Callable[[], T]) -> T:
        """``work()`` on the compiler's thread (started on first use with the large stack)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
                with thread_stack(GRAMMAR_STACK_BYTES):  # its one thread starts now
                    self._executor.submit(lambda: None).result()
            executor = self._executor
        return executor.submit(work).result()

    def _compile(self, so: StructuredOutput) -> tuple[LLMatcher, int]:
        before = _malloc_in_use()
        tokenizer = self._tokenizer()
        try:
            grammar = grammar_of(so)
        except Exception as exc:  # ValueError, or the library's own error types: a 400
            raise InvalidRequestError(f"structured output: {exc}") from None
        matcher = matcher_of(tokenizer, grammar, "structured output")  # the lexer built
        after = _malloc_in_use()
        measured = after - before if before is not None and after is not None else 0
        return matcher, max(measured, MIN_ENTRY_BYTES, 4 * len(so.spec))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()
_MALLINFO2: Callable[[], _MallInfo2] | None = getattr(_LIBC, "mallinfo2", None)  # glibc 2.33+
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2  # type: ignore[attr-defined]


def _malloc_trim() -> None:
    """Hand the pages malloc holds free back to the OS (glibc's ``malloc_trim``, every arena):
    an evicted matcher's tens of MiB leave the RSS instead of staying in its thread's arena."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _malloc_in_use() -> int | None:
    """Bytes the process holds through malloc now (glibc's ``mallinfo2``: in-use chunks plus
    mmapped blocks, every arena), or None where unavailable. Other threads' allocations show
    too: a compile's measure is approximate, and never below the floor the cache charges."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


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
