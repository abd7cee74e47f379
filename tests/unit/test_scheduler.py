"""Capacity scheduler under guaranteed_no_evict: admission never over-commits the KV pool;
continuous batching. (max_utilization and preemption: test_scheduler_preemption.py.)"""

from __future__ import annotations

import random

import pytest

from pdserve.config.settings import SchedulerSettings
from pdserve.errors import CapacityError
from pdserve.protocol import KVLayout, SamplingParams, Share
from pdserve.workers.engine.scheduler import CapacityPolicy, ScheduledBatch, Scheduler
from pdserve.workers.engine.sequence import Sequence, SequenceStatus
from pdserve.workers.kv.manager import KVCacheManager

TPB = 4
LAYOUT = KVLayout(
    model="test", num_layers=1, num_kv_heads=1, head_dim=2, tokens_per_block=TPB, dtype="float32"
)


def make(
    num_blocks: int,
    *,
    max_num_seqs: int = 8,
    max_tokens_per_step: int = 64,
    policy: CapacityPolicy = "guaranteed_no_evict",
    watermark_blocks: int | None = None,
) -> Scheduler:
    kv = KVCacheManager(LAYOUT, num_blocks)
    settings = SchedulerSettings(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens_per_step,
        capacity_policy=policy,
    )
    return Scheduler(kv, settings, watermark_blocks=watermark_blocks)


def seq(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    need = sched.kv_cache.get_needed_resource_to_completion(prompt_len, max_tokens)
    return Sequence(
        rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), "full", need
    )


def step(sched: Scheduler) -> tuple[ScheduledBatch, list[Sequence]]:
    """What the engine does around the forward: advance the KV progress, append a token to every
    sampling sequence, retire those that reached max_tokens. Returns the batch and the retired."""
    batch = sched.schedule()
    for s in batch.items:
        held = sched.kv_cache.num_allocated(s.request_id) * TPB
        assert held >= s.num_kv_tokens_after_step, "a step ran without blocks for its K/V"
        assert sched.kv_cache.num_allocated(s.request_id) <= s.seq.need_blocks
        s.seq.num_computed_tokens = s.num_kv_tokens_after_step
    done = []
    for s in batch.sampling:
        s.seq.output_token_ids.append(0)
        if len(s.seq.output_token_ids) >= s.seq.sampling.max_tokens:
            sched.finish(s.seq)
            done.append(s.seq)
    return batch, done


def test_request_that_cannot_finish_is_not_admitted_until_blocks_free_up() -> None:
    sched = make(num_blocks=6)
    first = seq(sched, "a", prompt_len=8, max_tokens=9)  # 16 tokens = 4 blocks
    second = seq(sched, "b", prompt_len=8, max_tokens=5)  # 12 tokens = 3 blocks > 2 left
    sched.add(first)
    sched.add(second)
    done: list[Sequence] = []
    while first not in done:
        batch, done = step(sched)
        assert [s.request_id for s in batch.items] == ["a"]
        assert second.status is SequenceStatus.WAITING
    batch, _ = step(sched)
    assert [s.request_id for s in batch.items] == ["b"]


def test_admitted_requests_always_finish_without_running_out_of_blocks() -> None:
    rng = random.Random(7)
    sched = make(num_blocks=20, max_num_seqs=6, max_tokens_per_step=24)
    pending = [seq(sched, f"r{i}", rng.randint(1, 30), rng.randint(1, 25)) for i in range(40)]
    for s in pending[:20]:
        sched.add(s)
    finished: list[Sequence] = []
    for n in range(2000):
        if n == 10:
            for s in pending[20:]:
                sched.add(s)  # late arrivals join between steps
        _, done = step(sched)
        finished += done
        assert sched.headroom() >= 0
        if len(finished) == len(pending):
            break
    assert {s.request_id for s in finished} == {s.request_id for s in pending}
    assert sched.kv_cache.get_num_free_blocks() == 20


def test_each_step_runs_every_decode_sequence_plus_new_prefills() -> None:
    sched = make(num_blocks=64)
    for rid in ("a", "b"):
        sched.add(seq(sched, rid, prompt_len=5, max_tokens=10))
    batch, _ = step(sched)
    assert (len(batch.decode), len(batch.prefill)) == (0, 2)
    sched.add(seq(sched, "c", prompt_len=6, max_tokens=10))
    batch, _ = step(sched)
    assert [s.request_id for s in batch.decode] == ["a", "b"]
    assert [(s.request_id, s.num_new_tokens) for s in batch.prefill] == [("c", 6)]
    assert [s.request_id for s in batch.sampling] == ["a", "b", "c"]
    batch, _ = step(sched)
    assert [s.request_id for s in batch.decode] == ["a", "b", "c"] and not batch.prefill


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    sched = make(num_blocks=64, max_tokens_per_step=8)
    long = seq(sched, "long", prompt_len=20, max_tokens=4)
    sched.add(long)
    chunks = []
    while long.in_context_phase:
        batch, _ = step(sched)
        assert batch.num_tokens <= 8
        chunks.append(batch.prefill[0].num_new_tokens)
        assert batch.prefill[0].samples == (not long.in_context_phase)
    assert chunks == [8, 8, 4]
    assert long.output_token_ids == [0]


def test_decode_sequences_come_first_in_the_token_budget() -> None:
    sched = make(num_blocks=64, max_tokens_per_step=8)
    sched.add(seq(sched, "a", prompt_len=3, max_tokens=10))
    step(sched)
    sched.add(seq(sched, "b", prompt_len=20, max_tokens=4))
    batch, _ = step(sched)
    assert [s.request_id for s in batch.decode] == ["a"]
    assert batch.prefill[0].num_new_tokens == 7


def test_max_num_seqs_bounds_the_running_batch() -> None:
    sched = make(num_blocks=64, max_num_seqs=2)
    for rid in "abc":
        sched.add(seq(sched, rid, prompt_len=2, max_tokens=5))
    batch, _ = step(sched)
    assert [s.request_id for s in batch.items] == ["a", "b"]
    assert len(sched.waiting) == 1


def test_waiting_requests_do_not_overtake_a_blocked_head_of_queue() -> None:
    sched = make(num_blocks=6)
    sched.add(seq(sched, "a", prompt_len=8, max_tokens=9))  # 4 blocks
    sched.add(seq(sched, "big", prompt_len=8, max_tokens=5))  # 3 blocks: does not fit
    sched.add(seq(sched, "small", prompt_len=1, max_tokens=1))  # 1 block would fit
    batch, _ = step(sched)
    assert [s.request_id for s in batch.items] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["big", "small"]


def test_reserve_holds_capacity_for_the_whole_completion() -> None:
    sched = make(num_blocks=6)
    resumed = seq(sched, "r", prompt_len=5, max_tokens=8)  # 12 tokens = 3 blocks
    blocks = sched.reserve(resumed)
    assert len(blocks) == 2  # the prompt's blocks, allocated now
    assert sched.headroom() == 3
    with pytest.raises(CapacityError):
        sched.reserve(seq(sched, "too-big", prompt_len=8, max_tokens=9))
    sched.add(seq(sched, "fits-not", prompt_len=8, max_tokens=5))  # 3 blocks: exactly fits
    sched.add(seq(sched, "waits", prompt_len=1, max_tokens=2))
    batch, _ = step(sched)
    assert [s.request_id for s in batch.items] == ["fits-not"]


def test_resumed_sequence_is_admitted_ahead_of_the_queue_and_feeds_its_first_token() -> None:
    sched = make(num_blocks=8)
    sched.add(seq(sched, "big", prompt_len=20, max_tokens=20))  # never fits in 8 blocks
    resumed = seq(sched, "r", prompt_len=5, max_tokens=4)
    sched.reserve(resumed)
    resumed.output_token_ids = [42]
    resumed.num_computed_tokens = 5
    sched.add(resumed)
    assert "r" not in sched.reserved
    batch, _ = step(sched)
    assert [(s.request_id, s.start_position, s.token_ids()) for s in batch.decode] == [
        ("r", 5, [42])
    ]
    assert not batch.prefill


def test_unreserve_frees_the_blocks_and_is_idempotent() -> None:
    sched = make(num_blocks=4)
    sched.reserve(seq(sched, "r", prompt_len=8, max_tokens=2))
    assert sched.kv_cache.get_num_free_blocks() == 2
    assert sched.unreserve("r") is True
    assert sched.unreserve("r") is False
    assert sched.kv_cache.get_num_free_blocks() == 4
    assert sched.headroom() == 4


def test_remove_takes_a_running_request_out_and_frees_its_blocks() -> None:
    sched = make(num_blocks=4)
    sched.add(seq(sched, "a", prompt_len=6, max_tokens=3))
    step(sched)
    removed = sched.remove("a")
    assert removed is not None and removed.request_id == "a"
    assert sched.remove("a") is None
    assert not sched.running and sched.kv_cache.get_num_free_blocks() == 4


def test_blocks_held_outside_the_scheduler_reduce_headroom() -> None:
    sched = make(num_blocks=4)
    sched.kv_cache.allocate("parked", 12)  # a parked prefill result: 3 blocks
    sched.add(seq(sched, "a", prompt_len=4, max_tokens=2))  # needs 2 blocks
    batch, _ = step(sched)
    assert not batch
    sched.kv_cache.free("parked")
    batch, _ = step(sched)
    assert [s.request_id for s in batch.items] == ["a"]


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_reserve_with_reuse_prefix_starts_at_the_cached_prefix(policy: CapacityPolicy) -> None:
    """Delta transfer's reservation: the prompt's cached full blocks lead the table (not to be
    pulled), the rest are fresh; the lookup counts as a prefix cache query."""
    sched = make(num_blocks=12, policy=policy, watermark_blocks=0)
    kv = sched.kv_cache
    turn1 = seq(sched, "t1", prompt_len=9, max_tokens=2)  # blocks 0..2; two full
    kv.allocate("t1", 9)
    kv.register("t1", kv.hasher.extend(turn1), 9)
    cached_ids = kv.block_table("t1")[:2]
    kv.free("t1")  # the full blocks stay cached (evictable)
    turn2 = Sequence("t2", list(range(9)) + [50, 51, 52], SamplingParams(max_tokens=2), "resume",
                     kv.get_needed_resource_to_completion(12, 2))  # fmt: skip
    blocks = sched.reserve(turn2, reuse_prefix=True)
    assert blocks[:2] == cached_ids and len(blocks) == 3
    assert turn2.num_cached_tokens == 2 * TPB
    assert kv.prefix_stats().hit_tokens == 2 * TPB and kv.prefix_stats().queries == 1
    assert kv.get_num_evictable_blocks() == 0, "the reservation holds the cached blocks"
    sched.unreserve("t2")
    assert kv.get_num_evictable_blocks() == 2 and kv.get_num_free_blocks() == 12

    plain = Sequence("t3", turn2.prompt_token_ids, turn2.sampling, "resume", turn2.need_blocks)
    assert sched.reserve(plain)[:2] != cached_ids, "without reuse_prefix nothing is shared"
    assert plain.num_cached_tokens == 0


def test_refused_reservation_gives_its_cached_prefix_back() -> None:
    sched = make(num_blocks=4, policy="max_utilization", watermark_blocks=0)
    kv = sched.kv_cache
    first = seq(sched, "a", prompt_len=8, max_tokens=2)
    kv.allocate("a", 8)
    kv.register("a", kv.hasher.extend(first), 8)
    kv.free("a")
    kv.allocate("hog", 2 * TPB)  # the 2 free blocks; the 2 cached ones stay evictable
    big = Sequence("b", list(range(8)) + list(range(60, 72)), SamplingParams(max_tokens=2),
                   "resume", 6)  # fmt: skip
    with pytest.raises(CapacityError):
        sched.reserve(big, reuse_prefix=True)  # 5 blocks, 1 cached: 4 more do not fit in 2
    assert kv.get_num_evictable_blocks() == 2 and not kv.num_allocated("b")
    assert "b" not in sched.reserved


def shared(sched: Scheduler, rid: str, prompt_len: int, tenant: str | None) -> Sequence:
    """A sequence of ``tenant`` (None: no share), as the router's fair queue sends it."""
    s = seq(sched, rid, prompt_len, max_tokens=2)
    if tenant is not None:
        share = Share(tenant=tenant, weight=1.0)
        s.sampling = s.sampling.model_copy(update={"share": share})
    return s


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_a_less_served_tenant_s_prompt_takes_the_next_chunk(policy: CapacityPolicy) -> None:
    """a's two long prompts are being prefilled chunk by chunk; b's short prompt arrives and
    its chunk runs next, ahead of a's remaining chunks (which go on after it)."""
    sched = make(num_blocks=64, max_tokens_per_step=8, policy=policy)
    a1, a2 = shared(sched, "a1", 24, "a"), shared(sched, "a2", 24, "a")
    sched.add(a1), sched.add(a2)
    first, _ = step(sched)
    assert [s.request_id for s in first.prefill] == ["a1"]
    b = shared(sched, "b", 8, "b")
    sched.add(b)
    second, _ = step(sched)
    assert [s.request_id for s in second.prefill] == ["b"]  # b's whole prompt, one chunk
    assert [s.request_id for s in second.sampling] == ["b"]  # its first token
    third, _ = step(sched)
    assert [s.request_id for s in third.prefill] == ["a1"]  # a goes on where it stopped


def test_without_shares_a_running_prefill_keeps_its_chunks() -> None:
    sched = make(num_blocks=64, max_tokens_per_step=8)
    a1 = shared(sched, "a1", 24, None)
    sched.add(a1)
    step(sched)
    sched.add(shared(sched, "b", 8, None))
    second, _ = step(sched)
    assert [s.request_id for s in second.prefill] == ["a1"]  # first come, first served
