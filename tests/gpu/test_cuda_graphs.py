"""CUDA graphs of decode steps (``EngineConfig.cuda_graphs``, off by default, experimental)
emit the eager path's tokens: a batch of sequences of different lengths, padded to batch buckets and
block-table widths while other sequences prefill in chunks, equals each sequence run alone on an
eager CUDA engine and transformers' ``generate()``; graphs are really captured and replayed, and
a replayed decode step makes fewer host synchronisations than an eager step.

Skipped without CUDA (``torch.cuda.is_available()``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.workers.engine.engine import Engine
from tests.support.engine import check_batched_equals_solo, make_engine, mixed_cases
from tests.support.gpu_models import build_smollm2_like, hf_greedy_on, syncs_per_forward

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())"
    ),
]


@pytest.fixture(scope="module")
def smol_like_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_smollm2_like(tmp_path_factory.mktemp("smollm2-like-graphs"), seed=0)


def _check(model_dir: Path, **overrides: object) -> None:
    graphed = make_engine(
        model_dir,
        device="cuda",
        dtype="float32",
        cuda_graphs=True,
        max_num_batched_tokens=32,
        **overrides,
    )
    eager = make_engine(model_dir, device="cuda", dtype="float32", cuda_graphs=False, **overrides)
    try:
        assert graphed.runner.graphs is not None and eager.runner.graphs is None
        cases = mixed_cases(min(graphed.runner.vocab_size, 256))
        batched = check_batched_equals_solo(graphed, eager, cases)
        graphs = graphed.runner.graphs
        print(
            f"{model_dir.name}: shapes {sorted(graphs._shapes)}, "
            f"{graphs.captures} captures, {graphs.replays} replays"
        )
        assert graphs.failures == 0
        assert graphs.captures >= 4 and graphs.replays > graphs.captures
        assert {b for b, _ in graphs._shapes} >= {1, 2, 4, 8}
    finally:
        graphed.shutdown()
        eager.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    hf = hf.to("cuda").eval()
    for i, (prompt, sampling) in enumerate(cases):
        if sampling.temperature == 0.0:  # generate() stops at EOS; the engine ignores it
            want = hf_greedy_on(hf, prompt, sampling.max_tokens)
            assert batched[i][: len(want)] == want, i


def test_graphed_batch_equals_solo_eager_runs_tiny(tiny_model_dir: Path) -> None:
    _check(tiny_model_dir)


@pytest.mark.slow
def test_graphed_batch_equals_solo_eager_runs_smollm2_like(smol_like_dir: Path) -> None:
    _check(smol_like_dir, tokens_per_block=16, num_blocks=64)


@pytest.mark.slow
def test_a_replayed_decode_step_syncs_less_than_an_eager_step(smol_like_dir: Path) -> None:
    graphed = syncs_per_forward(smol_like_dir, tokens_per_block=16, num_blocks=64, cuda_graphs=True)
    eager = syncs_per_forward(smol_like_dir, tokens_per_block=16, num_blocks=64, cuda_graphs=False)
    print("host syncs per forward, graphs:", [len(s) for s in graphed])
    print("host syncs per forward, eager: ", [len(s) for s in eager])
    print("kinds (graphs):", sorted({m for s in graphed for m in s}))
    # step 0 is the (eager) prefill; steps 2.. replay the graph captured in step 1
    assert max(len(s) for s in graphed[2:]) < min(len(s) for s in eager[1:]), (graphed, eager)


def test_engine_on_cuda_uses_graphs_only_when_enabled(tiny_model_dir: Path) -> None:
    on: Engine = make_engine(tiny_model_dir, device="cuda", dtype="float32", cuda_graphs=True)
    off: Engine = make_engine(
        tiny_model_dir, device="cuda", dtype="float32"
    )  # the default: graphs off
    try:
        assert on.runner.graphs is not None and off.runner.graphs is None
    finally:
        on.shutdown()
        off.shutdown()
