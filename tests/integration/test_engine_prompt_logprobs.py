"""Prompt logprobs on a real engine (tiny model): the logprob of every prompt token after the
first, of the model's own distribution (equal to transformers' forward over the prompt), the
same whether the prompt is prefilled in one step or in chunks, and next to a request that does
not ask for them in the same batch; a prompt the prefix cache holds is computed whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.protocol import SamplingParams
from pdserve.workers.engine.engine import EngineRequest
from tests.support.engine import make_engine, run

PROMPT = list(range(60, 101))  # 41 tokens
ASK = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)


def reference(model_dir: Path) -> torch.Tensor:
    """transformers' log-softmax over the prompt: row i is the distribution after token i."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("chunk", [512, 8])  # one step, and chunked prefill of 8 tokens a step
def test_prompt_logprobs_equal_the_models_distribution(tiny_model_dir: Path, chunk: int) -> None:
    want = reference(tiny_model_dir)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=chunk)
    try:
        plain = SamplingParams(temperature=0.0, max_tokens=2)
        outs = run(
            engine, [EngineRequest("p", PROMPT, ASK), EngineRequest("q", PROMPT[:20], plain)]
        )
        first = outs["p"][0]
        assert outs["q"][0].prompt_logprobs is None, "only the request that asked"
        lps = first.prompt_logprobs
        assert lps is not None and len(lps) == len(PROMPT) and lps[0] is None
        for i, lp in enumerate(lps[1:], start=1):
            assert lp is not None and lp.token_id == PROMPT[i]
            assert lp.logprob == pytest.approx(want[i - 1, PROMPT[i]].item(), abs=1e-4), i
            top = want[i - 1].topk(3)
            assert [t for t, _ in lp.top] == top.indices.tolist(), i
        # asked again: the prefix cache holds the prompt, yet every entry is computed again
        again = run(engine, [EngineRequest("p2", PROMPT, ASK)])["p2"][0].prompt_logprobs
        assert again is not None
        assert [x.logprob if x else None for x in again] == [x.logprob if x else None for x in lps]
    finally:
        engine.shutdown()
