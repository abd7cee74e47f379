"""The engine's request/response contract: :class:`EngineRequest`, :class:`EngineOutput`, the
sink type, the checks a request must pass before it is queued and the conditions that end a
running one (:class:`RequestLimits`).

These types are re-exported by :mod:`pdserve.workers.engine.engine`, which is where callers import them
from (``docs/architecture/workers.md``, "Engine").
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.protocol import (
    ContextRequest,
    FinishReason,
    GenerationRequest,
    ResumedChoice,
    SamplingParams,
    TokenLogprob,
)
from pdserve.workers.engine.sequence import EngineMode, IncrementalDetokenizer, Sequence
from pdserve.workers.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from pdserve.workers.engine.sampling.grammar_masks import GrammarState


@dataclass(frozen=True)
class EngineRequest:
    """A request for ``Engine.add_request``.

    ``mode``: ``prefill`` (context phase + exactly one token, blocks parked), ``full`` (prefill +
    decode here) or ``resume`` (decode after a prefill elsewhere, into blocks from
    ``Engine.reserve``). ``first_token`` is required in (and only in) ``resume`` mode: the token
    the prefill leg sampled at output position 0; it counts against ``max_tokens``.

    ``resume`` (mode ``full`` only; mid-stream migration, protocol 10): the request was running
    on another worker; only the listed choices run here, each continuing after the output
    tokens the client has (recomputed with the prompt, as after a recompute preemption) and
    after the ``text_chars`` characters of its text the client got. ``n > 1`` requests do not
    fork then: every choice to run is listed.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mode: EngineMode = "full"
    first_token: int | None = None
    progress: bool = False  # prefill mode: report each chunk's completed blocks
    resume: tuple[ResumedChoice, ...] | None = None  # full mode: migrated choices

    @classmethod
    def for_leg(cls, req: ContextRequest | GenerationRequest, mode: EngineMode) -> EngineRequest:
        """The one place a worker turns a wire request into an engine request: ``prefill``
        for a :class:`ContextRequest`, ``full`` for a :class:`GenerationRequest` without a
        handle (prefill and decode here; with its ``resume``, a migrated request), ``resume``
        for one whose blocks were pulled (its ``first_token`` is the prefill leg's token)."""
        gen = req if isinstance(req, GenerationRequest) else None
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling=req.sampling,
            mode=mode,
            first_token=gen.first_token if gen is not None and mode == "resume" else None,
            resume=gen.resume if gen is not None and mode == "full" else None,
        )


def progress_output(seq: Sequence, kv: KVCacheManager) -> EngineOutput | None:
    """The progress report of prefill-mode ``seq`` after a step (streamed hand-off): an output
    without tokens listing the blocks whose K/V is complete, or None once the prompt is done
    (its sampled output follows) or before a block is complete."""
    full = seq.num_computed_tokens // kv.tokens_per_block
    if seq.mode != "prefill" or seq.num_computed_tokens >= seq.num_prompt_tokens or not full:
        return None
    return EngineOutput(
        seq.group_id, [], "", [], ready_block_ids=kv.block_table(seq.request_id)[:full]
    )


@dataclass(frozen=True)
class EngineOutput:
    """One step's result for one request (one token, or none on abort/error).

    ``text`` is the detokenized delta since the previous output; it never contains a stop string
    and may hold back a few characters that could still start one (released with the last
    output). ``logprobs`` has one entry per token when the request asked for logprobs.
    ``parked_block_ids`` is set only on a prefill-mode output without ``finish_reason``:
    ownership of those blocks passes to the caller, who must call ``Engine.free_parked``.
    ``ready_block_ids`` (prefill mode with ``EngineRequest.progress``, on an output without
    tokens while the prompt is still being prefilled): the leading blocks whose K/V a chunk
    completed, still the engine's (streamed hand-off).
    ``error`` is set with ``finish_reason == ERROR``; ``error_code`` too when the request itself
    is at fault (``grammar_failed``: its structured output failed), so the router answers 400
    instead of retrying elsewhere. ``index`` is the choice (``n > 1``);
    each choice ends with its own output carrying ``finish_reason``. ``cached_tokens`` (on a
    sequence's first sampled token only): the prompt tokens its prefix cache lookup served.
    ``admitted_s`` (``time.monotonic()``) when the sequence was first admitted into the running
    batch and ``preemptions`` how often it was preempted so far (on sampled outputs; the
    worker's request timeline reads them: queue wait, preemptions).
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None = None
    error: str | None = None
    parked_block_ids: list[int] | None = None
    index: int = 0
    cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output, when asked
    ready_block_ids: list[int] | None = None
    admitted_s: float | None = None
    preemptions: int = 0
    error_code: str | None = None  # with error: the request's own (a 400 code), else None


@dataclass(frozen=True)
class Reservation:
    """Blocks ``Engine.reserve`` set aside for a transferred prompt.

    ``block_ids``: the prompt's whole block table, in token order (``ceil(prompt / tpb)`` ids of
    this engine's pool). ``cached_blocks``: how many leading ones already hold the prompt's K/V
    (a prefix cache hit, ``reuse_prefix=True``): a KV pull fills only ``block_ids[cached_blocks:]``
    (delta transfer). The caller owns the reservation until it submits the resume request or
    calls ``Engine.unreserve``.
    """

    block_ids: list[int]
    cached_blocks: int = 0

    @property
    def missing_block_ids(self) -> list[int]:
        """The blocks a pull must fill: ``block_ids[cached_blocks:]``."""
        return self.block_ids[self.cached_blocks :]


Sink = Callable[[EngineOutput], None]
"""Receives a request's outputs, on the engine thread; must not block."""


@dataclass(eq=False)
class LiveSequence:
    """A sequence the engine runs, with where its outputs go and its output state: ``grammar``
    (structured output: the sequence's matcher), ``prompt_lps`` (prompt logprobs, by position,
    once computed), ``progress`` (prefill mode: report completed blocks per chunk), ``fork``
    (choice 0 of an ``n > 1`` full-mode request: fork choices ``1..n-1`` after its first
    token; never for a migrated request, whose choices are all listed)."""

    seq: Sequence
    sink: Sink
    detok: IncrementalDetokenizer
    grammar: GrammarState | None = None
    prompt_lps: list[TokenLogprob | None] | None = None
    progress: bool = False
    fork: bool = False


@dataclass(frozen=True)
class RequestLimits:
    """What a request must satisfy to be queued on an engine (:meth:`check`), and when a
    running sequence stops (:meth:`stop_reason`)."""

    vocab_size: int
    max_model_len: int
    kv_cache: KVCacheManager
    policy: str = "max_utilization"

    def need_blocks(self, req: EngineRequest) -> int:
        """The most KV blocks a sequence of ``req`` (each choice) may hold: its prompt and
        ``max_tokens - 1`` output tokens (prefill mode: the prompt; one token is sampled)."""
        max_new = 1 if req.mode == "prefill" else req.sampling.max_tokens
        return self.kv_cache.get_needed_resource_to_completion(len(req.prompt_token_ids), max_new)

    def stop_reason(
        self, live: LiveSequence, token: int, eos_token_ids: Collection[int]
    ) -> FinishReason | None:
        """Why ``live``'s sequence ends with ``token``, its newest output token (already in its
        output, detokenizer and grammar), or None: STOP for a stop token, a complete grammar,
        EOS (one of ``eos_token_ids``, the model's; unless ``ignore_eos``) or a stop string in
        the text; LENGTH at ``max_tokens``, at ``max_model_len``, or when the next token's K/V
        would not fit the whole pool."""
        seq, kv = live.seq, self.kv_cache
        if token in seq.sampling.stop_token_ids:
            return FinishReason.STOP
        if live.grammar is not None and live.grammar.done:
            return FinishReason.STOP
        if token in eos_token_ids and not seq.sampling.ignore_eos:
            return FinishReason.STOP
        if live.detok.stopped is not None:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.sampling.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        if kv.blocks_for_tokens(seq.num_tokens) > kv.num_blocks:
            return FinishReason.LENGTH
        return None

    def check(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        mode: str,
        first_token: int | None,
        resume: tuple[ResumedChoice, ...] | None = None,
    ) -> None:
        """Raise :class:`InvalidRequestError` for a malformed request (unknown mode, empty
        prompt, token ids outside the vocabulary, prompt + ``max_tokens`` beyond
        ``max_model_len``, ``first_token`` missing in resume mode or present elsewhere, a
        ``logit_bias`` or ``stop_token_ids`` id outside the vocabulary; ``resume`` outside
        mode ``full``, naming no choice, a choice twice or one ``>= n``, or with a choice that
        has ``max_tokens`` tokens already or tokens outside the vocabulary) and
        :class:`CapacityError` for one that could never be admitted: its prompt (plus the
        first token it feeds) needs more KV blocks than the whole pool, or, under
        ``guaranteed_no_evict``, its part on this engine (the prompt alone in prefill mode, the
        whole completion otherwise) does."""
        vocab, limit = self.vocab_size, self.max_model_len
        if mode not in ("prefill", "full", "resume"):
            raise InvalidRequestError(f"unknown engine mode {mode!r}")
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if any(t < 0 or t >= vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        if len(prompt) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; max_model_len is {limit}", param="prompt"
            )
        if len(prompt) + sampling.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                f"max_model_len {limit}",
                param="max_tokens",
            )
        if (mode == "resume") != (first_token is not None):
            raise InvalidRequestError("first_token is required in resume mode and only there")
        if first_token is not None and not 0 <= first_token < vocab:
            raise InvalidRequestError(f"first_token must lie in [0, {vocab})")
        if resume is not None:
            _check_resume(resume, sampling, mode, vocab)
        for name, ids in (
            ("logit_bias", [t for t, _ in sampling.logit_bias]),
            ("stop_token_ids", sampling.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"{name} token ids must lie in [0, {vocab}); got {bad[:5]}"
                )
        if mode == "resume" and sampling.max_tokens < 2 and sampling.n == 1:
            raise InvalidRequestError("resume needs max_tokens >= 2 (the first token counts)")
        total = self.kv_cache.get_max_resource_count()
        if self.policy == "guaranteed_no_evict":
            max_new = 1 if mode == "prefill" else sampling.max_tokens  # this engine's share
            what = "to complete"
        else:
            max_new, what = 2, "for its prompt"
        need = self.kv_cache.get_needed_resource_to_completion(len(prompt), max_new)
        if need > total:
            raise CapacityError(
                f"request {request_id} needs {need} KV blocks {what}; the pool has {total}"
            )


def _check_resume(
    resume: tuple[ResumedChoice, ...], sampling: SamplingParams, mode: str, vocab: int
) -> None:
    """The part of :meth:`RequestLimits.check` for a migrated request's choices (the wire
    model checks the same, but an engine request need not come from the wire)."""
    if mode != "full":
        raise InvalidRequestError("resumed choices (migration) run in full mode only")
    indices = [c.index for c in resume]
    if not indices or len(set(indices)) != len(indices) or max(indices) >= sampling.n:
        raise InvalidRequestError(f"resume names choices {indices}; need distinct ones < n")
    if any(len(c.token_ids) >= sampling.max_tokens for c in resume):
        raise InvalidRequestError("a resumed choice has max_tokens tokens already")
    if any(not 0 <= t < vocab for c in resume for t in c.token_ids):
        raise InvalidRequestError(f"resumed token ids must lie in [0, {vocab})")


def choice_id(request_id: str, index: int) -> str:
    """The sequence id of choice ``index`` of ``request_id`` (its block table's key)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: seed ``seed + index`` (vLLM's parallel sampling), so seeded
    choices are reproducible and differ from each other."""
    if sampling.seed is None or index == 0:
        return sampling
    return sampling.model_copy(update={"seed": sampling.seed + index})
