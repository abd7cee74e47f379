"""Transfer control frames, block-run coalescing and formatter decisions (no processes)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from pdserve.errors import ConfigError, HandleError, LayoutMismatchError, TransferError
from pdserve.protocol import PROTOCOL_VERSION, KVLayout
from pdserve.transfer import wire
from pdserve.transfer.formatter.mapping import (
    Formatter,
    IdentityFormatter,
    PoolGeometry,
    coalesce_runs,
    pool_bytes,
)
from tests.support.transfer import zeros_pool

LAYOUT = KVLayout(
    model="m", num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype="float32"
)
BB = LAYOUT.block_bytes_per_layer  # 512


def _geometry(num_blocks: int, layout: KVLayout = LAYOUT) -> PoolGeometry:
    return PoolGeometry(layout.num_layers, num_blocks, layout.block_bytes_per_layer)


MESSAGES = [
    wire.Hello(
        worker_id="d0",
        epoch=3,
        layout=LAYOUT,
        backend="nixl",
        num_blocks=64,
        nixl=wire.NixlPeerInfo(
            agent_name="a", metadata_b64="AAEC", pool_addr=1 << 40, pool_bytes=4096
        ),
    ),
    wire.HelloAck(
        ok=False,
        worker_id="p0",
        epoch=1,
        layout=LAYOUT,
        backend="tcp",
        num_blocks=8,
        code="kv_layout_mismatch",
        message="tokens_per_block: 4 != 8",
    ),
    wire.SendBlocks(
        request_id="r",
        epoch=1,
        lease_id="l",
        transfer_id="t",
        src_block_ids=(1, 2),
        dst_block_ids=(5, 6),
        integrity=True,
    ),
    wire.BlockData(transfer_id="t", nbytes=1 << 33),
    wire.TransferDone(transfer_id="t", nbytes=10),
    wire.TransferFailed(transfer_id="t", code="kv_handle_invalid", message="gone"),
    wire.Release(request_id="r", lease_id="l"),
    wire.BlockDigests(transfer_id="t", digests="AAAAAAAAAAA="),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.type)
def test_every_message_round_trips_through_a_frame(msg):
    frame = wire.encode(msg)
    length = wire.frame_length(frame[: wire.HEADER.size])
    assert length == len(frame) - wire.HEADER.size
    assert wire.decode(frame[wire.HEADER.size :]) == msg


def test_hello_carries_the_protocol_version():
    assert MESSAGES[0].protocol_version == PROTOCOL_VERSION


def test_oversized_frame_header_is_refused():
    with pytest.raises(TransferError, match="exceeds"):
        wire.frame_length(wire.HEADER.pack(wire.MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b'{"type": "bogus"}',
        b'{"type": "release"}',
        b'{"type": "release", "request_id": "r", "x": 1}',
    ],
)
def test_malformed_or_unknown_payload_is_a_transfer_error(payload):
    with pytest.raises(TransferError, match="malformed"):
        wire.decode(payload)


def test_peer_errors_come_back_as_the_same_class_with_their_message():
    assert type(wire.error_from_wire("kv_handle_invalid", "gone")) is HandleError
    assert type(wire.error_from_wire("kv_layout_mismatch", "x")) is LayoutMismatchError
    other = wire.error_from_wire(wire.BACKEND_MISMATCH, "nixl vs tcp")
    assert type(other) is TransferError
    assert (other.code, other.message) == (wire.BACKEND_MISMATCH, "nixl vs tcp")


def test_expect_done_raises_the_peers_failure_and_rejects_other_transfers():
    assert wire.expect_done(wire.TransferDone(transfer_id="t", nbytes=7), "t") == 7
    with pytest.raises(HandleError, match="gone"):
        wire.expect_done(MESSAGES[5], "t")
    with pytest.raises(TransferError, match="unexpected"):
        wire.expect_done(wire.TransferDone(transfer_id="other", nbytes=7), "t")


@pytest.mark.parametrize(
    ("src", "dst", "runs"),
    [
        ([3, 4, 5, 9], [10, 11, 0, 1], [(3, 10, 2), (5, 0, 1), (9, 1, 1)]),
        ([0, 1, 2, 3], [4, 5, 6, 7], [(0, 4, 4)]),
        ([7], [2], [(7, 2, 1)]),
        ([5, 4, 3], [0, 1, 2], [(5, 0, 1), (4, 1, 1), (3, 2, 1)]),
        ([1, 2, 3], [9, 3, 4], [(1, 9, 1), (2, 3, 2)]),
    ],
)
def test_runs_are_maximal_and_consecutive_on_both_sides(src, dst, runs):
    s, d, n = coalesce_runs(src, dst)
    assert list(zip(s.tolist(), d.tolist(), n.tolist(), strict=True)) == runs


def test_identity_plan_is_one_segment_per_layer_per_run():
    f = IdentityFormatter(_geometry(16), _geometry(32))
    plan = f.plan([3, 4, 9], [10, 11, 0])
    # layer-major; src layer stride 16 blocks, dst layer stride 32 blocks
    assert plan.src_offsets.tolist() == [b * BB for b in (3, 9, 19, 25, 35, 41)]
    assert plan.dst_offsets.tolist() == [b * BB for b in (10, 0, 42, 32, 74, 64)]
    assert plan.lengths.tolist() == [2 * BB, BB] * 3
    assert plan.nbytes == 3 * 3 * BB and len(plan) == 6


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([1, 2], [3], "2 source blocks but 1 destination"),
        ([], [], "at least one block"),
        ([16], [0], "source block id out of range"),
        ([0], [32], "destination block id out of range"),
        ([0, 1], [5, 5], "duplicate destination"),
    ],
)
def test_plan_refuses_bad_block_ids(src, dst, match):
    with pytest.raises(TransferError, match=match):
        IdentityFormatter(_geometry(16), _geometry(32)).plan(src, dst)


def test_equal_layouts_negotiate_the_identity_formatter():
    f = Formatter.negotiate(LAYOUT, LAYOUT, _geometry(4), _geometry(8))
    assert isinstance(f, IdentityFormatter)


def test_unmappable_layouts_are_refused_naming_every_unmappable_field():
    other = LAYOUT.model_copy(update={"num_kv_heads": 4, "head_dim": 16, "dtype": "bfloat16"})
    with pytest.raises(LayoutMismatchError) as info:
        Formatter.negotiate(LAYOUT, other, _geometry(4), _geometry(4, other))
    assert "num_kv_heads: 2 != 4" in info.value.message
    assert "head_dim: 8 != 16" in info.value.message
    assert "num_layers" not in info.value.message and "dtype:" not in info.value.message


def test_pool_geometry_matches_the_documented_offsets():
    pool = zeros_pool(LAYOUT, 5)
    g = PoolGeometry.from_pool(pool, LAYOUT)
    assert (g.num_blocks, g.block_bytes, g.nbytes) == (5, BB, pool.numel() * 4)
    pool[2, 3] = 1.0  # layer 2, block 3
    view = np.frombuffer(pool_bytes(pool), dtype=np.uint8)
    start = (2 * 5 + 3) * BB
    assert np.flatnonzero(view).min() >= start and np.flatnonzero(view).max() < start + BB


@pytest.mark.parametrize(
    ("pool", "match"),
    [
        (torch.zeros(3, 5, 2, 4, 2, 9), "shape"),
        (torch.zeros(3, 5, 2, 4, 2, 8, dtype=torch.float16), "dtype"),
        (torch.zeros(5, 3, 2, 4, 2, 8).transpose(0, 1), "contiguous"),
    ],
)
def test_pool_that_does_not_match_the_layout_is_a_config_error(pool, match):
    with pytest.raises(ConfigError, match=match):
        PoolGeometry.from_pool(pool, LAYOUT)


def test_pool_bytes_views_bfloat16_without_copying():
    layout = LAYOUT.model_copy(update={"dtype": "bfloat16"})
    pool = zeros_pool(layout, 2)
    view = pool_bytes(pool)
    assert len(view) == pool.numel() * 2
    view[0:2] = bytes([0x80, 0x3F])  # bfloat16 1.0, little endian
    assert pool.view(-1)[0].item() == 1.0


def test_importing_the_package_does_not_import_nixl():
    code = "import sys, pdserve.transfer; print(any('nixl' in m for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
