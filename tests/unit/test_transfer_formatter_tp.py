"""The formatter maps KV heads between tensor parallel layouts (TP=m prefill -> TP=n decode).

Pure tensor logic, as ``test_transfer_formatter``: a plan is applied the way a backend applies
it and every decode rank's shard is compared, token by token, with the heads that rank owns in
one full-head pool both sides were cut from.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.errors import LayoutMismatchError
from pdserve.protocol import KVLayout
from pdserve.transfer.formatter.mapping import (
    ConvertingFormatter,
    Formatter,
    HeadPart,
    IdentityFormatter,
    PoolGeometry,
    head_map,
)
from pdserve.workers.kv.manager import blocks_for_tokens
from tests.support.fakes import layout
from tests.support.transfer import apply_plan, random_pool, shard_pool, token_kv, zeros_pool

SRC_BLOCKS, DST_BLOCKS = 24, 20


def _layout(kvh: int, tp: int, **kw: object) -> KVLayout:
    base = layout(model="m", num_layers=3, head_dim=4, num_kv_heads=kvh, **kw)  # type: ignore[arg-type]
    return KVLayout(**{**base.model_dump(), "tp_size": tp})


def test_rank_heads_split_and_replicate() -> None:
    assert [list(_layout(3, 3).rank_heads(r)) for r in range(3)] == [[0], [1], [2]]
    assert [list(_layout(4, 2).rank_heads(r)) for r in range(2)] == [[0, 1], [2, 3]]
    # fewer KV heads than ranks: each head on tp / kvh ranks (vLLM's replication)
    assert [list(_layout(2, 4).rank_heads(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert _layout(2, 4).block_bytes == 4 * _layout(2, 1).block_bytes // 2
    with pytest.raises(ValueError, match="3 KV heads cannot be split over tp_size 2"):
        _layout(3, 2)


def test_head_map_split_merge() -> None:
    assert head_map(_layout(3, 1), _layout(3, 3)) == tuple(
        (HeadPart(0, range(r, r + 1), range(0, 1)),) for r in range(3)
    )
    assert head_map(_layout(3, 3), _layout(3, 1)) == (
        tuple(HeadPart(r, range(0, 1), range(r, r + 1)) for r in range(3)),
    )
    # replicated source heads are read once, from the first rank that holds them
    assert head_map(_layout(2, 4), _layout(2, 1)) == (
        (HeadPart(0, range(0, 1), range(0, 1)), HeadPart(2, range(0, 1), range(1, 2))),
    )


@pytest.mark.parametrize(
    ("kvh", "m", "n", "dst_tpb", "dst_dtype"),
    [
        (3, 1, 3, 16, "float32"),  # SmolLM2's heads: split
        (3, 3, 1, 16, "float32"),  # merge
        (2, 1, 2, 16, "float32"),
        (2, 2, 1, 16, "float32"),
        (2, 2, 4, 16, "float32"),  # into replicated heads
        (2, 4, 2, 16, "float32"),  # out of replicated heads
        (4, 4, 2, 32, "bfloat16"),  # merge + re-block + narrow in the same pass
        (3, 1, 3, 8, "bfloat16"),  # split + re-block + narrow
        (2, 2, 2, 32, "float32"),  # same split, other block size
    ],
)
@pytest.mark.parametrize("num_tokens", [5, 40])
def test_mapped_transfer_lands_each_rank_its_heads(
    kvh: int, m: int, n: int, dst_tpb: int, dst_dtype: str, num_tokens: int
) -> None:
    src = _layout(kvh, m)
    dst = _layout(kvh, n, tokens_per_block=dst_tpb, dtype=dst_dtype)
    full = random_pool(_layout(kvh, 1), SRC_BLOCKS, seed=m * 10 + n)
    src_pool = shard_pool(full, src)
    src_ids = [7, 8, 2, 11][: blocks_for_tokens(num_tokens, 16)]
    dst_ids = [3, 4, 5, 0, 9, 10, 1][: blocks_for_tokens(num_tokens, dst_tpb)]
    formatter = Formatter.negotiate(
        src, dst, PoolGeometry.from_pool(src_pool, src), PoolGeometry.of_layout(dst, DST_BLOCKS)
    )
    assert isinstance(formatter, ConvertingFormatter)
    plan = formatter.plan(src_ids, dst_ids)
    buf = torch.full((formatter.staging_nbytes(len(dst_ids)),), 0xEE, dtype=torch.uint8)
    plan = plan.with_source(formatter.stage(src_pool, src_ids, len(dst_ids), buf))
    dst_pool = zeros_pool(dst, DST_BLOCKS)
    apply_plan(plan, src_pool, dst_pool)
    expected = token_kv(full, src_ids, num_tokens).to(getattr(torch, dst_dtype))
    shards = dst_pool.unbind(0) if n > 1 else (dst_pool,)
    for rank, shard in enumerate(shards):
        heads = dst.rank_heads(rank)
        got = token_kv(shard, dst_ids, num_tokens)
        assert torch.equal(got, expected[..., heads.start : heads.stop, :]), f"rank {rank}"
    # exactly the heads each decode rank owns travel: the destination shards' bytes
    assert plan.nbytes == n * dst.num_layers * len(dst_ids) * dst.block_bytes_per_layer


def test_equal_tensor_parallel_layouts_move_shard_by_shard() -> None:
    src = _layout(4, 2)
    full = random_pool(_layout(4, 1), SRC_BLOCKS, seed=3)
    src_pool = shard_pool(full, src)
    formatter = Formatter.negotiate(
        src, src, PoolGeometry.from_pool(src_pool, src), PoolGeometry.of_layout(src, DST_BLOCKS)
    )
    assert isinstance(formatter, IdentityFormatter)
    plan = formatter.plan([4, 5, 9], [0, 1, 2])
    assert len(plan) == 2 * 3 * 2  # shards x layers x runs
    dst_pool = zeros_pool(src, DST_BLOCKS)
    apply_plan(plan, src_pool, dst_pool)
    assert torch.equal(dst_pool[:, :, [0, 1, 2]], src_pool[:, :, [4, 5, 9]])


def test_pool_geometry_checks_the_rank_dimension() -> None:
    lay = _layout(4, 2)
    geometry = PoolGeometry.from_pool(zeros_pool(lay, 6), lay)
    assert (geometry.num_shards, geometry.num_blocks) == (2, 6)
    assert geometry.nbytes == 2 * geometry.shard_nbytes == 6 * lay.block_bytes
    with pytest.raises(Exception, match="does not match layout"):
        PoolGeometry.from_pool(zeros_pool(_layout(4, 1), 6), lay)


def test_different_heads_are_refused() -> None:
    with pytest.raises(LayoutMismatchError, match="num_kv_heads: 4 != 2"):
        Formatter.negotiate(
            _layout(4, 2),
            _layout(2, 2),
            PoolGeometry.of_layout(_layout(4, 2), 4),
            PoolGeometry.of_layout(_layout(2, 2), 4),
        )
