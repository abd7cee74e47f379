"""``--quantization int8``: weight-only int8 linears (torchao) served through the paged path.

The engine's greedy tokens equal transformers' ``generate()`` over the same int8 weights (the
same torchao transform applied to a reference model), so the quantized path is exact to its
own reference; the LM head stays in the model dtype; tensor parallel is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torchao.quantization as torchao_quantization  # the test extra installs torchao
import transformers

from pdserve.errors import ConfigError
from pdserve.protocol import SamplingParams
from tests.support.engine import complete, hf_greedy, make_engine


def test_int8_engine_equals_transformers_over_the_same_int8_weights(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, compile=True, quantization="int8")
    try:
        runner: Any = engine.runner
        assert type(runner.model.model.layers[0].mlp.down_proj.weight).__name__ == "Int8Tensor"
        assert runner.model.lm_head.weight.dtype == torch.float32
        assert runner.compiled is None  # prepacking needs float weights: eager
        ref: Any = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32
        )
        torchao_quantization.quantize_(
            ref,
            torchao_quantization.Int8WeightOnlyConfig(),
            filter_fn=lambda m, _: isinstance(m, torch.nn.Linear) and m is not ref.lm_head,
        )
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(([1, 72, 101, 108, 108, 111], list(range(40, 90)))):
            got = complete(engine, f"int8-{i}", prompt, greedy).token_ids
            want = hf_greedy(ref, prompt, 12)  # stops at the model's EOS
            assert want and got[: len(want)] == want, f"prompt {i}"
    finally:
        engine.shutdown()


def test_int8_with_tensor_parallel_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="int8 with --tensor-parallel-size"):
        make_engine(tiny_model_dir, quantization="int8", tensor_parallel_size=2, compile=False)
