"""The padded, static-shape decode path of :mod:`pdserve.workers.engine.model.cuda_graphs` computes what the
eager path computes: a batch of sequences of different lengths, decoded through padded buckets
(batch 1, 2, 4, 8; block-table widths 16 and 32) while other sequences still prefill in
chunks, emits every sequence's solo eager tokens and transformers' ``generate()`` tokens.

On CPU the static path runs eagerly (``capture=False``): this checks the padding, the masks and
the write of padded rows without a GPU. A CUDA graph capture fails on any host read of a device
value (``.item()``, ``bool(tensor)``); the static forward is run on the ``meta`` device, where
such a read raises, to show it makes none. ``tests/gpu/test_cuda_graphs.py`` runs the same checks
with real CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.workers.engine.engine import Engine
from pdserve.workers.engine.model.attention import register_paged_attention
from pdserve.workers.engine.model.cuda_graphs import DecodeGraphs
from tests.support.engine import (
    check_batched_equals_solo,
    hf_greedy,
    make_engine,
    mixed_cases,
)


@pytest.fixture
def static_engine(tiny_model_dir: Path):
    # 32-token steps: the long prompts prefill in chunks while the short ones decode
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=32)
    engine.runner.graphs = DecodeGraphs(
        engine.runner.model, engine.runner.device, max_num_seqs=8, capture=False
    )
    yield engine
    engine.shutdown()


def test_static_decode_path_equals_solo_eager_runs_and_generate(
    static_engine: Engine, tiny_model_dir: Path
) -> None:
    eager = make_engine(tiny_model_dir)
    try:
        assert eager.runner.graphs is None  # CPU: never graphs, whatever cuda_graphs says
        cases = mixed_cases(eager.runner.vocab_size)
        batched = check_batched_equals_solo(static_engine, eager, cases)
    finally:
        eager.shutdown()
    graphs = static_engine.runner.graphs
    assert graphs is not None and graphs.replays > 0
    used = set(graphs._shapes)
    assert {b for b, _ in used} >= {1, 2, 4, 8}, used  # 5 sequences pad to 8, then shrink
    assert {w for _, w in used} >= {16, 32}, used  # tables grow past 16 blocks
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()
    for i, (prompt, sampling) in enumerate(cases):
        if sampling.temperature == 0.0:  # generate() stops at EOS; the engine ignores it
            want = hf_greedy(hf, prompt, sampling.max_tokens)
            assert batched[i][: len(want)] == want, i


def test_shapes_pad_to_buckets() -> None:
    graphs = DecodeGraphs(torch.nn.Identity(), torch.device("cpu"), max_num_seqs=24, capture=False)
    assert graphs.batch_buckets == (1, 2, 4, 8, 16, 32)
    assert graphs.shape_for(1, 1) == (1, 8)
    assert graphs.shape_for(3, 9) == (4, 16)
    assert graphs.shape_for(17, 33) == (32, 64)
    assert graphs.shape_for(33, 1) is None  # more sequences than the largest bucket: eager


def test_static_decode_forward_reads_nothing_back_to_the_host(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation=register_paged_attention(), local_files_only=True
    )
    meta = torch.device("meta")
    model = model.to(meta).eval()
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    pool = torch.zeros(
        text.num_hidden_layers, 16, 2, 4, text.num_key_value_heads, head_dim, device=meta
    )
    kv = SimpleNamespace(tokens_per_block=4, pool=pool)
    graphs = DecodeGraphs(model, meta, max_num_seqs=8, capture=False)
    with torch.inference_mode():
        shape = graphs._new_shape(4, 8, 4)
        logits = graphs._forward(shape, kv, 4)  # type: ignore[arg-type]
        assert logits.shape == (4, text.vocab_size)
        # the check has teeth: without the 4D attention_mask, transformers' packed-sequence
        # check reads position_ids back (a host sync, fatal inside a capture)
        graphs._mask4d = None  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="meta"):
            graphs._forward(shape, kv, 4)  # type: ignore[arg-type]
