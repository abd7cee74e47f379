"""``pdserve bench handoff`` measures both hand-offs on real stacks (tiny model): the prefill
worker computes 16 tokens per step, so the 40- and 80-token prompts are prefilled in chunks and
the streamed stack's decode worker pulls them chunk by chunk."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.transfer.bench_handoff import MODES, format_table, measure
from pdserve.config.settings import PdserveConfig


def test_both_hand_offs_give_positive_times_per_prompt_length(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = PdserveConfig.model_validate(
        {
            "model": {"compile": False},
            "kv_cache": {"budget_mb": 32},
            "scheduler": {"threads": 1, "max_num_batched_tokens": 16},
        }
    )
    result = measure(
        cfg, tiny_model_dir, [40, 80], 1, backend="tcp", log_dir=tmp_path, timeout_s=60
    )
    assert [r["prompt_tokens"] for r in result["rows"]] == [40, 80]
    for row in result["rows"]:
        for mode in MODES:
            times = row[mode]
            assert 0 < times["ttft_s"] < times["tt2t_s"] <= times["e2e_s"], (mode, row)
            assert times["cached_tokens"] == 0  # fresh prompts: nothing from the prefix cache
        assert row["ttft_ratio"] > 0 and row["tt2t_ratio"] > 0
    runs = result["runs"]
    assert result["backend_used"] == "tcp"
    assert runs["whole"].streamed_pulls == 0 and runs["streamed"].streamed_pulls == 2
    for mode in MODES:
        assert all(s.tokens == 4 and s.prompt_tokens == n
                   for n, v in runs[mode].samples.items() for s in v)  # fmt: skip
    table = format_table(result)
    assert "TTFT at the largest prompt (80 tokens) <= 0.9x whole: M" in table
    assert "never worse for short prompts (<= 1.05x at the smallest, 40 tokens): M" in table
