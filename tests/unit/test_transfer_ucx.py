"""The UCX Connection over a real ucxx library, two UCX workers in one process: tags, segments
scattered into their offsets, cancellation, failures. (Between processes:
tests/integration/test_transfer_backends.py and test_transfer_ucx.py.)"""

from __future__ import annotations

import base64
import multiprocessing as mp
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.config.settings import TransferSettings
from pdserve.errors import TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer import wire
from pdserve.transfer.agents.ucx import (
    SEGMENT_BITS,
    UcxBackend,
    UcxConnection,
    UcxRequests,
    UcxWorker,
    transfer_tag,
)
from pdserve.transfer.backend import TransferState
from pdserve.transfer.connection.handshake import LocalSide
from pdserve.transfer.formatter.mapping import PoolGeometry
from tests.support.transfer import TEST_KEY

pytest.importorskip("ucxx")


def test_importing_the_ucx_backend_module_does_not_import_ucxx():
    code = (
        "import sys, pdserve.transfer, pdserve.transfer.agents.ucx; "
        "print(any(m.split('.')[0] == 'ucxx' for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_transfer_tags_leave_the_segment_bits_free_and_differ_per_transfer():
    tags = {transfer_tag(f"{i:032x}") for i in range(1000)}
    assert len(tags) == 1000
    assert all(0 <= t < 2**64 and t & ((1 << SEGMENT_BITS) - 1) == 0 for t in tags)
    assert transfer_tag("abc") == transfer_tag("abc")


@pytest.fixture
def workers() -> Iterator[tuple[UcxWorker, UcxWorker]]:
    a, b = UcxWorker("lo"), UcxWorker("lo")
    yield a, b
    a.close()
    b.close()


def _wait(*transfers: UcxRequests, timeout: float = 10.0) -> list[TransferState]:
    deadline = time.monotonic() + timeout
    while TransferState.RUNNING in (states := [t.poll() for t in transfers]):  # each progresses
        assert time.monotonic() < deadline, "UCX requests did not complete"
    return states


def _pair(sender: UcxWorker, receiver: UcxWorker) -> tuple[UcxConnection, UcxConnection]:
    """The backend's two sides: an endpoint to the receiver's worker, and the receiver's
    cancellation scope (an endpoint to itself)."""
    return (
        UcxConnection(sender, receiver.address, "receiver"),
        UcxConnection(receiver, receiver.address, "scope"),
    )


def test_segments_land_at_their_offsets_and_nowhere_else(workers):
    a, b = workers
    out, scope = _pair(a, b)
    rng = np.random.default_rng(0)
    src = rng.integers(1, 256, size=8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    # 40 segments of 96 KiB (rendezvous) and 40 of 1 KiB (eager), shuffled offsets
    lengths = np.array([96 << 10] * 40 + [1 << 10] * 40, dtype=np.int64)
    src_off = rng.permutation(80).astype(np.int64) * (100 << 10)
    dst_off = rng.permutation(80).astype(np.int64) * (100 << 10)
    tag = transfer_tag("t1")
    inbound = scope.recv(memoryview(dst), dst_off, lengths, tag)
    outbound = out.send(memoryview(src), src_off, lengths, tag)
    assert _wait(inbound, outbound) == [TransferState.DONE, TransferState.DONE]
    mask = np.ones(dst.size, dtype=bool)
    for s, d, n in zip(src_off, dst_off, lengths, strict=True):
        assert np.array_equal(dst[d : d + n], src[s : s + n])
        mask[d : d + n] = False
    assert not dst[mask].any()


def test_abort_cancels_posted_receives_and_later_sends_write_nothing(workers):
    a, b = workers
    out, scope = _pair(a, b)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    offsets, lengths = np.array([0, 1 << 19]), np.array([64 << 10, 1 << 10])
    tag = transfer_tag("t2")
    inbound = scope.recv(memoryview(dst), offsets, lengths, tag)
    inbound.abort()
    assert scope.closed
    assert inbound.poll() is TransferState.FAILED  # cancelled, not silently done
    assert "Cancel" in (inbound.failure or "")
    with pytest.raises(TransferError, match="closed"):
        scope.recv(memoryview(dst), offsets, lengths, tag)
    src = np.full(1 << 20, 7, dtype=np.uint8)
    late = out.send(memoryview(src), offsets, lengths, tag)
    deadline = time.monotonic() + 0.5  # give the late messages every chance to land
    while time.monotonic() < deadline:
        late.poll()
        b.progress()
    assert not dst.any()
    # They wait, unexpected, for a receive of their tag: a new one gets them, not dst.
    spare = np.zeros_like(dst)
    again = UcxConnection(b, b.address, "scope 2").recv(memoryview(spare), offsets, lengths, tag)
    assert _wait(again, late) == [TransferState.DONE, TransferState.DONE]
    assert spare[offsets[0] : offsets[0] + lengths[0]].all() and not dst.any()


def _abort_sends_under_way(results: Any) -> None:
    """In a fresh process (see the test): a rendezvous send whose receiver never posts."""
    a, b = UcxWorker("lo"), UcxWorker("lo")
    out = UcxConnection(a, b.address, "receiver")
    src = np.ones(1 << 20, dtype=np.uint8)
    sends = out.send(memoryview(src), np.array([0]), np.array([1 << 20]), transfer_tag("t4"))
    for _ in range(200):  # the request-to-send reaches b, where nothing matches it
        sends.poll()
        b.progress()
    sends.abort()
    results.put((sends.poll().value, sends.failure or "", out.closed))
    a.close()
    b.close()


def test_abort_cancels_sends_under_way():
    # A fresh process: with UCX's registration cache off, which another UCX in the process
    # (NIXL's, from other tests) causes, UCX 1.21 crashes aborting a rendezvous send.
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_abort_sends_under_way, args=(results,))
    proc.start()
    state, failure, closed = results.get(timeout=60)
    proc.join(30)
    assert (state, closed, proc.exitcode) == ("failed", True, 0)
    assert "Cancel" in failure


def test_message_longer_than_its_receive_fails_the_transfer(workers):
    a, b = workers
    out, scope = _pair(a, b)
    src, dst = np.ones(64 << 10, dtype=np.uint8), np.zeros(64 << 10, dtype=np.uint8)
    tag = transfer_tag("t3")
    inbound = scope.recv(memoryview(dst), np.array([0]), np.array([16 << 10]), tag)
    outbound = out.send(memoryview(src), np.array([0]), np.array([32 << 10]), tag)
    state, _ = _wait(inbound, outbound)
    assert state is TransferState.FAILED
    assert "receiver" not in (inbound.failure or "") and "scope" in (inbound.failure or "")
    outbound.abort()


def test_more_segments_than_the_tag_space_holds_is_a_transfer_error(workers):
    a, _ = workers
    n = 1 << SEGMENT_BITS
    conn = UcxConnection(a, a.address, "self")
    buf = np.zeros(16, dtype=np.uint8)
    with pytest.raises(TransferError, match="tag space"):
        conn.send(memoryview(buf), np.zeros(n, np.int64), np.ones(n, np.int64), 0)
    conn.close()


def test_bad_peer_address_is_a_transfer_error(workers):
    a, _ = workers
    with pytest.raises(TransferError, match="UCX endpoint to nowhere"):
        UcxConnection(a, b"\x00" * 8, "nowhere")


LAYOUT = KVLayout(
    model="tiny-test", num_layers=2, num_kv_heads=1, head_dim=4, tokens_per_block=2, dtype="float32"
)


@pytest.fixture
def backend() -> Iterator[UcxBackend]:
    pool = torch.zeros(2, 4, 2, 2, 1, 4)
    b = UcxBackend(
        cfg=TransferSettings(backend="ucx", ucx_devices="lo"),
        pool=pool,
        geometry=PoolGeometry.from_pool(pool, LAYOUT),
        agent_name="unused",
    )
    yield b
    b.close()


def test_hello_carries_the_worker_address_for_the_prefill_side(backend):
    side = LocalSide(
        "decode-0",
        1,
        LAYOUT,
        PoolGeometry(2, 4, LAYOUT.block_bytes_per_layer),
        backend,
        key=TEST_KEY,
    )
    hello = wire.decode(wire.encode(side.hello())[wire.HEADER.size :])
    assert isinstance(hello, wire.Hello) and hello.backend == "ucx" and hello.nixl is None
    assert hello.ucx is not None
    assert base64.b64decode(hello.ucx.address_b64, validate=True)
    peer = backend.add_peer(hello)  # what the prefill side keeps for its endpoint
    assert peer.address == base64.b64decode(hello.ucx.address_b64)  # type: ignore[attr-defined]


def test_hello_without_a_ucx_address_is_refused(backend):
    hello = wire.Hello(worker_id="d", epoch=1, layout=LAYOUT, backend="ucx", num_blocks=4)
    with pytest.raises(TransferError, match="no UCX worker address"):
        backend.add_peer(hello)
