"""KV cache manager: block allocation, free and reuse, capacity errors, pool geometry."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from pdserve.errors import CapacityError
from pdserve.protocol import KVLayout
from pdserve.workers.kv.manager import KVCacheManager, num_blocks_for_budget

LAYOUT = KVLayout(
    model="test", num_layers=3, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float32"
)


@dataclass
class Demand:
    request_id: str
    num_kv_tokens_after_step: int


def make(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(LAYOUT, num_blocks)


def test_allocation_grows_one_block_per_tokens_per_block_tokens() -> None:
    kv = make()
    assert len(kv.allocate("a", 1)) == 1
    assert len(kv.allocate("a", 4)) == 1  # the first block still has room
    assert len(kv.allocate("a", 5)) == 2
    assert kv.get_num_free_blocks() == 6


def test_growing_keeps_earlier_blocks_in_token_order() -> None:
    kv = make()
    first = kv.allocate("a", 4)
    grown = kv.allocate("a", 9)
    assert grown[: len(first)] == first
    assert len(set(grown)) == 3


def test_free_returns_blocks_and_they_are_reused() -> None:
    kv = make(num_blocks=4)
    a = kv.allocate("a", 16)
    with pytest.raises(CapacityError):
        kv.allocate("b", 1)
    assert sorted(kv.free("a")) == sorted(a)
    assert kv.get_num_free_blocks() == 4
    assert sorted(kv.allocate("b", 16)) == sorted(a)


def test_free_list_is_fifo_so_recently_freed_blocks_are_reused_last() -> None:
    kv = make(num_blocks=4)
    kv.allocate("a", 4)
    kv.allocate("b", 4)
    freed = kv.free("a")
    nxt = kv.allocate("c", 8)
    assert freed[0] not in nxt  # the two never-used blocks come first


def test_free_is_idempotent_and_unknown_requests_free_nothing() -> None:
    kv = make()
    kv.allocate("a", 8)
    assert len(kv.free("a")) == 2
    assert kv.free("a") == []
    assert kv.free("never-seen") == []
    assert kv.get_num_free_blocks() == 8


def test_failed_allocation_allocates_nothing() -> None:
    kv = make(num_blocks=3)
    kv.allocate("a", 4)
    with pytest.raises(CapacityError, match="exhausted"):
        kv.allocate("b", 12)
    assert kv.get_num_free_blocks() == 2
    assert kv.block_table("b") == []
    assert "b" not in kv.holders()


def test_prepare_resources_allocates_each_demand() -> None:
    kv = make()
    kv.prepare_resources([Demand("a", 5), Demand("b", 1)])
    assert kv.get_batch_cache_indices(["a", "b"]) == {
        "a": kv.block_table("a"),
        "b": kv.block_table("b"),
    }
    assert [len(t) for t in kv.get_batch_cache_indices(["a", "b"]).values()] == [2, 1]


def test_needed_resource_counts_every_fed_token_but_the_last_sampled_one() -> None:
    kv = make()
    # prompt 4 + 1 new token: the sampled token is never fed, so one block suffices
    assert kv.get_needed_resource_to_completion(4, 1) == 1
    assert kv.get_needed_resource_to_completion(4, 2) == 2
    assert kv.get_needed_resource_to_completion(7, 10) == 4  # 16 tokens


def test_pool_is_one_contiguous_tensor_of_the_documented_shape() -> None:
    kv = make(num_blocks=5)
    assert kv.pool.shape == (3, 5, 2, 4, 2, 4)
    assert kv.pool.is_contiguous()
    assert kv.get_max_resource_count() == 5


def test_get_buffers_is_a_view_at_the_documented_byte_offset() -> None:
    kv = make(num_blocks=5)
    layer, block = 2, 3
    buf = kv.get_buffers(layer)
    assert buf.shape == (5, 2, 4, 2, 4)
    buf[block].fill_(7.0)
    assert torch.all(kv.pool[layer, block] == 7.0)
    offset = buf[block].data_ptr() - kv.pool.data_ptr()
    assert offset == ((layer * 5) + block) * LAYOUT.block_bytes_per_layer


def test_budget_sizes_the_pool_in_whole_blocks() -> None:
    per_block = LAYOUT.block_bytes_per_layer * LAYOUT.num_layers
    assert num_blocks_for_budget(LAYOUT, 10 * per_block + per_block // 2) == 10
    with pytest.raises(CapacityError):
        KVCacheManager(LAYOUT, num_blocks_for_budget(LAYOUT, per_block - 1))


def test_read_and_write_blocks_round_trip_between_pools() -> None:
    src, dst = make(), make()
    blocks = src.allocate("a", 8)
    src.pool[:, blocks] = torch.randn(3, 2, 2, 4, 2, 4)
    target = dst.allocate("a", 8)
    dst.write_blocks(target, src.read_blocks(blocks))
    assert torch.equal(dst.pool[:, target], src.pool[:, blocks])


def test_concurrent_allocate_and_free_never_share_a_block() -> None:
    kv = make(num_blocks=64)
    errors: list[str] = []

    def worker(name: str) -> None:
        for i in range(200):
            rid = f"{name}-{i}"
            try:
                kv.allocate(rid, 8)
            except CapacityError:
                continue
            kv.free(rid)
        owned = kv.allocate(name, 8)
        if len(owned) != 2:
            errors.append(name)

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tables = kv.get_batch_cache_indices(kv.holders())
    all_blocks = [b for table in tables.values() for b in table]
    assert not errors
    assert len(all_blocks) == len(set(all_blocks)) == 8
    assert kv.get_num_free_blocks() == 64 - 8
