"""Sampler logits processing: min_tokens, logit_bias, repetition / frequency / presence
penalties, min_p; each reads only the row's own tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from pydantic import ValidationError

from pdserve.protocol import (
    GREEDY_TEMPERATURE,
    MAX_LOGIT_BIAS_VALUE,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from pdserve.workers.engine.sampling.sampler import Sampler

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


# Extremes of every sampling field the schema accepts (issue 39: temperature 5e-324 and
# repetition_penalty 1e-300 made the logits NaN, and the sampler emitted EOS).
EXTREMES = [
    {"temperature": 5e-324},
    {"temperature": GREEDY_TEMPERATURE * 0.999},
    {"temperature": GREEDY_TEMPERATURE},
    {"temperature": 2.0},
    {"top_p": 5e-324},
    {"min_p": 5e-324},
    {"min_p": 1e-45},
    {"min_p": 1.0},
    {"top_k": 2**31 - 1},
    {"repetition_penalty": MIN_REPETITION_PENALTY},
    {"repetition_penalty": MAX_REPETITION_PENALTY},
    {"presence_penalty": 2.0, "frequency_penalty": 2.0},
    {"presence_penalty": -2.0, "frequency_penalty": -2.0},
    {"presence_penalty": 5e-324, "frequency_penalty": -5e-324},
    {"logit_bias": ((0, MAX_LOGIT_BIAS_VALUE), (6, -MAX_LOGIT_BIAS_VALUE))},
    {"temperature": GREEDY_TEMPERATURE, "repetition_penalty": MIN_REPETITION_PENALTY,
     "frequency_penalty": -2.0, "logit_bias": ((0, MAX_LOGIT_BIAS_VALUE),), "top_p": 5e-324,
     "min_p": 5e-324},
]  # fmt: skip


@pytest.mark.parametrize("fields", EXTREMES)
def test_every_accepted_extreme_keeps_the_probabilities_finite(fields: dict[str, object]) -> None:
    logits = torch.tensor([[30.0, 29.0, -30.0, 0.0, 1e-3, -1e-3, 12.0, 31.0]])
    seen = History(prompt_token_ids=[0, 1, 2], output_token_ids=[0, 0, 5])
    p = SamplingParams.model_validate({"temperature": 1.0, "seed": 1, **fields})
    sampler = Sampler(eos_token_ids=[EOS])
    x = sampler._processed(logits, [p], [0], [seen]) if p.processes_logits else logits
    assert torch.isfinite(x).all(), x
    token = sampler.sample(logits, [p], [0], [seen]).token_ids[0]
    if p.greedy:
        assert token == x.argmax().item()
    else:
        tempered = x / p.temperature
        assert torch.isfinite(tempered).all(), tempered
        cut = sampler._cutoffs(tempered, [p])[0]
        kept = tempered[0] >= cut
        assert kept[x.argmax()]  # the likeliest stays a candidate
        assert kept[token]


def test_a_temperature_below_the_greedy_threshold_is_greedy_on_both_legs() -> None:
    # Flat logits: any sampled draw would spread; greedy takes the first maximum every time.
    logits = torch.tensor([[1.0, 1.0 + 1e-6, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    for temperature in (5e-324, 1e-300, GREEDY_TEMPERATURE / 2):
        p = SamplingParams(temperature=temperature)
        assert p.greedy
        # position 0 is the prefill leg's sample, later positions the decode leg's
        picks = Sampler().sample(logits.repeat(16, 1), [p] * 16, list(range(16))).token_ids
        assert picks == [1] * 16
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 1e-300), ("repetition_penalty", MIN_REPETITION_PENALTY / 2),
     ("logit_bias", ((0, 1e300),)), ("logit_bias", ((0, float("inf")),)),
     ("temperature", float("nan")), ("presence_penalty", float("-inf"))],
)  # fmt: skip
def test_the_wire_refuses_values_that_would_overflow_the_logits(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams.model_validate({field: value})
