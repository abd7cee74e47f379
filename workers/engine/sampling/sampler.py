"""Token sampler: logits processing, greedy, temperature, min-p, top-k, top-p, per-request
seeds, logprobs.

Logits processing comes first, in vLLM's order, for the rows that ask for it
(:attr:`~pdserve.protocol.SamplingParams.processes_logits`): the ``min_tokens`` mask of EOS and
``stop_token_ids``, ``logit_bias``, the repetition penalty (CTRL, Keskar et al. 2019: over the
prompt and the output), then OpenAI's frequency and presence penalties (over the output). They
read only the request's own tokens (:class:`TokenHistory`), so they give the same logits on a
prefill worker (output position 0), a decode worker, or one engine doing both.

Seeded sampling is position-keyed: the random draw for output position ``i`` of a request with
seed ``s`` comes from a generator seeded with ``mix(s, i)``, never from a stream shared across
steps. A prefill worker sampling position 0 and a decode worker sampling positions >= 1 thus
produce the same tokens as one engine doing both, and batching never changes a request's draws.

Sampling uses the exponential-race form (as vLLM's sampler): ``argmax(probs / q)`` with
``q ~ Exp(1)`` i.i.d. per vocabulary entry picks token ``t`` with probability ``probs[t]``
exactly, and needs one noise tensor per row rather than a CDF search.

Every value :class:`~pdserve.protocol.SamplingParams` accepts keeps the logits finite: a
temperature below :data:`~pdserve.protocol.GREEDY_TEMPERATURE` is greedy (no division), and
the penalties and biases are bounded so that processing then temperature stay far inside float32
(no ``inf``, so no NaN from the softmax).

Structured outputs: a constrained row's logits outside its grammar's next tokens are ``-inf``
after processing (:mod:`pdserve.workers.engine.sampling.grammar_masks`), so greedy and sampled picks alike stay
inside the grammar.

Logprobs are ``log_softmax`` of the raw logits (before processing, temperature, min-p, top-k and
top-p), i.e. of the model's own distribution, as the OpenAI API reports them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.protocol import SamplingParams, TokenLogprob
from pdserve.workers.engine.sampling.grammar_masks import GrammarState, apply_masks


def position_seed(seed: int, position: int) -> int:
    """Seed of the generator that draws output position ``position`` of a request seeded with
    ``seed`` (a 63-bit hash of both, so nearby seeds and positions give unrelated streams)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class TokenHistory(Protocol):
    """A row's tokens so far (a :class:`~pdserve.workers.engine.sequence.Sequence` is one):
    the prompt, and the output including the prefill leg's first token on a decode worker."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class SampleResult:
    """One entry per logits row: the sampled token and, when the request asked for logprobs
    (``logprobs`` or ``top_logprobs > 0``), its :class:`TokenLogprob`."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Samples one token per row of a logits batch.

    ``seed`` seeds the generator used for requests without their own seed (None: from OS
    entropy). ``eos_token_ids``: the model's end tokens, masked (with each request's
    ``stop_token_ids``) until its ``min_tokens`` are out. Not thread-safe (the unseeded
    generator is shared): call from the engine thread.
    """

    def __init__(self, seed: int | None = None, eos_token_ids: Iterable[int] = ()):
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self._rng = torch.Generator(device="cpu")
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        history: Sequence[TokenHistory] | None = None,
        grammars: Sequence[GrammarState | None] | None = None,
    ) -> SampleResult:
        """Sample from ``logits`` (``[N, vocab]``, any float dtype, any device; computed on CPU in
        float32) for ``N`` requests with settings ``params[i]`` at output positions
        ``positions[i]``; ``history[i]`` is row ``i``'s tokens so far, needed (ValueError
        otherwise) when a row's settings process the logits; ``grammars[i]``, when set, limits
        row ``i`` to the tokens its structured output allows next (the state is read, not
        advanced: the caller consumes the sampled token)."""
        n = logits.shape[0]
        assert len(params) == n and len(positions) == n, "one SamplingParams per logits row"
        greedy = [i for i, p in enumerate(params) if p.greedy]
        processed = [i for i, p in enumerate(params) if p.processes_logits]
        constrained = [(i, g) for i, g in enumerate(grammars or ()) if g is not None]
        if (
            len(greedy) == n
            and not processed
            and not constrained
            and not any(p.logprobs or p.top_logprobs > 0 for p in params)
        ):
            # all greedy, no logprobs: argmax where the logits are (first maximum on ties, as
            # on CPU) and move N token ids, not [N, vocab] floats, to the host
            return SampleResult(logits.float().argmax(dim=-1).tolist(), [None] * n)
        # CPU: the per-request generators are CPU generators (and [N, vocab] is small to move)
        raw = logits.float().cpu()
        logits = self._processed(raw, params, processed, history) if processed else raw
        if constrained:
            logits = self._constrained(raw, logits, constrained)
        tokens = torch.empty(n, dtype=torch.long)
        greedy_set = set(greedy)
        sampled = [i for i in range(n) if i not in greedy_set]
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        if sampled:
            probs = self._filtered_probs(logits[sampled], [params[i] for i in sampled])
            noise = torch.empty_like(probs)
            for row, i in enumerate(sampled):
                noise[row].exponential_(generator=self._generator(params[i], positions[i]))
            tokens[sampled] = (probs / noise).argmax(dim=-1)
        token_list: list[int] = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw, params, token_list))

    @staticmethod
    def _constrained(
        raw: torch.Tensor, logits: torch.Tensor, constrained: Sequence[tuple[int, GrammarState]]
    ) -> torch.Tensor:
        """``logits`` with each constrained row masked to its grammar. A row the processing left
        no allowed token (``min_tokens`` masking the EOS a complete grammar needs) falls back
        to its raw logits under the mask: the grammar wins."""
        x = logits.clone() if logits is raw else logits
        apply_masks(x, constrained)
        for i, state in constrained:
            if not torch.isfinite(x[i]).any():
                row = raw[i : i + 1].clone()
                apply_masks(row, [(0, state)])
                x[i] = row[0]
        return x

    def _processed(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        rows: Sequence[int],
        history: Sequence[TokenHistory] | None,
    ) -> torch.Tensor:
        """A copy of ``logits`` (``[N, V]`` float32, CPU) with rows ``rows`` processed (module
        docstring). Cost per row: O(V + prompt + output tokens)."""
        if history is None or len(history) != logits.shape[0]:
            raise ValueError("penalties, logit_bias and min_tokens need each row's token history")
        x = logits.clone()
        vocab = x.shape[-1]
        for i in rows:
            p, row = params[i], x[i]
            output = history[i].output_token_ids
            if len(output) < p.min_tokens:
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
                row[banned] = float("-inf")
            pairs = [(t, b) for t, b in p.logit_bias if 0 <= t < vocab]
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
                row.index_add_(0, ids, torch.tensor([b for _, b in pairs], dtype=row.dtype))
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool)
                for ids_seen in (history[i].prompt_token_ids, output):
                    if ids_seen:
                        seen[torch.tensor(ids_seen, dtype=torch.long).clamp_(0, vocab - 1)] = True
                penalized = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row.copy_(torch.where(seen, penalized, row))
            if (p.frequency_penalty or p.presence_penalty) and output:
                out = torch.tensor(output, dtype=torch.long).clamp_(0, vocab - 1)
                counts = torch.bincount(out, minlength=vocab).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                    row.dtype
                )
        return x

    def _generator(self, p: SamplingParams, position: int) -> torch.Generator:
        if p.seed is None:
            return self._rng
        gen = torch.Generator(device="cpu")
        gen.manual_seed(position_seed(p.seed, position))
        return gen

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Temperature, then min-p, top-k, then top-p (nucleus) masking; returns probabilities
        ``[M, V]`` with masked entries exactly 0. At least one token (the most likely) always
        survives."""
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        x = logits / temps.to(logits.device).unsqueeze(1)
        vocab = x.shape[-1]
        min_ps = [p.min_p for p in params]
        if max(min_ps) > 0.0:
            # drop tokens whose probability is below min_p x the row's top probability, i.e.
            # whose logit is below the top logit + log(min_p)
            top = x.max(dim=-1, keepdim=True).values
            floor = torch.tensor(min_ps, dtype=x.dtype).unsqueeze(1).log()
            x = x.masked_fill(x < top + floor, float("-inf"))
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if min(ks) < vocab:
            kmax = max(ks)
            top_vals = x.topk(kmax, dim=-1).values
            k_index = torch.tensor([k - 1 for k in ks], device=x.device).unsqueeze(1)
            threshold = top_vals.gather(1, k_index)
            no_k = torch.tensor([k == vocab for k in ks], device=x.device).unsqueeze(1)
            x = x.masked_fill((x < threshold) & ~no_k, float("-inf"))
        top_ps = [p.top_p for p in params]
        if min(top_ps) < 1.0:
            sorted_x, order = x.sort(dim=-1, descending=True)
            sorted_probs = sorted_x.softmax(dim=-1)
            # mass strictly before each token; keep a token while that mass is below top_p
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            p_col = torch.tensor(top_ps, dtype=x.dtype, device=x.device).unsqueeze(1)
            drop_sorted = before >= p_col
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        return x.softmax(dim=-1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: Sequence[SamplingParams], tokens: list[int]
    ) -> list[TokenLogprob | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs > 0]
        out: list[TokenLogprob | None] = [None] * len(params)
        if not rows:
            return out
        lp = torch.log_softmax(logits[rows], dim=-1)
        chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device))
        chosen_list = chosen.squeeze(1).tolist()
        kmax = max(params[i].top_logprobs for i in rows)
        top_vals, top_ids = lp.topk(kmax, dim=-1) if kmax else (None, None)
        for row, i in enumerate(rows):
            top: tuple[tuple[int, float], ...] = ()
            k = params[i].top_logprobs
            if k and top_vals is not None and top_ids is not None:
                ids = top_ids[row, :k].tolist()
                vals = top_vals[row, :k].tolist()
                top = tuple(zip(ids, vals, strict=True))
            out[i] = TokenLogprob(token_id=tokens[i], logprob=chosen_list[row], top=top)
        return out


class PromptChunk(Protocol):
    """A prefill chunk (:class:`~pdserve.workers.engine.scheduler.ScheduledSequence`)."""

    @property
    def seq(self) -> Any: ...

    @property
    def start_position(self) -> int: ...

    @property
    def num_new_tokens(self) -> int: ...


def record_prompt_logprobs(
    store: list[TokenLogprob | None] | None, chunk: PromptChunk, logits: torch.Tensor
) -> list[TokenLogprob | None]:
    """``store`` (one entry per prompt token, None until known; the first token's stays None)
    with the entries ``chunk``'s positions predict filled in, from ``logits`` (one row per
    position it fed). A recomputed chunk writes the same entries again."""
    seq = chunk.seq
    prompt, start = seq.prompt_token_ids, chunk.start_position
    out: list[TokenLogprob | None] = store if store is not None else [None] * len(prompt)
    targets = prompt[start + 1 : start + 1 + chunk.num_new_tokens]  # within the prompt only
    if targets:
        top = seq.sampling.prompt_logprobs or 0
        found = prompt_logprobs(logits[: len(targets)], targets, top)
        out[start + 1 : start + 1 + len(found)] = found
    return out


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """The logprob of each of ``targets`` (the prompt tokens after the positions whose logits
    are the rows of ``logits``, ``[len(targets), vocab]``), of the raw distribution, with its
    ``top`` most likely alternatives (vLLM's prompt logprobs)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1))
    values = chosen.squeeze(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top:
        vals, ids = lp.topk(top, dim=-1)
        tops = [
            tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)
        ]
    return [
        TokenLogprob(token_id=t, logprob=v, top=k)
        for t, v, k in zip(targets, values, tops, strict=True)
    ]
