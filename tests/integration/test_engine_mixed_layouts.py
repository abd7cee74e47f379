"""Greedy tokens through the formatter: a prefill engine and a decode engine of different KV
layouts (tokens per block, KV dtype) resume exactly as engines of matched layouts do.

In-process engines on the tiny model; the prefill leg parks its blocks, the formatter plans
(and, for mixed layouts, stages) the transfer as the prefill worker's sender does, the bytes move
segment by segment as a backend moves them, and the decode engine resumes. Every pair compared
is one where the decode engine attends over bit-identical values, so equality is exact by
construction (see each case); a bfloat16 cache read by a float32 model would not be (it rounds
values a float32 cache keeps), which is why no case pairs those against each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.protocol import SamplingParams
from pdserve.transfer.formatter.mapping import Formatter, PoolGeometry, pool_bytes
from pdserve.workers.engine.engine import Engine, EngineRequest
from tests.support.engine import joined, make_engine, run

PROMPTS = [
    [1, 72, 101, 108, 108, 111],
    list(range(40, 90)),  # several blocks on either side
    [1, *range(100, 131)],  # exactly 2 blocks of 16, 1 of 32
    [1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110] * 3,
]
SAMPLING = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[dict[tuple[str, str, int], Engine]]:
    """Engines by (model dtype, KV dtype, tokens per block), made on first use."""
    made: dict[tuple[str, str, int], Engine] = {}

    class Engines(dict[tuple[str, str, int], Engine]):
        def __missing__(self, key: tuple[str, str, int]) -> Engine:
            dtype, kv_dtype, tpb = key
            made[key] = make_engine(
                tiny_model_dir, dtype=dtype, kv_dtype=kv_dtype, tokens_per_block=tpb
            )
            return made[key]

    yield Engines()
    for engine in made.values():
        engine.shutdown()


def _transfer(prefill: Engine, src_ids: list[int], decode: Engine, dst_ids: list[int]) -> None:
    """What the transceivers do: negotiate, plan, stage (mixed layouts), move the segments."""
    src_pool, dst_pool = prefill.kv_cache.pool, decode.kv_cache.pool
    formatter = Formatter.negotiate(
        prefill.layout,
        decode.layout,
        PoolGeometry.from_pool(src_pool, prefill.layout),
        PoolGeometry.from_pool(dst_pool, decode.layout),
    )
    plan = formatter.plan(src_ids, dst_ids)
    source = src_pool
    if formatter.staged:
        buf = torch.empty(formatter.staging_nbytes(len(dst_ids)), dtype=torch.uint8)
        source = formatter.stage(src_pool, src_ids, len(dst_ids), buf)
    src, dst = pool_bytes(source), pool_bytes(dst_pool)
    for s, d, n in zip(plan.src_offsets, plan.dst_offsets, plan.lengths, strict=True):
        dst[d : d + n] = src[s : s + n]


def _split(prefill: Engine, decode: Engine, rid: str, prompt: list[int]) -> list[int]:
    (first,) = run(prefill, [EngineRequest(rid, prompt, SAMPLING, mode="prefill")])[rid]
    assert first.parked_block_ids is not None
    dst_ids = decode.reserve(rid, prompt, SAMPLING).block_ids
    _transfer(prefill, first.parked_block_ids, decode, dst_ids)
    prefill.free_parked(rid)
    resume = EngineRequest(rid, prompt, SAMPLING, mode="resume", first_token=first.token_ids[0])
    return joined([first, *run(decode, [resume])[rid]]).token_ids


@pytest.mark.parametrize(
    ("mixed", "matched"),
    [
        # same values, other blocks: 16 -> 32 and 32 -> 16 tokens per block
        ((("float32", "float32", 16), ("float32", "float32", 32)),
         (("float32", "float32", 16), ("float32", "float32", 16))),
        ((("float32", "float32", 32), ("float32", "float32", 16)),
         (("float32", "float32", 32), ("float32", "float32", 32))),
        # bfloat16 prefill cache into a float32 decode cache (and 16 -> 32): the model computes
        # in bfloat16, so widening is exact and the decode reads back the same bfloat16 values
        ((("bfloat16", "bfloat16", 16), ("bfloat16", "float32", 32)),
         (("bfloat16", "bfloat16", 16), ("bfloat16", "bfloat16", 16))),
        # float32 prefill cache into a bfloat16 decode cache: the formatter rounds exactly as
        # the matched prefill engine rounds when it writes its own bfloat16 cache
        ((("float32", "float32", 16), ("float32", "bfloat16", 16)),
         (("float32", "bfloat16", 16), ("float32", "bfloat16", 16))),
        # FP8: a float32 prefill cache narrowed into an FP8 decode cache (and re-blocked) rounds
        # (and saturates) as an FP8 prefill engine does when it writes its own cache
        ((("float32", "float32", 16), ("float32", "fp8_e4m3", 32)),
         (("float32", "fp8_e4m3", 16), ("float32", "fp8_e4m3", 16))),
        # FP8 into FP8 of another block size: the bytes move unchanged
        ((("float32", "fp8_e5m2", 16), ("float32", "fp8_e5m2", 32)),
         (("float32", "fp8_e5m2", 16), ("float32", "fp8_e5m2", 16))),
    ],
)  # fmt: skip
def test_mixed_layouts_give_the_same_greedy_tokens_as_matched_layouts(engines, mixed, matched):
    for i, prompt in enumerate(PROMPTS):
        want = _split(engines[matched[0]], engines[matched[1]], f"matched-{i}", prompt)
        got = _split(engines[mixed[0]], engines[mixed[1]], f"mixed-{i}", prompt)
        assert got == want, f"prompt {i}"
        assert len(got) == SAMPLING.max_tokens
