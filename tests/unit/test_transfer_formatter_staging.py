"""The staging buffers a converting send reads from: lent one per send, reused, grown, registered
with the backend exactly while they exist; and the decode side's handle check under the formatter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.errors import LayoutMismatchError, TransferError
from pdserve.protocol import KVLayout
from pdserve.transfer.backend import Backend, Digests, Outbound, Peer
from pdserve.transfer.connection.control import Connection
from pdserve.transfer.formatter.mapping import Formatter, PoolGeometry, TransferPlan
from pdserve.transfer.formatter.staging import StagingPool
from pdserve.workers.roles.decode import check_handle
from tests.support.transfer import handed_generation, random_pool

P = KVLayout(
    model="m", num_layers=2, num_kv_heads=4, head_dim=64, tokens_per_block=16, dtype="bfloat16"
)  # a request of 64 blocks stages 4 MiB: more than the 1 MiB granule
D = P.model_copy(update={"tokens_per_block": 32, "dtype": "float32"})


class _RecordingBackend(Backend):
    """Records the staging registrations (the data path is not exercised here)."""

    name = "recording"
    inline_bytes = True

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # data_ptr -> bytes
        self.deregistered = 0

    def register_staging(self, buf: torch.Tensor) -> None:
        self.registered[buf.data_ptr()] = buf.numel()

    def deregister_staging(self, buf: torch.Tensor) -> None:
        del self.registered[buf.data_ptr()]
        self.deregistered += 1

    def start_send(
        self,
        conn: Connection,
        plan: TransferPlan,
        peer: Peer,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> Outbound:
        raise NotImplementedError

    async def receive(
        self,
        conn: Connection,
        plan: TransferPlan,
        transfer_id: str,
        digests: Digests | None = None,
    ) -> None:
        raise NotImplementedError


@pytest.fixture
def setup() -> tuple[StagingPool, _RecordingBackend, Formatter]:
    pool = random_pool(P, 64, seed=0)
    backend = _RecordingBackend()
    dst = PoolGeometry(D.num_layers, 64, D.block_bytes_per_layer)
    formatter = Formatter.negotiate(P, D, PoolGeometry.from_pool(pool, P), dst)
    return StagingPool(pool, backend, max_idle=2), backend, formatter


def _fill(staging: StagingPool, formatter: Formatter, n_src: int) -> TransferPlan:
    src_ids = list(range(n_src))
    dst_ids = list(range(10, 10 + -(-n_src // 2)))
    return staging.fill(formatter, src_ids, dst_ids, formatter.plan(src_ids, dst_ids))


def test_identity_sends_from_the_pool_and_allocates_nothing():
    pool = random_pool(P, 8, seed=0)
    backend = _RecordingBackend()
    identity = Formatter.negotiate(P, P, PoolGeometry.from_pool(pool, P), PoolGeometry(2, 8, 1))
    staging = StagingPool(pool, backend)
    plan = identity.plan([1, 2], [3, 4])
    assert staging.fill(identity, [1, 2], [3, 4], plan) is plan
    staging.release(plan)
    assert staging.nbytes == 0 and backend.registered == {}


def test_a_converting_send_reads_a_registered_buffer_that_the_next_send_reuses(setup):
    staging, backend, formatter = setup
    first = _fill(staging, formatter, 4)
    assert first.source is not None and first.source.dtype == torch.uint8
    assert first.source.data_ptr() in backend.registered
    assert first.source.numel() == first.nbytes  # the plan reads exactly the output area
    staging.release(first)
    staging.release(first)  # idempotent
    again = _fill(staging, formatter, 3)
    assert again.source is not None and again.source.data_ptr() == first.source.data_ptr()
    assert len(backend.registered) == 1 and backend.deregistered == 0


def test_sends_in_flight_at_once_get_distinct_buffers_and_idle_ones_are_bounded(setup):
    staging, backend, formatter = setup
    plans = [_fill(staging, formatter, 2) for _ in range(3)]
    assert len({p.source.data_ptr() for p in plans if p.source is not None}) == 3
    for plan in plans:
        staging.release(plan)
    assert len(backend.registered) == 2 and backend.deregistered == 1  # max_idle=2


def test_a_larger_request_replaces_the_idle_buffer_by_a_larger_one(setup):
    staging, backend, formatter = setup
    staging.release(_fill(staging, formatter, 2))
    small = staging.nbytes
    big = _fill(staging, formatter, 64)
    assert big.source is not None and big.source.numel() == big.nbytes
    assert staging.nbytes > small and backend.deregistered == 1
    assert list(backend.registered.values()) == [staging.nbytes]
    staging.release(big)


def test_close_deregisters_every_buffer_and_refuses_further_sends(setup):
    staging, backend, formatter = setup
    lent = _fill(staging, formatter, 2)
    staging.release(_fill(staging, formatter, 2))
    staging.close()
    staging.close()
    assert backend.registered == {} and staging.nbytes == 0
    staging.release(lent)  # a send that ends after close gives nothing back
    with pytest.raises(TransferError, match="closed"):
        _fill(staging, formatter, 2)


def test_a_failed_staging_lends_nothing_and_keeps_the_buffer_for_the_next_send(setup):
    staging, backend, formatter = setup
    plan = formatter.plan([0, 1], [5])
    with pytest.raises(TransferError, match="staging"):
        staging.fill(formatter, [0, 999], [5], plan)  # ids the plan did not check
    assert len(backend.registered) == 1
    good = _fill(staging, formatter, 2)
    assert good.source is not None and good.source.data_ptr() in backend.registered
    assert len(backend.registered) == 1 and backend.deregistered == 0


def test_decode_accepts_a_handle_whose_layout_the_formatter_maps():
    req = handed_generation(40, P)  # 40 tokens at 16 per block, into a 32-per-block engine
    assert req.handle is not None
    check_handle(req, req.handle, SimpleNamespace(layout=D))  # type: ignore[arg-type]


def test_decode_refuses_an_unmappable_handle_naming_the_field():
    req = handed_generation(40, P.model_copy(update={"num_kv_heads": 3}))
    assert req.handle is not None
    with pytest.raises(LayoutMismatchError, match="num_kv_heads: 3 != 4"):
        check_handle(req, req.handle, SimpleNamespace(layout=D))  # type: ignore[arg-type]
