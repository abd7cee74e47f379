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
``q ~ Exp(1)`` i.i.d. per candidate token picks token ``t`` with probability ``probs[t]``
exactly, and needs one noise draw per candidate rather than a CDF search.

Min-p, top-k and top-p each keep the tokens whose (tempered) logit is at least a per-row cut-off
(:meth:`Sampler._cutoffs`), so a row's candidates are ``x >= cut`` and the race runs over those
only, in token-id order. A row's nucleus is found from its ``topk`` values, widened 64, 1024,
16384 then the whole vocabulary until the nucleus ends inside them, never by sorting the whole
vocabulary: at the chat defaults (temperature 0.2, top-p 0.9) the nucleus is a few tokens, and
32 rows with SmolLM2's defaults (repetition penalty included) sample in 15 ms where the sort
and whole-vocabulary race took 172 (49,152 tokens, Intel Xeon, 1 thread; docs/benchmarks.md). Tokens tied with the nucleus' last logit are all kept, so the
candidates depend on the logit values alone, not on a sort's order among ties; rows without
min-p, top-k or top-p race over the whole vocabulary. Each row's cut-off and draws depend on
that row alone.

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

_FIRST_WIDTH = 64
"""Candidates a row's first nucleus search looks at (``topk`` width)."""
_WIDEN = 16
"""Factor the search widens by when a row's nucleus runs past its candidates."""
_EXP_FLOOR = -80.0
"""Arguments of ``exp`` are clamped here (``exp(-80)`` ~ 1.8e-35, a normal float32)."""


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
            # all greedy, no logprobs: the first maximum of each row where the logits are, in
            # their own dtype (max's indices: argmax's answer in a quarter of its time here),
            # and move N token ids, not [N, vocab] floats, to the host
            return SampleResult(logits.max(dim=-1).indices.tolist(), [None] * n)
        # CPU: the per-request generators are CPU generators (and [N, vocab] is small to move)
        raw = logits.float().cpu()
        logits = self._processed(raw, params, processed, history) if processed else raw
        if constrained:
            logits = self._constrained(raw, logits, constrained)
        tokens = torch.empty(n, dtype=torch.long)
        greedy_set = set(greedy)
        sampled = [i for i in range(n) if i not in greedy_set]
        if greedy:
            # max's indices: the first maximum, as argmax, in a quarter of argmax's time here
            tokens[greedy] = logits[greedy].max(dim=-1).indices
        if sampled:
            sampled_params = [params[i] for i in sampled]
            temps = torch.tensor([p.temperature for p in sampled_params], dtype=logits.dtype)
            temps = temps.unsqueeze(1)
            if len(sampled) < n:
                x = logits[sampled].div_(temps)
            elif logits is not raw:  # a private copy already
                x = logits.div_(temps)
            else:
                x = logits / temps
            cuts = self._cutoffs(x, sampled_params).tolist()
            for row, i in enumerate(sampled):
                tokens[i] = self._race(x[row], cuts[row], self._generator(params[i], positions[i]))
        token_list: list[int] = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw, params, token_list))

    @staticmethod
    def _race(x: torch.Tensor, cut: float, gen: torch.Generator) -> int:
        """The exponential race over the tokens of row ``x`` (``[V]`` float32 tempered logits)
        whose logit is at least ``cut`` (``-inf``: all): one ``Exp(1)`` draw per candidate from
        ``gen``, in token-id order."""
        ids = None if cut == float("-inf") else (x >= cut).nonzero().squeeze(1)
        cand = x if ids is None else x[ids]
        # the softmax up to a constant factor (clamped as in _cutoffs: a weight of 2e-35 wins
        # the race with probability ~2e-35)
        weights = (cand - cand.max()).clamp_min_(_EXP_FLOOR).exp_()
        if ids is None:  # masked tokens (a grammar's, min_tokens' EOS) must never win
            weights.masked_fill_(cand == float("-inf"), 0.0)
        noise = torch.empty_like(weights).exponential_(generator=gen)
        j = int((weights / noise).argmax())
        return j if ids is None else int(ids[j])

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
                # only the tokens seen change (a token seen twice is written twice, equally)
                seen = torch.tensor([*history[i].prompt_token_ids, *output], dtype=torch.long)
                if seen.numel():
                    seen.clamp_(0, vocab - 1)
                    vals = row[seen]
                    rp = p.repetition_penalty
                    row[seen] = torch.where(vals > 0, vals / rp, vals * rp)
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
    def _cutoffs(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Per row of ``x`` (``[M, V]`` float32 tempered logits), the logit a token needs to stay
        a candidate, ``[M]`` float32 (``-inf``: every token): min-p (at least ``min_p`` times
        the top probability), then top-k (at least the k-th largest logit), then top-p (the
        smallest prefix, by descending logit, of the survivors whose renormalised mass reaches
        ``top_p``; the mass strictly before a token must be below ``top_p``). The most likely
        token always stays. Time: O(V) per row plus a ``topk`` as wide as the nucleus needs."""
        m, vocab = x.shape
        cut = torch.full((m,), float("-inf"), dtype=x.dtype)
        min_ps = torch.tensor([p.min_p for p in params], dtype=x.dtype)
        if bool((min_ps > 0).any()):
            # probability below min_p x the top one: logit below the top logit + log(min_p)
            cut = torch.maximum(cut, x.max(dim=-1).values + min_ps.log())
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(ks):
            kth = x.topk(max(ks), dim=-1).values.gather(
                1, torch.tensor([[max(k, 1) - 1] for k in ks])
            )
            limited = torch.tensor([k > 0 for k in ks])
            cut = torch.where(limited, torch.maximum(cut, kth.squeeze(1)), cut)
        top_ps = [p.top_p for p in params]
        pending = [i for i, p in enumerate(top_ps) if p < 1.0]
        if not pending:
            return cut
        rows = torch.tensor(pending)
        survivors = x if len(pending) == m else x[rows]
        if bool((cut[rows] > float("-inf")).any()):
            survivors = survivors.masked_fill(survivors < cut[rows].unsqueeze(1), float("-inf"))
        top = survivors.max(dim=-1, keepdim=True).values
        # the softmax's denominator, from a clamped argument: below -80 exp is slow here, and
        # such terms (< 2e-35 each, -inf ones included) vanish next to the top token's 1
        weights = (survivors - top).clamp_min_(_EXP_FLOOR).exp_()
        mass = weights.sum(dim=-1, keepdim=True)
        p_col = torch.tensor([top_ps[i] for i in pending], dtype=x.dtype).unsqueeze(1)
        width = min(vocab, _FIRST_WIDTH)
        while True:
            vals = survivors.topk(width, dim=-1).values  # descending
            probs = (vals - top).exp() / mass  # 0 past the survivors (-inf)
            before = probs.cumsum(dim=-1) - probs
            past = (before >= p_col) | (vals == float("-inf"))
            past[:, 0] = False
            ends = past.any(dim=-1)
            done = ends | (width == vocab)
            # the nucleus is vals[:n]; its last logit is the cut-off
            n = torch.where(ends, past.to(torch.int8).argmax(dim=-1), width)
            last = vals.gather(1, (n - 1).unsqueeze(1)).squeeze(1)
            cut[rows[done]] = torch.maximum(cut[rows[done]], last[done])
            if bool(done.all()):
                return cut
            keep = ~done
            rows, survivors, p_col = rows[keep], survivors[keep], p_col[keep]
            top, mass = top[keep], mass[keep]
            width = min(vocab, width * _WIDEN)

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
