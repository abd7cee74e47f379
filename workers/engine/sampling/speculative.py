"""Speculative decoding without a draft model: n-gram (prompt lookup) proposals, verified in one
forward.

Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method, SGLang's n-gram speculation):
when a sequence's last ``n`` tokens (``prompt_lookup_max >= n >= prompt_lookup_min``, longest
first) occurred earlier in its prompt or output, the tokens that followed that earlier
occurrence are proposed as the next ones. Summaries, edits, code changes and retrieval answers
copy long spans of their prompt, so proposals are often right and several tokens come out of
one forward.

Verification. A generation-phase sequence with drafts ``d1..dk`` feeds its last token and the
drafts (``k + 1`` query rows, a continued chunk to the paged attention) and every row's logits
are kept. Row ``j`` is sampled exactly as plain decoding would sample output position
``next + j`` (the same processing, the same position-keyed seed); the sampled tokens ``t0..tk``
are accepted up to and including the first ``tj`` that differs from ``d(j+1)`` (all ``k + 1``
when every draft matched)::

    fed:      last  d1   d2   d3        drafts d1 d2 d3
    sampled:  t0    t1   t2   t3        t0 == d1, t1 == d2, t2 != d3
    emitted:  t0    t1   t2             3 tokens from one forward; t3 is dropped

Each emitted ``tj`` was sampled from the target distribution given a prefix that is exactly the
emitted tokens before it (the drafts it was conditioned on matched them), so the output is
plain decoding's: identical under greedy and, with a seed, identical draws (the sampler keys
its noise by output position). This is the standard rejection rule (Leviathan et al. 2023;
Chen et al. 2023) for a deterministic proposal: accept ``d`` with probability ``p(d)`` and
otherwise sample from ``p`` without ``d``, which is the same as sampling ``t ~ p`` and keeping
``d`` when ``t == d``.

Back-off: a sequence whose drafts were all rejected gets no proposals for the next 1, 2, 4, ...
(at most :data:`MAX_BACKOFF`) steps, doubling with each further miss and reset by any accepted
draft, so text with nothing to copy (where short n-grams still match by chance) pays for few
verifications, while a sequence that copies keeps its drafts.

What is not speculated: requests whose logits processing reads the output so far (penalties,
``min_tokens``, ``logit_bias``: row ``j`` would need the drafts as history), structured
outputs (the grammar would have to advance over unverified tokens), prefill-only legs, and
steps with more than ``speculative_max_batch`` generation-phase sequences (the extra query rows
cost compute a full batch does not have to spare; vLLM's ``disable_by_batch_size``).

KV of rejected drafts: their rows were written into the sequence's blocks past its verified
length; they are never read (attention reads positions below the context length) and the next
step overwrites them. Blocks are registered in the prefix cache only up to the verified length.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pdserve.protocol import SamplingParams

_ITEM = array("i").itemsize
T = TypeVar("T")


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup proposals (module docstring).

    ``num_tokens``: drafts per step at most (``k``); ``max_n`` / ``min_n``: the longest and
    shortest suffix n-gram looked up (longest first; the most recent earlier occurrence wins).
    Stateless and thread-safe. Cost per call: one pass over the sequence's token ids in C
    (``bytes.rfind``) per n tried, i.e. O(context) bytes, ~10 us per 1k tokens."""

    num_tokens: int
    max_n: int = 4
    min_n: int = 2

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"speculative decoding needs num_tokens >= 1 and 1 <= min_n <= max_n; got "
                f"{self.num_tokens}, {self.min_n}, {self.max_n}"
            )

    def propose(self, tokens: Seq[int], limit: int | None = None) -> list[int]:
        """Drafts to follow ``tokens`` (a sequence's prompt + output ids): at most
        ``min(num_tokens, limit)``, possibly none."""
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        total = len(tokens)
        if k <= 0 or total <= self.min_n:
            return []
        data = array("i", tokens).tobytes()
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            pattern = data[-n * _ITEM :]
            # an earlier occurrence: it must end before the suffix itself does
            end = len(data) - _ITEM
            while True:
                found = data.rfind(pattern, 0, end)
                if found < 0:
                    break
                if found % _ITEM == 0:  # aligned on a token, not inside one
                    start = found // _ITEM + n
                    return list(tokens[start : start + k])
                end = found + len(pattern) - 1
        return []


MAX_BACKOFF = 32
"""The most steps a sequence goes without proposals after consecutive misses."""


class _Backoff(Protocol):
    spec_backoff: int
    spec_skip: int


class _Verified(_Backoff, Protocol):
    num_computed_tokens: int


def take_turn(seq: _Backoff) -> bool:
    """Whether ``seq`` (a :class:`~pdserve.workers.engine.sequence.Sequence`) may get drafts
    this step; counts down a back-off (module docstring)."""
    if seq.spec_skip > 0:
        seq.spec_skip -= 1
        return False
    return True


def record_outcome(seq: _Backoff, matched: int) -> None:
    """After ``seq``'s drafts were verified: ``matched`` of them were right. A full miss
    starts or doubles the back-off; any match clears it."""
    if matched:
        seq.spec_backoff = 0
    else:
        seq.spec_backoff = min(MAX_BACKOFF, max(1, 2 * seq.spec_backoff))
        seq.spec_skip = seq.spec_backoff


def speculates(sampling: SamplingParams) -> bool:
    """Whether a request's generation phase may be speculated (module docstring): no logits
    processing that reads the output, no structured output."""
    return not sampling.processes_logits and sampling.structured is None


def accepted(draft: Seq[int], sampled: Seq[int]) -> int:
    """How many of ``sampled`` (``len(draft) + 1`` tokens, row ``j`` conditioned on
    ``draft[:j]``) are emitted: up to and including the first that differs from its draft."""
    assert len(sampled) == len(draft) + 1, "one sampled token per fed row"
    for j, d in enumerate(draft):
        if sampled[j] != d:
            return j + 1
    return len(sampled)


@dataclass
class SpecDecodeStats:
    """Counters since start (the engine thread writes, any thread reads): ``drafts`` (sequence
    steps that verified drafts), ``draft_tokens`` (drafts proposed and fed),
    ``accepted_tokens`` (drafts that matched). Acceptance rate: ``accepted / draft_tokens``;
    tokens per verifying step: ``1 + accepted / drafts``. Exported as
    ``pdserve_spec_decode_*`` (vLLM's ``spec_decode_num_*`` counters)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def record(self, proposed: int, matched: int) -> None:
        """One sequence step verified ``proposed`` drafts, of which ``matched`` were right."""
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += matched

    def verify(
        self, seq: _Verified, draft: Seq[int], tokens: list[int], lps: list[T]
    ) -> tuple[list[int], list[T]]:
        """After a verifying step of ``seq`` (a
        :class:`~pdserve.workers.engine.sequence.Sequence`): ``tokens`` / ``lps`` sampled for
        its ``len(draft) + 1`` rows, cut to those emitted (:func:`accepted`). Counts them here,
        updates the sequence's back-off (:func:`record_outcome`) and adds the accepted drafts'
        K/V to its ``num_computed_tokens``."""
        n = accepted(draft, tokens)
        self.record(len(draft), n - 1)
        record_outcome(seq, n - 1)
        seq.num_computed_tokens += n - 1
        return tokens[:n], lps[:n]
