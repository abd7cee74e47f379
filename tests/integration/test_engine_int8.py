"""``--quantization int8``: weight-only int8 linears (torchao) served through the paged path;
``--quantization w8a8``: int8 weights x int8 activations through oneDNN in the compiled forward.

The engine's greedy tokens equal transformers' ``generate()`` over the same int8 weights (the
same torchao transform applied to a reference model), so the quantized path is exact to its
own reference; the LM head stays in the model dtype; tensor parallel is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchao.quantization as torchao_quantization  # the test extra installs torchao
import transformers

from pdserve.errors import ConfigError
from pdserve.protocol import SamplingParams
from pdserve.workers.engine.model.compile import prepack_linears
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


@pytest.fixture
def _room_for_another_graph() -> Iterator[None]:
    """A compiled forward of one more model class in this process: the whole suite compiles
    many before this test (test_engine_families raises dynamo's ``recompile_limit`` for its
    own), so lift the limit while it runs; a worker process compiles one model."""
    config: Any = torch._dynamo.config
    saved = config.recompile_limit
    config.recompile_limit = saved + 1000
    yield
    config.recompile_limit = saved


@pytest.mark.usefixtures("_room_for_another_graph")
def test_w8a8_engine_equals_its_eager_reference_and_stays_near_float(
    tiny_model_dir: Path,
) -> None:
    """``--quantization w8a8``: the compiled engine's greedy tokens equal transformers'
    ``generate()`` over the same prepacked W8A8 linears run eagerly; those linears' logits stay
    near the float model's; the LM head keeps float weights."""
    engine = make_engine(tiny_model_dir, compile=True, quantization="w8a8")
    try:
        runner: Any = engine.runner
        assert runner.compiled is not None and runner.compiled.prepacked > 0
        assert runner.model.model.layers[0].mlp.down_proj.weight_scale is not None
        assert runner.model.model.layers[0].self_attn.k_proj.weight_scale is not None
        assert runner.model.lm_head.weight_scale is None
        plain: Any = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32
        )
        ref: Any = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32
        )
        prepack_linears(ref, int8=True)
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(([1, 72, 101, 108, 108, 111], list(range(40, 90)))):
            got = complete(engine, f"w8a8-{i}", prompt, greedy).token_ids
            with torch.inference_mode():
                ids = torch.tensor([prompt + got])
                q, f = ref(input_ids=ids).logits[0], plain(input_ids=ids).logits[0]
            # teacher-forced through the eager reference, each greedy token is its top choice
            # or within a rounding step of an activation's int8 scale of it (compiled and
            # eager round a few quantized activations differently)
            steps = q[len(prompt) - 1 : -1]
            chosen = steps.gather(1, torch.tensor(got).unsqueeze(1)).squeeze(1)
            gap = steps.max(dim=-1).values - chosen
            assert gap.max() <= 0.01 * steps.std(), (i, gap)
            # near the float model's logits at every position (measured >= 0.986 on the tiny
            # model's random weights; SmolLM2's quality: docs/benchmarks.md)
            cos = torch.nn.functional.cosine_similarity(q, f, dim=-1)
            assert cos.min() > 0.98, cos
    finally:
        engine.shutdown()


def test_w8a8_with_tensor_parallel_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="w8a8 with --tensor-parallel-size"):
        make_engine(tiny_model_dir, quantization="w8a8", tensor_parallel_size=2, compile=False)
