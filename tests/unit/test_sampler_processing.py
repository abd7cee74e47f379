"""Sampler logits processing: min_tokens, logit_bias, repetition / frequency / presence
penalties, min_p; each reads only the row's own tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.sampler import Sampler

VOCAB = 8
EOS = 7
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class History:
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def greedy(logits: list[float], history: History, **params: object) -> int:
    p = GREEDY.model_copy(update=params)
    rows = torch.tensor([logits])
    return Sampler(eos_token_ids=[EOS]).sample(rows, [p], [0], [history]).token_ids[0]


def test_min_tokens_masks_eos_and_stop_token_ids_until_enough_are_out() -> None:
    logits = [0, 1, 2, 3, 4, 5, 6, 9.0]  # EOS is the argmax, token 6 next
    assert greedy(logits, History(output_token_ids=[1]), min_tokens=2) == 6
    assert greedy(logits, History(output_token_ids=[1, 2]), min_tokens=2) == EOS
    stop_6 = {"min_tokens": 3, "stop_token_ids": (6,)}
    assert greedy(logits, History(output_token_ids=[1]), **stop_6) == 5
    assert greedy(logits, History(output_token_ids=[1, 2, 3]), **stop_6) == EOS


def test_logit_bias_adds_to_the_logits_before_sampling() -> None:
    logits = [5.0, 0, 0, 0, 0, 0, 0, 0]
    assert greedy(logits, History(), logit_bias=((3, 6.0),)) == 3
    assert greedy(logits, History(), logit_bias=((0, -100.0),)) == 1  # first of the ties
    # sampled too: a -100 bias is a ban in practice
    p = SamplingParams(temperature=1.0, seed=3, logit_bias=((0, -100.0),))
    rows = torch.tensor([logits]).repeat(200, 1)
    drawn = Sampler().sample(rows, [p] * 200, list(range(200)), [History()] * 200).token_ids
    assert 0 not in drawn


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = [4.0, 3.0, -1.0, -1.5, 0, 0, 0, 0]
    seen = History(prompt_token_ids=[0], output_token_ids=[2])
    # 4 / 2 = 2 < 3: token 1 wins; unseen token 1 keeps 3
    assert greedy(logits, seen, repetition_penalty=2.0) == 1
    p = GREEDY.model_copy(update={"repetition_penalty": 2.0})
    x = Sampler()._processed(torch.tensor([logits]), [p], [0], [seen])[0]
    assert x.tolist()[:4] == [2.0, 3.0, -2.0, -1.5]  # seen: 4 -> 2 and -1 -> -2


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    logits = [3.0, 2.5, 0, 0, 0, 0, 0, 0]
    prompt_only = History(prompt_token_ids=[0, 0, 0])
    assert greedy(logits, prompt_only, frequency_penalty=1.0, presence_penalty=1.0) == 0
    twice = History(output_token_ids=[0, 0])
    assert greedy(logits, twice, frequency_penalty=0.3) == 1  # 3 - 0.6 < 2.5
    assert greedy(logits, twice, presence_penalty=0.3) == 0  # 3 - 0.3 > 2.5, once per token
    p = GREEDY.model_copy(update={"frequency_penalty": 0.5, "presence_penalty": 0.25})
    x = Sampler()._processed(torch.tensor([logits]), [p], [0], [twice])[0]
    assert x[0].item() == pytest.approx(3.0 - 2 * 0.5 - 0.25) and x[1].item() == 2.5


def test_min_p_drops_tokens_below_its_share_of_the_top_probability() -> None:
    # probabilities proportional to 8, 4, 2, 1: min_p 0.3 keeps the first two (1/8 < 2/8 < 0.3)
    logits = torch.log(torch.tensor([[8.0, 4.0, 2.0, 1.0, 1e-9, 1e-9, 1e-9, 1e-9]]))
    p = SamplingParams(temperature=1.0, min_p=0.3, seed=5)
    n = 400
    drawn = Sampler().sample(logits.repeat(n, 1), [p] * n, list(range(n))).token_ids
    assert set(drawn) == {0, 1}


def test_the_history_is_required_only_when_a_row_processes_logits() -> None:
    rows = torch.zeros(2, VOCAB)
    plain = Sampler().sample(rows, [GREEDY, GREEDY], [0, 0])
    assert plain.token_ids == [0, 0]
    with pytest.raises(ValueError, match="token history"):
        Sampler().sample(rows, [GREEDY, GREEDY.model_copy(update={"min_tokens": 1})], [0, 0])


def test_processing_one_row_leaves_the_others_and_the_logprobs_raw() -> None:
    logits = torch.tensor([[0.0, 2.0, 1, 0, 0, 0, 0, 0], [0.0, 2.0, 1, 0, 0, 0, 0, 0]])
    biased = SamplingParams(temperature=0.0, logit_bias=((2, 5.0),), logprobs=True)
    plain = SamplingParams(temperature=0.0, logprobs=True)
    result = Sampler().sample(logits, [biased, plain], [0, 0], [History(), History()])
    assert result.token_ids == [2, 1]
    raw = torch.log_softmax(logits[0], dim=-1)
    lp = result.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(raw[2].item())  # the model's own
