"""The compiled CPU forward (``model.compile``) computes what the eager forward computes:
same logits and same K/V written into the pool for decode rows, whole prompts and continued
chunks in one step; every step shape runs on the one graph compiled at start-up; greedy tokens
equal transformers' ``generate()`` (tiny model, SmolLM2 with decode + chunked prefill in the
same steps); a failing compiled forward falls back to eager; ``--no-compile`` reaches the
engine config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from pdserve.cli import build_parser, resolve_config
from pdserve.config.loading import worker_config
from pdserve.protocol import KVLayout, SamplingParams
from pdserve.workers.engine.engine import Engine, EngineRequest
from pdserve.workers.engine.model.compile import (
    CompiledForward,
    FusedLinearSlice,
    OneDNNLinear,
    prepack_linears,
)
from pdserve.workers.engine.model.model_runner import ModelRunner
from pdserve.workers.engine.scheduler import ScheduledBatch, ScheduledSequence
from pdserve.workers.engine.sequence import Sequence
from pdserve.workers.kv.manager import KVCacheManager
from tests.support.engine import (
    complete,
    engine_config,
    hf_greedy,
    joined,
    make_engine,
    run,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
TPB = 4


class Pool:
    """A KV cache manager for one runner, and scheduled sequences over it."""

    def __init__(self, runner: ModelRunner, num_blocks: int = 256):
        layout = KVLayout(
            model="test",
            num_layers=runner.num_layers,
            num_kv_heads=runner.num_kv_heads,
            head_dim=runner.head_dim,
            tokens_per_block=TPB,
            dtype="float32",
        )
        self.kv = KVCacheManager(layout, num_blocks)
        self.vocab = runner.vocab_size

    def scheduled(self, rid: str, prompt_len: int, start: int, n: int) -> ScheduledSequence:
        """Sequence ``rid`` feeding ``n`` tokens from position ``start`` (past the prompt:
        one decode token); blocks allocated for its context after the step."""
        prompt = [(31 * i + len(rid)) % self.vocab for i in range(prompt_len)]
        seq = Sequence(rid, prompt, GREEDY, "full", need_blocks=0)
        seq.output_token_ids = [5] * max(0, start + n - prompt_len)
        seq.num_computed_tokens = start
        self.kv.allocate(rid, start + n)
        return ScheduledSequence.of(seq, n)


def steps(pool: Pool, max_rows: int) -> list[ScheduledBatch]:
    """Step 1: three prompts' first chunks (0 sampling rows). Step 2: one decode row, a
    continued chunk (samples) and a whole prompt. Then decode-only steps of 2..max_rows rows and
    one mixed step with every decode row and a chunk that does not sample."""
    out = [
        ScheduledBatch(prefill=[pool.scheduled(f"p{i}", 9 + i, 0, 6) for i in range(3)]),
        ScheduledBatch(
            decode=[pool.scheduled("d0", 5, 5, 1)],
            prefill=[pool.scheduled("p0", 9, 6, 3), pool.scheduled("w", 7, 0, 7)],
        ),
    ]
    for rows in range(2, max_rows + 1):
        out.append(
            ScheduledBatch(decode=[pool.scheduled(f"r{i}", 11, 11 + rows, 1) for i in range(rows)])
        )
    out.append(
        ScheduledBatch(
            decode=[pool.scheduled(f"r{i}", 11, 11 + max_rows + 1, 1) for i in range(max_rows)],
            prefill=[pool.scheduled("p1", 10, 6, 2)],
        )
    )
    return out


@pytest.fixture(scope="module")
def tiny_runners(tiny_model_dir: Path) -> tuple[ModelRunner, ModelRunner]:
    eager = ModelRunner(engine_config(tiny_model_dir, compile=False))
    compiled = ModelRunner(engine_config(tiny_model_dir, compile=True))
    assert eager.compiled is None and compiled.compiled is not None
    return eager, compiled


def test_compiled_steps_equal_eager_steps_in_logits_and_kv_pool(tiny_runners) -> None:
    eager, compiled = tiny_runners
    assert compiled.compiled is not None and compiled.compiled.prepacked > 0
    assert any(isinstance(m, OneDNNLinear) for m in compiled.model.modules())
    assert not any(isinstance(m, OneDNNLinear) for m in eager.model.modules())
    pools = Pool(eager), Pool(compiled)
    graphs_before = counters["stats"]["unique_graphs"]
    for a, b in zip(steps(pools[0], 8), steps(pools[1], 8), strict=True):
        want = eager.execute(a, pools[0].kv)
        got = compiled.execute(b, pools[1].kv)
        assert got.shape == want.shape == (len(a.sampling), eager.vocab_size)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(pools[1].kv.pool, pools[0].kv.pool, rtol=1e-4, atol=1e-5)
    assert pools[1].kv.pool.abs().sum() > 0
    # every step shape above (0..8 sampled rows, 1..29 tokens) ran on the warm-up's graph
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert compiled.compiled is not None  # no fallback happened


def linear_calls(fn: object) -> int:
    """How many ``pdserve::onednn_linear`` calls running ``fn()`` makes."""
    with torch.profiler.profile() as prof:
        fn()  # type: ignore[operator]
    return sum(e.count for e in prof.key_averages() if e.key == "pdserve::onednn_linear")


def distinct_gemms(model: torch.nn.Module) -> int:
    return len(
        {
            id(m.packed_weight)
            for m in model.modules()
            if isinstance(m, (OneDNNLinear, FusedLinearSlice))
        }
    )


def test_sibling_projections_run_as_one_gemm_compiled_and_eager(
    tiny_runners, tiny_model_dir: Path
) -> None:
    """q/k/v and gate/up are one prepacked GEMM each: the compiled step calls each GEMM once
    (the merge pass), and so does an eager forward of the prepacked model, with the unfused
    model's logits."""
    eager, compiled = tiny_runners
    groups = {id(m.group) for m in compiled.model.modules() if isinstance(m, FusedLinearSlice)}
    assert len(groups) == 2 * compiled.num_layers  # q/k/v and gate/up in every layer
    pool = Pool(compiled)
    batch = ScheduledBatch(decode=[pool.scheduled("x", 5, 5, 1), pool.scheduled("y", 7, 7, 1)])
    assert linear_calls(lambda: compiled.execute(batch, pool.kv)) == distinct_gemms(compiled.model)

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    fused = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prepack_linears(fused)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        want = plain(input_ids=ids).logits
        got = fused(input_ids=ids).logits
        calls = linear_calls(lambda: fused(input_ids=ids))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (
        calls
        == distinct_gemms(fused)
        < sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    )


def test_a_failing_compiled_step_runs_eagerly_and_stays_eager(
    tiny_runners, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager, _ = tiny_runners
    runner = ModelRunner(engine_config(tiny_model_dir, compile=True))
    assert runner.compiled is not None

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("inductor broke")

    monkeypatch.setattr(CompiledForward, "__call__", broken)
    pools = Pool(eager), Pool(runner)
    a, b = steps(pools[0], 2)[0], steps(pools[1], 2)[0]
    eager.execute(a, pools[0].kv)
    runner.execute(b, pools[1].kv)
    assert runner.compiled is None
    torch.testing.assert_close(pools[1].kv.pool, pools[0].kv.pool, rtol=1e-4, atol=1e-5)


def test_a_failing_warm_up_leaves_the_runner_eager(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: CompiledForward, *args: object) -> float:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(CompiledForward, "warm_up", broken)
    assert ModelRunner(engine_config(tiny_model_dir, compile=True)).compiled is None


@pytest.fixture(scope="module", params=["eager", "compiled"])
def tiny_engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Engine]:
    engine = make_engine(
        tiny_model_dir, compile=request.param == "compiled", max_num_batched_tokens=8
    )
    assert (engine.runner.compiled is not None) == (request.param == "compiled")
    yield engine
    engine.shutdown()


def test_chunked_batched_greedy_equals_generate_eager_and_compiled(
    tiny_engine: Engine, tiny_model_dir: Path
) -> None:
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    tok = tiny_engine.tokenizer
    texts = ["Hello there", "pdserve compiles the forward once; " * 2, "x", "0123456789abcdef"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    outs = run(tiny_engine, [EngineRequest(f"c-{i}", p, GREEDY) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert joined(outs[f"c-{i}"]).token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert (
        complete(tiny_engine, "solo", prompts[1], GREEDY).token_ids == joined(outs["c-1"]).token_ids
    )


def test_no_compile_flag_reaches_the_engine_config() -> None:
    model = Path("/models/x")
    for argv, want in ((["decode"], True), (["decode", "--no-compile"], False)):
        cfg, _ = resolve_config(build_parser().parse_args(argv), "decode", env={})
        assert cfg.model.compile is want
        assert worker_config(cfg, "decode", model).engine.model.compile is want
    cfg, _ = resolve_config(
        build_parser().parse_args(["decode"]), "decode", env={"PDSERVE_MODEL__COMPILE": "false"}
    )
    assert worker_config(cfg, "decode", model).engine.model.compile is False


# --- SmolLM2 -----------------------------------------------------------------------------------

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> Iterator[tuple[Engine, object, list[list[int]]]]:
    """One compiled SmolLM2 engine for the module; 32-token chunks, so prompts (about 40
    tokens with the chat template) are prefilled in chunks while earlier requests decode."""
    engine = make_engine(
        smollm2_dir, tokens_per_block=16, num_blocks=64, max_num_batched_tokens=32, compile=True
    )
    assert engine.runner.compiled is not None
    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    tok = engine.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    yield engine, hf, prompts
    engine.shutdown()


@pytest.mark.slow
def test_smollm2_compiled_decode_and_chunked_prefill_equal_generate(smol) -> None:
    engine, hf, prompts = smol
    assert all(len(p) > 32 for p in prompts)  # every prompt takes two chunks
    sampling = SamplingParams(temperature=0.0, max_tokens=16)
    mixed: list[tuple[int, int]] = []  # (decode rows, prefill chunks) of each mixed step
    execute = engine.runner.execute

    def recording(batch: ScheduledBatch, kv_cache: KVCacheManager) -> torch.Tensor:
        if batch.decode and batch.prefill:
            mixed.append((len(batch.decode), len(batch.prefill)))
        return execute(batch, kv_cache)

    engine.runner.execute = recording  # type: ignore[method-assign]
    graphs_before = counters["stats"]["unique_graphs"]
    try:
        outs = run(engine, [EngineRequest(f"s-{i}", p, sampling) for i, p in enumerate(prompts)])
    finally:
        del engine.runner.execute
    assert mixed, "no step mixed decode rows with a prefill chunk"
    assert counters["stats"]["unique_graphs"] == graphs_before  # no recompile after start-up
    assert engine.runner.compiled is not None
    for i, prompt in enumerate(prompts):
        got = joined(outs[f"s-{i}"])
        expected = hf_greedy(hf, prompt, sampling.max_tokens)
        assert got.token_ids == expected, QUESTIONS[i]
        assert got.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_blocks
