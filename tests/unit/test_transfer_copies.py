"""The copy counter (:mod:`pdserve.transfer.formatter.copies`): its arithmetic, what in-process pulls count
into it on both sides (the inproc backend, and tcp on loopback), and its Prometheus export.
tests/integration/test_transfer_copies.py counts nixl, ucx and tcp between two processes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.transfer.agents.inproc import FABRIC, InprocBackend
from pdserve.transfer.formatter.copies import (
    FORMATTER_STAGING,
    HOST_STAGING,
    RECEIVE,
    SEND,
    SOCKET,
    CopyCounter,
    path_copies,
)
from pdserve.transfer.formatter.mapping import PoolGeometry
from pdserve.workers.kv.manager import blocks_for_tokens
from pdserve.workers.roles.worker_metrics import WorkerMetrics
from tests.support.transfer import LAYOUT, backend_cfg, zeros_pool
from tests.support.transfer_inproc import LocalPrefill, decode_side

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(autouse=True)
def _clean_fabric() -> Iterator[None]:
    FABRIC.reset()
    yield
    FABRIC.reset()


def test_copies_per_byte_is_staged_over_payload_bytes_per_side() -> None:
    sender, receiver = CopyCounter(), CopyCounter()
    assert sender.copies_per_byte() == 0.0  # nothing moved yet: no division by zero
    for _ in range(2):
        sender.sent(1000)
        sender.copied(SEND, FORMATTER_STAGING, 1000)
        sender.copied(SEND, SOCKET, 1000)
        receiver.received(1000)
    receiver.copied(RECEIVE, HOST_STAGING, 1000)  # one of the two receives went via the host
    assert sender.transfers == {SEND: 2, RECEIVE: 0}
    assert sender.copies_per_byte(SEND) == 2.0 and sender.copies_per_byte(RECEIVE) == 0.0
    assert receiver.copies_per_byte() == 0.5
    assert path_copies(sender, receiver) == 2.5
    assert "send/socket" in repr(sender)


@pytest.mark.parametrize(
    ("backend", "decode_tokens_per_block", "expected"),
    [
        ("inproc", LAYOUT.tokens_per_block, 0),  # pool to pool
        ("inproc", 2 * LAYOUT.tokens_per_block, 1),  # + the formatter's staging buffer
        ("tcp", LAYOUT.tokens_per_block, 1),  # the socket
        ("tcp", 2 * LAYOUT.tokens_per_block, 2),  # the staging buffer, then the socket
    ],
)
async def test_an_in_process_pull_counts_its_payload_and_staging_copies_on_both_sides(
    backend: str, decode_tokens_per_block: int, expected: int
) -> None:
    cfg = backend_cfg(backend, timeout_s=5.0)
    layout = LAYOUT.model_copy(update={"tokens_per_block": decode_tokens_per_block})
    num_tokens = 14
    dst_ids = [9, 3, 5, 1][: blocks_for_tokens(num_tokens, decode_tokens_per_block)]
    async with LocalPrefill(cfg) as prefill, decode_side(cfg, layout) as (decode, _):
        await decode.pull(prefill.park(num_tokens), dst_ids)
        sent, received = prefill.transceiver.copies, decode.copies
    nbytes = len(dst_ids) * layout.num_layers * layout.block_bytes_per_layer
    assert sent.payload == {SEND: nbytes, RECEIVE: 0}
    assert received.payload == {SEND: 0, RECEIVE: nbytes}
    assert sent.staged[SEND, FORMATTER_STAGING] == nbytes * (expected - (backend == "tcp"))
    assert path_copies(sent, received) == expected


def test_worker_metrics_export_payload_and_staged_bytes_by_side_and_stage() -> None:
    copies = CopyCounter()
    copies.sent(4096)
    copies.copied(SEND, SOCKET, 4096)
    metrics = WorkerMetrics("prefill", lambda: None, lambda: 0)
    metrics.add_kv_copies(copies)
    copies.received(100)  # read at scrape time
    text = metrics.render().decode()
    assert 'pdserve_kv_transfer_payload_bytes_total{side="send"} 4096.0' in text
    assert 'pdserve_kv_transfer_payload_bytes_total{side="receive"} 100.0' in text
    assert 'pdserve_kv_transfer_staged_bytes_total{side="send",stage="socket"} 4096.0' in text
    assert (
        'pdserve_kv_transfer_staged_bytes_total{side="receive",stage="formatter_staging"} 0.0'
        in text
    )


def test_a_backend_outside_a_transceiver_has_a_counter_of_its_own_until_one_is_set() -> None:
    pool = zeros_pool(LAYOUT, 4)
    geometry = PoolGeometry.from_pool(pool, LAYOUT)
    one, two = (
        InprocBackend(cfg=backend_cfg("inproc"), pool=pool, geometry=geometry, agent_name=name)
        for name in ("one", "two")
    )
    assert one.copies is one.copies and one.copies is not two.copies  # not a shared default
    mine = CopyCounter()
    one.copies = mine
    assert one.copies is mine
