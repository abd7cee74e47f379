"""Prefix cache of the KV cache manager: chained block hashes, lookup and registration, the LRU of
evictable blocks, what counts as free, fencing generations, and the scheduler starting a
sequence at its cached prefix."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.block_hash import BlockHasher
from pdserve.config.settings import SchedulerSettings
from pdserve.errors import CapacityError
from pdserve.protocol import KVLayout, SamplingParams
from pdserve.workers.engine.scheduler import Scheduler
from pdserve.workers.engine.sequence import Sequence
from pdserve.workers.kv.manager import KVCacheManager

TPB = 4
LAYOUT = KVLayout(
    model="test", num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_block=TPB, dtype="float32"
)


@dataclass
class Step:
    """A finished forward over ``seq``'s first ``num_kv_tokens_after_step`` tokens."""

    seq: Sequence
    num_kv_tokens_after_step: int

    @property
    def request_id(self) -> str:
        return self.seq.request_id


def seq_of(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens), "full", 0)


def compute(kv: KVCacheManager, seq: Sequence) -> None:
    """Allocate and "compute" all of ``seq``'s tokens, registering its full blocks."""
    kv.allocate(seq.request_id, seq.num_tokens)
    kv.update_resources([Step(seq, seq.num_tokens)])


def test_hashes_are_deterministic_and_chained() -> None:
    a = BlockHasher("m", "float32", TPB)
    tokens = list(range(12))
    assert a.hash_tokens(tokens) == BlockHasher("m", "float32", TPB).hash_tokens(tokens)
    h = a.hash_tokens(tokens)
    assert len(h) == 3 and len(set(h)) == 3
    assert all(isinstance(x, int) and 0 <= x < 2**128 for x in h)
    changed = a.hash_tokens([99, *tokens[1:]])
    assert all(x != y for x, y in zip(h, changed, strict=True)), "block 0 changes every child"
    last = a.hash_tokens([*tokens[:11], 99])
    assert last[:2] == h[:2] and last[2] != h[2]


@pytest.mark.parametrize(
    "other",
    [("m", "bfloat16", TPB), ("m", "float32", 8), ("other-model", "float32", TPB)],
    ids=["dtype", "block-size", "model"],
)
def test_hash_changes_with_every_extra_key(other: tuple[str, str, int]) -> None:
    tokens = list(range(8))
    base = BlockHasher("m", "float32", TPB).hash_tokens(tokens)[0]
    model, dtype, tpb = other
    assert BlockHasher(model, dtype, tpb).hash_tokens(tokens)[0] != base


def test_extend_hashes_only_new_full_blocks() -> None:
    hasher = BlockHasher("m", "float32", TPB)
    seq = seq_of("a", list(range(6)))
    assert hasher.extend(seq) == hasher.hash_tokens(list(range(6)))
    assert len(seq.block_hashes) == 1, "a partial last block has no hash"
    seq.output_token_ids += [6, 7, 8]
    assert hasher.extend(seq) == hasher.hash_tokens(list(range(9)))
    assert len(seq.block_hashes) == 2


def test_finished_blocks_stay_cached_and_count_as_free() -> None:
    kv = KVCacheManager(LAYOUT, 8)
    a = seq_of("a", list(range(10)))  # two full blocks + a partial one
    compute(kv, a)
    kv.free("a")
    stats = kv.prefix_stats()
    assert (stats.cached_blocks, stats.evictable_blocks) == (2, 2)
    assert kv.get_num_free_blocks() == 8 and kv.get_num_evictable_blocks() == 2
    assert kv.can_allocate(8)


def test_a_new_request_reuses_its_longest_cached_prefix() -> None:
    kv = KVCacheManager(LAYOUT, 8)
    a = seq_of("a", list(range(10)))
    compute(kv, a)
    table_a = kv.block_table("a")
    b = seq_of("b", [*range(8), 50, 51, 52])  # shares two full blocks, then differs
    cached = kv.acquire_prefix("b", kv.hasher.extend(b), b.num_tokens)
    assert cached == 8
    assert kv.block_table("b") == table_a[:2]
    assert kv.allocate("b", b.num_tokens)[:2] == table_a[:2]
    kv.free("a")
    assert kv.get_num_free_blocks() == 8 - 3, "b's table still holds the shared blocks"
    kv.free("b")
    assert kv.get_num_free_blocks() == 8


def test_a_partial_last_block_is_never_shared() -> None:
    kv = KVCacheManager(LAYOUT, 8)
    compute(kv, seq_of("a", list(range(6))))  # one full block, two tokens in the second
    kv.free("a")
    assert kv.prefix_stats().cached_blocks == 1
    b = seq_of("b", [*range(6), 7, 8, 9])
    assert kv.match_prefix(kv.hasher.extend(b), b.num_tokens)[1] == 4


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    kv = KVCacheManager(LAYOUT, 8)
    compute(kv, seq_of("a", list(range(8))))  # exactly two full blocks
    kv.free("a")
    b = seq_of("b", list(range(8)))
    blocks, cached = kv.match_prefix(kv.hasher.extend(b), b.num_tokens)
    assert cached == 4 and len(blocks) == 1, "the last token is computed for its logits"
    c = seq_of("c", list(range(9)))
    assert kv.match_prefix(kv.hasher.extend(c), c.num_tokens)[1] == 8


def test_eviction_is_lru_and_never_takes_held_blocks() -> None:
    kv = KVCacheManager(LAYOUT, 4)
    old, new = seq_of("old", list(range(4))), seq_of("new", list(range(100, 104)))
    held = seq_of("held", list(range(200, 208)))
    for seq in (old, new, held):
        compute(kv, seq)
    kv.free("old")
    kv.free("new")  # LRU order: old, then new; "held" keeps its two blocks
    assert kv.get_num_free_blocks() == 2
    (taken,) = kv.allocate("x", 1)
    assert taken not in kv.block_table("held")
    probe_old = seq_of("o2", list(range(5)))
    probe_new = seq_of("n3", list(range(100, 105)))
    assert kv.match_prefix(kv.hasher.extend(probe_old), 5)[1] == 0, "the oldest went first"
    assert kv.match_prefix(kv.hasher.extend(probe_new), 5)[1] == 4
    assert kv.prefix_stats().evictions == 1
    kv.allocate("y", 1)  # evicts "new" too
    with pytest.raises(CapacityError):
        kv.allocate("z", 1)  # only held blocks are left: a running request keeps its blocks
    assert len(kv.block_table("held")) == 2
    for rid in ("x", "y", "held"):
        kv.free(rid)
    assert kv.get_num_free_blocks() == 4


def test_evicted_blocks_leave_the_index_and_bump_the_generation() -> None:
    kv = KVCacheManager(LAYOUT, 2)
    a = seq_of("a", list(range(8)))
    compute(kv, a)
    table = kv.block_table("a")
    parked_gens = kv.generations(table)  # as a parked handle records them
    kv.free("a")
    assert kv.generations(table) == parked_gens, "a cached block keeps its contents"
    kv.allocate("b", 8)  # both blocks evicted and reallocated
    assert all(now != then for now, then in zip(kv.generations(table), parked_gens, strict=True)), (
        "fencing still sees the reallocation"
    )
    assert kv.prefix_stats().cached_blocks == 0


def test_a_duplicate_computation_is_not_indexed_twice() -> None:
    kv = KVCacheManager(LAYOUT, 8)
    compute(kv, seq_of("a", list(range(5))))
    compute(kv, seq_of("b", list(range(5))))  # computed concurrently, before a freed
    assert kv.prefix_stats().cached_blocks == 1
    kv.free("a")
    kv.free("b")
    assert kv.get_num_evictable_blocks() == 1 and kv.get_num_free_blocks() == 8


def test_prefix_caching_off_caches_nothing() -> None:
    kv = KVCacheManager(LAYOUT, 4, prefix_caching=False)
    compute(kv, seq_of("a", list(range(8))))
    kv.free("a")
    b = seq_of("b", list(range(9)))
    assert kv.acquire_prefix("b", kv.hasher.extend(b), b.num_tokens) == 0
    assert kv.get_num_evictable_blocks() == 0 and kv.prefix_stats().cached_blocks == 0


def test_fork_shares_registration_of_the_prompt_blocks() -> None:
    kv = KVCacheManager(LAYOUT, 8)
    a = seq_of("a", list(range(9)))
    compute(kv, a)
    kv.fork("a", "a#1", 8)
    kv.free("a")
    assert kv.get_num_evictable_blocks() == 0, "the fork still holds the prompt blocks"
    kv.free("a#1")
    assert kv.get_num_evictable_blocks() == 2 and kv.get_num_free_blocks() == 8


def test_scheduler_starts_a_sequence_at_its_cached_prefix_and_counts_it() -> None:
    kv = KVCacheManager(LAYOUT, 16)
    sched = Scheduler(kv, SchedulerSettings(max_num_seqs=4, max_num_batched_tokens=64))
    first = seq_of("first", list(range(10)))
    sched.add(first)
    batch = sched.schedule()
    assert [s.num_new_tokens for s in batch.prefill] == [10]
    kv.update_resources(batch.items)
    sched.finish(first)
    second = seq_of("second", [*range(10), 10, 11])
    sched.add(second)
    (item,) = sched.schedule().prefill
    assert (item.start_position, item.num_new_tokens) == (8, 4)
    assert second.num_cached_tokens == 8
    stats = kv.prefix_stats()
    assert (stats.queries, stats.query_tokens, stats.hit_tokens) == (2, 22, 8)
    assert stats.hit_rate == pytest.approx(8 / 22)
    sched.finish(second)
    assert kv.get_num_free_blocks() == 16


def test_a_sequence_that_does_not_fit_gives_its_prefix_back() -> None:
    kv = KVCacheManager(LAYOUT, 4)
    sched = Scheduler(
        kv, SchedulerSettings(max_num_seqs=4, max_num_batched_tokens=64), watermark_blocks=0
    )
    hog = seq_of("hog", list(range(100, 108)))
    sched.add(hog)
    sched.schedule()  # hog holds 2 blocks
    cached = seq_of("cached", list(range(8)))
    compute(kv, cached)
    kv.free("cached")  # 2 evictable blocks
    big = seq_of("big", [*range(8), *range(50, 62)])  # 5 blocks: never fits beside hog
    sched.add(big)
    assert [s.request_id for s in sched.schedule().items] == ["hog"]
    assert big.num_computed_tokens == 0 and kv.num_allocated("big") == 0
    assert kv.get_num_evictable_blocks() == 2 and kv.get_num_free_blocks() == 2
    assert kv.prefix_stats().queries == 1, "only hog's admission was counted"


def salted(rid: str, tokens: list[int], salt: str | None) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4, cache_salt=salt), "full", 0)


def test_a_salted_prompt_never_hits_another_salt_s_blocks() -> None:
    """vLLM's cache_salt: the same prompt under salts a, b and none hashes to three disjoint
    chains, so each misses the others' blocks and hits its own; no salt hashes as before."""
    kv = KVCacheManager(LAYOUT, 32)
    tokens = list(range(10))
    chains = {
        salt: kv.hasher.extend(salted(f"h-{salt}", tokens, salt)) for salt in ("a", "b", None)
    }
    assert chains[None] == BlockHasher(LAYOUT.model, LAYOUT.dtype, TPB).hash_tokens(tokens[:8])
    assert chains["a"] == kv.hasher.hash_tokens(tokens[:8], "a")
    assert not set(chains["a"]) & set(chains["b"]) and not set(chains["a"]) & set(chains[None])
    compute(kv, salted("first", tokens, "a"))
    for rid, salt, want in [("b1", "b", 0), ("none", None, 0), ("a2", "a", 8)]:
        seq = salted(rid, tokens, salt)
        assert kv.acquire_prefix(rid, kv.hasher.extend(seq), seq.num_tokens) == want, salt
