"""The formatter maps one KV layout onto another: re-blocking, dtype conversion, refusals.

Pure tensor logic, no processes: a plan is applied here the way a backend applies it (bytes at
``src_offsets`` of the source memory land at ``dst_offsets`` of the decode pool), and the
decode pool is then read back token by token.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve.errors import LayoutMismatchError, TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer.formatter import convert
from pdserve.transfer.formatter.mapping import (
    ConvertingFormatter,
    Formatter,
    IdentityFormatter,
    PoolGeometry,
    TransferPlan,
)
from pdserve.workers.kv.manager import blocks_for_tokens
from tests.support.fakes import layout
from tests.support.transfer import apply_plan, random_pool, token_kv, zeros_pool

shaped = functools.partial(layout, model="m", num_layers=3, head_dim=4)  # the shared factory
BASE = shaped()  # 2 KV heads, 16-token float32 blocks
SRC_BLOCKS, DST_BLOCKS = 24, 20


def _formatter(src: KVLayout, dst: KVLayout, src_pool: torch.Tensor) -> Formatter:
    dst_geometry = PoolGeometry(dst.num_layers, DST_BLOCKS, dst.block_bytes_per_layer)
    return Formatter.negotiate(src, dst, PoolGeometry.from_pool(src_pool, src), dst_geometry)


def _send(
    formatter: Formatter, src_pool: torch.Tensor, src_ids: list[int], dst_ids: list[int]
) -> tuple[torch.Tensor, TransferPlan]:
    """Plan and stage as the sender does (the staging buffer starts as garbage), then move the
    bytes as a backend does; returns the decode pool (zeros elsewhere) and the sender's plan."""
    plan = formatter.plan(src_ids, dst_ids)
    if formatter.staged:
        buf = torch.full((formatter.staging_nbytes(len(dst_ids)),), 0xEE, dtype=torch.uint8)
        plan = plan.with_source(formatter.stage(src_pool, src_ids, len(dst_ids), buf))
    assert isinstance(formatter, ConvertingFormatter)
    dst_pool = zeros_pool(formatter.dst_layout, DST_BLOCKS)
    apply_plan(plan, src_pool, dst_pool)
    return dst_pool, plan


@pytest.mark.parametrize(
    ("src_tpb", "dst_tpb", "num_tokens"),
    [
        (16, 32, 40),  # two source blocks per destination block, last one half full
        (16, 32, 64),  # exactly full blocks on both sides
        (16, 32, 5),
        (32, 16, 40),  # each source block splits into two destination blocks
        (32, 16, 33),
        (16, 24, 17),  # no whole ratio: 2 source blocks, 1 destination block
        (24, 16, 50),
        (16, 48, 97),
    ],
)
def test_reblocking_reproduces_every_token_in_the_destination_blocks(src_tpb, dst_tpb, num_tokens):
    src, dst = shaped(tokens_per_block=src_tpb), shaped(tokens_per_block=dst_tpb)
    src_pool = random_pool(src, SRC_BLOCKS, 1)
    src_ids = [7, 2, 19, 3, 4, 11, 0][: blocks_for_tokens(num_tokens, src_tpb)]
    dst_ids = [9, 10, 4, 15, 1][: blocks_for_tokens(num_tokens, dst_tpb)]
    formatter = _formatter(src, dst, src_pool)
    assert isinstance(formatter, ConvertingFormatter)
    dst_pool, _ = _send(formatter, src_pool, src_ids, dst_ids)
    assert torch.equal(
        token_kv(dst_pool, dst_ids, num_tokens), token_kv(src_pool, src_ids, num_tokens)
    )
    others = [b for b in range(DST_BLOCKS) if b not in dst_ids]
    assert not dst_pool[:, others].any()


def test_destination_slots_past_the_source_blocks_are_zeroed():
    src, dst = shaped(tokens_per_block=16), shaped(tokens_per_block=32)
    src_pool = random_pool(src, SRC_BLOCKS, 2)
    dst_pool, _ = _send(_formatter(src, dst, src_pool), src_pool, [5, 6, 7], [3, 8])
    # 3 source blocks = 48 slots; destination block 8 holds tokens 32..63, 48..63 have no source
    assert torch.equal(dst_pool[:, 8, :, :16], src_pool[:, 7])
    assert not dst_pool[:, 8, :, 16:].any()


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"),
    [("bfloat16", "float32"), ("float16", "float32"), ("float32", "bfloat16"),
     ("bfloat16", "float16")],
)  # fmt: skip
@pytest.mark.parametrize(("src_tpb", "dst_tpb"), [(16, 16), (16, 32), (32, 16)])
def test_dtype_conversion_equals_tensor_to_for_every_token(src_dtype, dst_dtype, src_tpb, dst_tpb):
    src, dst = (
        shaped(tokens_per_block=src_tpb, dtype=src_dtype),
        shaped(tokens_per_block=dst_tpb, dtype=dst_dtype),
    )
    src_pool = random_pool(src, SRC_BLOCKS, 3)
    num_tokens = 45
    src_ids = [12, 13, 14, 1][: blocks_for_tokens(num_tokens, src_tpb)]
    dst_ids = [0, 6, 7][: blocks_for_tokens(num_tokens, dst_tpb)]
    dst_pool, _ = _send(_formatter(src, dst, src_pool), src_pool, src_ids, dst_ids)
    assert dst_pool.dtype == getattr(torch, dst_dtype)
    expected = token_kv(src_pool, src_ids, num_tokens).to(dst_pool.dtype)
    assert torch.equal(token_kv(dst_pool, dst_ids, num_tokens), expected)


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype", "src_tpb", "dst_tpb"),
    [("float32", "fp8_e4m3", 16, 16), ("float32", "fp8_e4m3", 16, 32),
     ("bfloat16", "fp8_e5m2", 16, 16), ("fp8_e4m3", "float32", 16, 32),
     ("fp8_e5m2", "bfloat16", 16, 16), ("fp8_e4m3", "fp8_e4m3", 16, 32)],
)  # fmt: skip
def test_fp8_kv_converts_like_tensor_to_and_moves_as_bytes(src_dtype, dst_dtype, src_tpb, dst_tpb):
    """FP8 pools (one byte a value) convert to and from the other dtypes as ``Tensor.to``
    does; FP8 into FP8 (another block size) moves the bytes unchanged."""
    src = shaped(tokens_per_block=src_tpb, dtype=src_dtype)
    dst = shaped(tokens_per_block=dst_tpb, dtype=dst_dtype)
    src_pool = random_pool(src, SRC_BLOCKS, 5)
    src_ids, dst_ids = (
        [12, 13, 14][: blocks_for_tokens(45, src_tpb)],
        [0, 6, 7][: blocks_for_tokens(45, dst_tpb)],
    )
    dst_pool, _ = _send(_formatter(src, dst, src_pool), src_pool, src_ids, dst_ids)
    assert dst_pool.dtype == convert.torch_dtype(dst_dtype)
    expected = token_kv(src_pool, src_ids, 45).to(dst_pool.dtype)
    got = token_kv(dst_pool, dst_ids, 45)
    assert (
        torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        if dst_pool.dtype.itemsize == 1
        else torch.equal(got, expected)
    )


def test_bfloat16_into_float32_keeps_every_bit():
    src, dst = (
        shaped(tokens_per_block=16, dtype="bfloat16"),
        shaped(tokens_per_block=32, dtype="float32"),
    )
    src_pool = random_pool(src, SRC_BLOCKS, 4)
    dst_pool, _ = _send(_formatter(src, dst, src_pool), src_pool, [1, 2], [3])
    assert torch.equal(
        token_kv(dst_pool, [3], 32).to(torch.bfloat16), token_kv(src_pool, [1, 2], 32)
    )


def test_converting_plan_is_one_segment_per_layer_per_destination_run():
    src, dst = (
        shaped(tokens_per_block=16),
        shaped(tokens_per_block=32, dtype="bfloat16"),
    )
    f = _formatter(src, dst, zeros_pool(src, SRC_BLOCKS))
    plan = f.plan([0, 9, 4, 5, 6, 2], [10, 11, 3])  # destination runs (10, 11) and (3,)
    bb = dst.block_bytes_per_layer  # staging blocks are destination blocks
    assert plan.lengths.tolist() == [2 * bb, bb] * 3
    assert plan.src_offsets.tolist() == [0, 2 * bb, 3 * bb, 5 * bb, 6 * bb, 8 * bb]
    assert plan.dst_offsets.tolist() == [
        (layer * DST_BLOCKS + block) * bb for layer in range(3) for block in (10, 3)
    ]
    assert plan.source is None  # the sender attaches its staging buffer; the receiver never
    assert f.staging_nbytes(3) >= 3 * 3 * bb + 3 * 3 * src.block_bytes_per_layer


def test_equal_layouts_keep_the_zero_copy_identity_path():
    f = _formatter(BASE, BASE, zeros_pool(BASE, SRC_BLOCKS))
    assert isinstance(f, IdentityFormatter) and not f.staged
    assert f.staging_nbytes(4) == 0
    with pytest.raises(TransferError, match="nothing to stage"):
        f.stage(zeros_pool(BASE, SRC_BLOCKS), [1], 1, torch.empty(0, dtype=torch.uint8))


@pytest.mark.parametrize(
    ("update", "named"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads: 2 != 3"),
        ({"head_dim": 8, "tokens_per_block": 32}, "head_dim: 4 != 8"),
        ({"num_layers": 4}, "num_layers: 3 != 4"),
        ({"model": "other", "dtype": "bfloat16"}, "model: 'm' != 'other'"),
    ],
)
def test_unmappable_layouts_are_refused_at_negotiation_naming_only_those_fields(update, named):
    other = BASE.model_copy(update=update)
    geometry = PoolGeometry(other.num_layers, DST_BLOCKS, other.block_bytes_per_layer)
    with pytest.raises(LayoutMismatchError, match="cannot be mapped") as info:
        Formatter.negotiate(
            BASE, other, PoolGeometry.from_pool(zeros_pool(BASE, 4), BASE), geometry
        )
    assert named in info.value.message
    assert "tokens_per_block:" not in info.value.message and "dtype:" not in info.value.message
    assert not BASE.can_map_to(other)


def test_layouts_differing_in_block_size_and_dtype_can_be_mapped_both_ways():
    other = shaped(tokens_per_block=32, dtype="bfloat16")
    assert BASE.can_map_to(other) and other.can_map_to(BASE)
    assert BASE.describe_unmappable(other) == ""


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "match"),
    [
        ([1, 2, 3], [4], "hold no common token count"),  # 33..48 tokens need 2 blocks of 32
        ([1], [4, 5], "hold no common token count"),
        ([], [], "at least one block"),
        ([24], [0], "source block id out of range"),
        ([0, 1], [20], "destination block id out of range"),
        ([0, 1, 2, 3], [5, 5], "duplicate destination"),
    ],
)
def test_converting_plan_refuses_block_counts_and_ids_that_cannot_be_a_request(
    src_ids, dst_ids, match
):
    src, dst = shaped(tokens_per_block=16), shaped(tokens_per_block=32)
    with pytest.raises(TransferError, match=match):
        _formatter(src, dst, zeros_pool(src, SRC_BLOCKS)).plan(src_ids, dst_ids)


@pytest.mark.parametrize("scratch_rows", [1, 3, 7])
def test_conversion_in_scratch_sized_chunks_reproduces_every_token(monkeypatch, scratch_rows):
    src, dst = (
        shaped(tokens_per_block=16, dtype="float32"),
        shaped(tokens_per_block=32, dtype="bfloat16"),
    )
    row_bytes = 16 * src.num_kv_heads * src.head_dim * 4  # gcd(16, 32) tokens of float32
    monkeypatch.setattr(convert, "SCRATCH_BYTES", scratch_rows * row_bytes)
    src_pool = random_pool(src, SRC_BLOCKS, 5)
    src_ids, dst_ids = [3, 9, 10, 11, 0], [1, 7, 8]  # 80 tokens
    formatter = _formatter(src, dst, src_pool)
    assert formatter.staging_nbytes(3) < 3 * 3 * dst.block_bytes_per_layer + 64 + 8 * row_bytes
    dst_pool, _ = _send(formatter, src_pool, src_ids, dst_ids)
    expected = token_kv(src_pool, src_ids, 80).to(torch.bfloat16)
    assert torch.equal(token_kv(dst_pool, dst_ids, 80), expected)
