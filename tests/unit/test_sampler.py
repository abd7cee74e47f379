"""Sampler: greedy, top-k/top-p masks, position-keyed seeds, logprobs."""

from __future__ import annotations

import math

import torch

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.sampling.sampler import Sampler, position_seed

VOCAB = 16


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=gen) * 3


def test_greedy_picks_the_argmax_of_each_row() -> None:
    logits = logits_rows(5)
    result = Sampler(seed=1).sample(logits, [SamplingParams(temperature=0.0)] * 5, [0] * 5)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 5


def test_top_k_only_samples_among_the_k_most_likely_tokens() -> None:
    logits = logits_rows(1).repeat(400, 1)
    allowed = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=3, seed=9)] * 400
    result = Sampler().sample(logits, params, list(range(400)))
    assert set(result.token_ids) == allowed


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log().repeat(300, 1)
    sampler = Sampler()
    wide = sampler.sample(logits, [SamplingParams(top_p=0.7, seed=1)] * 300, list(range(300)))
    assert set(wide.token_ids) == {0, 1}
    narrow = sampler.sample(logits, [SamplingParams(top_p=0.5, seed=1)] * 300, list(range(300)))
    assert set(narrow.token_ids) == {0}


def test_rows_with_different_settings_are_masked_independently() -> None:
    logits = logits_rows(1).repeat(2, 1)
    top1 = int(logits[0].argmax())
    params = [SamplingParams(top_k=1, seed=3), SamplingParams(temperature=0.0)]
    result = Sampler().sample(logits, params, [5, 5])
    assert result.token_ids == [top1, top1]


def test_temperature_sampling_follows_the_softmax_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4))
    n = 4000
    params = [SamplingParams(temperature=1.0, seed=123)] * n
    tokens = Sampler().sample(logits.repeat(n, 1), params, list(range(n))).token_ids
    expected = torch.softmax(logits, dim=-1)[:4]
    observed = torch.bincount(torch.tensor(tokens), minlength=VOCAB)[:4].float() / n
    assert torch.allclose(observed, expected, atol=0.03)


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    logits = logits_rows(8)
    params = [SamplingParams(temperature=1.0, seed=42)] * 8
    batched = Sampler(seed=1).sample(logits, params, list(range(8))).token_ids
    # one at a time, in reverse order, on a different sampler, next to unrelated rows
    solo = []
    for i in reversed(range(8)):
        rows = torch.stack([logits[i], logits_rows(1, seed=99)[0]])
        other = SamplingParams(temperature=1.0)
        solo.append(Sampler(seed=2).sample(rows, [params[i], other], [i, 0]).token_ids[0])
    assert batched == list(reversed(solo))


def test_split_sampling_gives_the_same_tokens_as_one_sampler() -> None:
    """Position 0 on one sampler ('prefill worker'), positions 1.. on another ('decode')."""
    logits = logits_rows(6, seed=5)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=2024)
    one = [Sampler().sample(logits[i : i + 1], [p], [i]).token_ids[0] for i in range(6)]
    prefill = Sampler().sample(logits[:1], [p], [0]).token_ids
    decode_sampler = Sampler()
    decode = [decode_sampler.sample(logits[i : i + 1], [p], [i]).token_ids[0] for i in range(1, 6)]
    assert prefill + decode == one


def test_different_seeds_give_different_draws() -> None:
    logits = torch.zeros(64, VOCAB)  # uniform: every draw is pure noise
    a = Sampler().sample(logits, [SamplingParams(seed=1)] * 64, list(range(64))).token_ids
    b = Sampler().sample(logits, [SamplingParams(seed=2)] * 64, list(range(64))).token_ids
    assert a != b
    assert position_seed(1, 0) != position_seed(0, 1)


def test_logprobs_are_of_the_raw_distribution_and_sum_to_one() -> None:
    logits = logits_rows(3)
    params = [SamplingParams(temperature=0.5, top_k=2, seed=4, logprobs=True, top_logprobs=VOCAB)]
    params = params * 3
    result = Sampler().sample(logits, params, [0, 1, 2])
    raw = torch.log_softmax(logits, dim=-1)
    for row, (token, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        assert lp is not None and lp.token_id == token
        assert math.isclose(lp.logprob, raw[row, token].item(), rel_tol=1e-5, abs_tol=1e-6)
        assert math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, rel_tol=1e-4)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)


def test_top_logprobs_lists_the_requested_number_with_the_greedy_token_first() -> None:
    logits = logits_rows(2)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), SamplingParams()]
    result = Sampler().sample(logits, params, [0, 0])
    first = result.logprobs[0]
    assert first is not None and len(first.top) == 3
    assert first.top[0][0] == result.token_ids[0]
    assert result.logprobs[1] is None


def reference_cutoff(x: torch.Tensor, p: SamplingParams) -> float:
    """min-p, top-k, top-p by sorting the whole row (the sampler's semantics, slowly)."""
    x = x.double()
    cut = float("-inf")
    if p.min_p > 0:
        cut = max(cut, x.max().item() + math.log(p.min_p))
    if 0 < p.top_k < x.numel():
        cut = max(cut, x.topk(p.top_k).values[-1].item())
    if p.top_p < 1.0:
        vals = x[x >= cut].sort(descending=True).values
        probs = vals.softmax(dim=0)
        before = probs.cumsum(dim=0) - probs
        n = max(1, int((before < p.top_p).sum()))
        cut = max(cut, vals[n - 1].item())
    return cut


def test_cutoffs_equal_a_whole_row_sort_at_every_nucleus_width() -> None:
    """Narrow nuclei end inside the first 64 candidates; flat rows widen the search to 1024,
    16384 and the whole vocabulary. Each row's cut-off is the sorted reference's, alone or in
    any batch."""
    vocab = 20000
    gen = torch.Generator().manual_seed(7)
    scales = [40.0, 8.0, 2.0, 0.5, 0.05, 0.0]  # from a few candidates to a flat row
    x = torch.cat([torch.randn(1, vocab, generator=gen) * s for s in scales])
    settings = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.999),
        SamplingParams(top_p=0.5, top_k=3000),
        SamplingParams(top_p=0.95, min_p=0.01),
        SamplingParams(top_k=50),
        SamplingParams(min_p=0.2),
    ]
    for p in settings:
        batched = Sampler._cutoffs(x, [p] * len(scales)).tolist()
        for row in range(len(scales)):
            alone = Sampler._cutoffs(x[row : row + 1], [p]).item()
            expected = reference_cutoff(x[row], p)
            assert alone == batched[row]
            assert math.isclose(alone, expected, rel_tol=1e-6, abs_tol=1e-6), (p, row)


def test_tokens_tied_with_the_nucleus_last_logit_are_all_candidates() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0] + [-9.0] * (VOCAB - 5)])
    cut = Sampler._cutoffs(logits, [SamplingParams(top_p=0.8)]).item()
    assert cut == 1.0  # the nucleus ends inside the tie; all three tied tokens stay
    draws = Sampler().sample(logits.repeat(600, 1), [SamplingParams(top_p=0.8)] * 600, [0] * 600)
    assert set(draws.token_ids) == {0, 1, 2, 3}
