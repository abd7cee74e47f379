"""Block digests: computed over the sender's source bytes, checked over the landed bytes.

Two real pools in one process stand in for the two sides; the plan is the real formatter's, and
"the transfer" is a byte copy along it, so what is checked is exactly what a backend would move.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from pdserve.cli import build_parser, resolve_config
from pdserve.config.loading import worker_config
from pdserve.config.settings import TransferSettings
from pdserve.errors import IntegrityError, TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer.formatter.mapping import Formatter, PoolGeometry, TransferPlan, pool_bytes
from pdserve.transfer.integrity import digests as integrity
from pdserve.transfer.integrity.digests import BlockDigester
from tests.support.transfer import apply_plan, pattern_pool, zeros_pool

LAYOUT = KVLayout(
    model="m", num_layers=3, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float32"
)
NUM_BLOCKS = 12
BLOCK_BYTES = LAYOUT.block_bytes_per_layer


def _plan(src_ids: list[int], dst_ids: list[int]) -> TransferPlan:
    src, dst = zeros_pool(LAYOUT, NUM_BLOCKS), zeros_pool(LAYOUT, NUM_BLOCKS)
    formatter = Formatter.negotiate(
        LAYOUT, LAYOUT, PoolGeometry.from_pool(src, LAYOUT), PoolGeometry.from_pool(dst, LAYOUT)
    )
    return formatter.plan(src_ids, dst_ids)


def _check(dst: torch.Tensor, plan: TransferPlan, digests: str, src_ids, dst_ids) -> None:
    BlockDigester(dst).check(
        plan,
        digests,
        request_id="r1",
        geometry=PoolGeometry.from_pool(dst, LAYOUT),
        block_map=dict(zip(dst_ids, src_ids, strict=True)),
    )


@pytest.fixture
def pools() -> tuple[torch.Tensor, torch.Tensor]:
    return pattern_pool(LAYOUT, NUM_BLOCKS), zeros_pool(LAYOUT, NUM_BLOCKS)


def test_bytes_moved_intact_to_other_block_ids_pass_the_check(pools) -> None:
    src, dst = pools
    src_ids, dst_ids = [3, 4, 5, 9], [10, 11, 0, 2]
    plan = _plan(src_ids, dst_ids)
    digests = BlockDigester(src).source(plan)
    apply_plan(plan, src, dst)
    _check(dst, plan, digests, src_ids, dst_ids)
    assert len(base64.b64decode(digests)) == 8 * len(plan) == 8 * 3 * 3  # 3 layers x 3 runs


def test_one_flipped_byte_raises_integrity_error_naming_request_layer_and_blocks(pools) -> None:
    src, dst = pools
    src_ids, dst_ids = [3, 4, 5, 9], [10, 11, 0, 2]
    plan = _plan(src_ids, dst_ids)
    digests = BlockDigester(src).source(plan)
    apply_plan(plan, src, dst)
    flat = pool_bytes(dst)
    offset = (1 * NUM_BLOCKS + 2) * BLOCK_BYTES + 5  # layer 1, decode block 2 <- prefill 9
    flat[offset] ^= 0x40
    with pytest.raises(
        IntegrityError,
        match=r"request r1: layer 1, decode block 2 \(prefill block 9\) arrived corrupted.*"
        r"1 of 9 segments differ",
    ):
        _check(dst, plan, digests, src_ids, dst_ids)


def test_corruption_inside_a_run_names_every_block_of_the_run(pools) -> None:
    src, dst = pools
    plan = _plan([3, 4, 5], [10, 11, 0])  # runs: 3,4 -> 10,11 and 5 -> 0
    digests = BlockDigester(src).source(plan)
    apply_plan(plan, src, dst)
    pool_bytes(dst)[(2 * NUM_BLOCKS + 11) * BLOCK_BYTES] ^= 1  # layer 2, block 11
    with pytest.raises(
        IntegrityError, match=r"layer 2, decode blocks \[10, 11\] \(prefill blocks \[3, 4\]\)"
    ):
        _check(dst, plan, digests, [3, 4, 5], [10, 11, 0])


def test_a_source_changed_after_the_digest_is_caught_on_arrival(pools) -> None:
    src, dst = pools
    plan = _plan([1], [1])
    digests = BlockDigester(src).source(plan)
    src[0, 1, 0, 0, 0, 0] += 1  # the block changed under the transfer
    apply_plan(plan, src, dst)
    with pytest.raises(IntegrityError, match="layer 0, decode block 1"):
        _check(dst, plan, digests, [1], [1])


def test_digests_of_another_plan_are_a_transfer_error_not_a_pass(pools) -> None:
    src, dst = pools
    plan = _plan([1, 5], [1, 5])
    digests = BlockDigester(src).source(_plan([1], [1]))
    with pytest.raises(TransferError, match="3 block digests for a 6-segment plan"):
        _check(dst, plan, digests, [1, 5], [1, 5])


def test_malformed_digests_are_a_transfer_error(pools) -> None:
    _, dst = pools
    with pytest.raises(TransferError, match="malformed block digests"):
        _check(dst, _plan([1], [1]), "not base64!", [1], [1])


def test_segment_digest_is_xxh3_64_of_exactly_the_segment_bytes() -> None:
    buf = bytearray(range(256)) * 4
    view = memoryview(buf)
    got = integrity.segment_digests(view, np.array([0, 100]), np.array([10, 500]))
    assert got.tolist() == [
        xxhash.xxh3_64_intdigest(buf[:10]),
        xxhash.xxh3_64_intdigest(buf[100:600]),
    ]
    assert integrity.decode(integrity.encode(got), 2).tolist() == got.tolist()
    with pytest.raises(TransferError, match="outside"):
        integrity.segment_digests(view, np.array([1000]), np.array([100]))


def test_a_staged_plan_is_digested_over_its_staging_buffer_not_the_pool(pools) -> None:
    src, dst = pools
    plan = _plan([0], [0])
    staging = torch.full((plan.nbytes,), 7, dtype=torch.uint8)
    staged = TransferPlan(
        np.arange(LAYOUT.num_layers, dtype=np.int64) * BLOCK_BYTES,
        plan.dst_offsets,
        plan.lengths,
        source=staging,
    )
    digests = BlockDigester(src).source(staged)
    for d in plan.dst_offsets.tolist():  # the bytes a backend moves out of the staging buffer
        pool_bytes(dst)[d : d + BLOCK_BYTES] = bytes([7]) * BLOCK_BYTES
    _check(dst, plan, digests, [0], [0])


def test_a_pool_that_is_not_in_host_memory_asks_to_switch_integrity_off() -> None:
    meta = torch.empty((3, 4, 2, 4, 2, 4), device="meta")
    with pytest.raises(TransferError, match="--no-kv-integrity"):
        BlockDigester(meta).source(_plan([0], [0]))


def test_integrity_is_on_by_default_and_the_cli_switch_turns_it_off_through_up() -> None:
    parser, model = build_parser(), Path("/models/m")

    def integrity(argv: list[str], role: str | None = None) -> bool:
        cfg, _ = resolve_config(parser.parse_args(argv), role, env={})
        return worker_config(cfg, "decode", model).transfer.integrity

    assert TransferSettings().integrity is True
    assert integrity(["decode"], "decode") is True
    assert integrity(["decode", "--no-kv-integrity"], "decode") is False
    # `up` writes one resolved config file that every child reads.
    assert integrity(["up", "--no-kv-integrity"]) is False
    assert integrity(["up"]) is True
