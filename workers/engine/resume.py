"""Mid-stream migration (protocol 10, ``EngineRequest.resume``): the sequences of a request that
another worker had started and could not finish (it died, or is shutting down).

Each listed choice becomes a mode ``full`` :class:`Sequence` whose ``output_token_ids`` are the
tokens the client already has and whose ``num_computed_tokens`` is 0: exactly a sequence after a
recompute preemption (:mod:`pdserve.workers.engine.scheduler`). Its admission prefills the
prompt plus those tokens (the prefix cache serves what it holds, e.g. the prompt the choices
share), and its next sampled token is output position ``len(token_ids)``, drawn with choice
``i``'s seed ``seed + i`` (position-keyed sampling, :mod:`pdserve.workers.engine.sampling.sampler`): a
seeded or greedy choice continues as it would have on the first worker. The penalties,
``min_tokens``, ``max_tokens``, the grammar (replayed over the tokens) and the stop strings see
those tokens as output. The text resumes after the ``text_chars`` characters the client got:
the tokens are replayed through a fresh :class:`IncrementalDetokenizer` (the same decode
windows as the first worker's), whose ``emitted`` mark is then set there, so what the first
worker held back (a possible stop-string prefix, an incomplete UTF-8 character) comes out here
and nothing is repeated.

Choices not listed finished on the first worker and do not run; the listed ones never fork.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from pdserve.protocol import FinishReason, SamplingParams
from pdserve.workers.engine.requests import (
    EngineRequest,
    LiveSequence,
    RequestLimits,
    Sink,
    choice_id,
    choice_sampling,
)
from pdserve.workers.engine.sampling.grammar_masks import GrammarState
from pdserve.workers.engine.sequence import IncrementalDetokenizer, Sequence

GrammarFactory = Callable[[SamplingParams, tuple[int, ...]], GrammarState | None]
"""``(sampling, replayed tokens) -> state`` (None without structured output); raises
InvalidRequestError when the tokens break the grammar."""


def resumed_choices(
    req: EngineRequest, limits: RequestLimits, tokenizer: Any, grammar: GrammarFactory, sink: Sink
) -> list[LiveSequence]:
    """One waiting sequence per choice of ``req.resume``, its detokenizer and grammar replayed
    over the choice's tokens (see the module docstring). Raises InvalidRequestError when the
    tokens break the request's grammar."""
    assert req.resume is not None
    out, need_blocks = [], limits.need_blocks(req)
    for choice in req.resume:
        sampling = choice_sampling(req.sampling, choice.index)
        tokens = list(choice.token_ids)
        seq = Sequence(
            choice_id(req.request_id, choice.index),
            list(req.prompt_token_ids),
            sampling,
            "full",
            need_blocks,
            output_token_ids=tokens,
            index=choice.index,
            group_id=req.request_id,
        )
        detok = IncrementalDetokenizer(tokenizer, sampling.stop)
        for token in tokens:
            if token not in sampling.stop_token_ids:  # as Engine._append_token feeds it
                detok.append(token)
        detok.emitted = min(choice.text_chars, len(detok.text))
        out.append(LiveSequence(seq, sink, detok, grammar(sampling, tuple(tokens))))
    return out


def replay_stop(
    live: LiveSequence, limits: RequestLimits, eos_token_ids: Collection[int]
) -> FinishReason | None:
    """Why a resumed choice is finished before it runs, or None (the usual case: the first
    worker would have stopped it). Its last replayed token is checked as a sampled one is
    (:meth:`RequestLimits.stop_reason`: stop token, EOS, stop string, grammar, lengths); an
    earlier stop token or EOS (without ``ignore_eos``) stops it too."""
    seq, eos = live.seq, eos_token_ids
    tokens, sampling = seq.output_token_ids, seq.sampling
    if not tokens:
        return None
    for token in tokens[:-1]:
        if token in sampling.stop_token_ids or (token in eos and not sampling.ignore_eos):
            return FinishReason.STOP
    return limits.stop_reason(live, tokens[-1], eos)
