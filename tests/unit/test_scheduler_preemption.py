"""max_utilization: admission by current need, recompute preemption of the newest sequence, and
shared (forked) KV blocks."""

from __future__ import annotations

import pytest

from pdserve.config.settings import SchedulerSettings
from pdserve.errors import CapacityError
from pdserve.protocol import KVLayout, SamplingParams
from pdserve.workers.engine.scheduler import Scheduler
from pdserve.workers.engine.sequence import Sequence, SequenceStatus
from pdserve.workers.kv.manager import KVCacheManager

TPB = 4
LAYOUT = KVLayout(
    model="test", num_layers=2, num_kv_heads=1, head_dim=2, tokens_per_block=TPB, dtype="float32"
)


def make(num_blocks: int, *, watermark: int = 0, max_num_seqs: int = 8) -> Scheduler:
    settings = SchedulerSettings(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=64, capacity_policy="max_utilization"
    )
    return Scheduler(KVCacheManager(LAYOUT, num_blocks), settings, watermark_blocks=watermark)


def seq(rid: str, prompt_len: int, max_tokens: int = 10_000) -> Sequence:
    prompt = [100 + i for i in range(prompt_len)]
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), "full", need_blocks=0)


def step(sched: Scheduler, token: int = 7) -> list[str]:
    """Run one step the way the engine does (K/V progress, one token per sampling sequence);
    returns the ids in the batch."""
    batch = sched.schedule()
    for s in batch.items:
        held = sched.kv_cache.num_allocated(s.request_id) * TPB
        assert held >= s.num_kv_tokens_after_step, "a step ran without blocks for its K/V"
        s.seq.num_computed_tokens = s.num_kv_tokens_after_step
    for s in batch.sampling:
        s.seq.output_token_ids.append(token)
    return [s.request_id for s in batch.items]


def test_a_request_without_max_tokens_is_admitted_by_its_prompt_alone() -> None:
    sched = make(num_blocks=4)
    big = seq("a", prompt_len=8, max_tokens=8000)  # worst case: 2002 blocks
    sched.add(big)
    assert step(sched) == ["a"]
    assert sched.kv_cache.num_allocated("a") == 2


def test_the_watermark_holds_back_admission_while_others_run() -> None:
    sched = make(num_blocks=4, watermark=1)
    sched.add(seq("a", prompt_len=4))
    sched.add(seq("b", prompt_len=9))  # 3 blocks + watermark 1 > 3 free after a
    assert step(sched) == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_an_idle_engine_admits_a_request_as_large_as_the_pool() -> None:
    sched = make(num_blocks=2, watermark=1)
    sched.add(seq("a", prompt_len=8))
    assert step(sched) == ["a"]


def test_a_short_pool_preempts_the_most_recently_admitted_sequence() -> None:
    sched = make(num_blocks=4)
    a, b = seq("a", prompt_len=8), seq("b", prompt_len=8)
    sched.add(a)
    sched.add(b)
    assert step(sched) == ["a", "b"]  # 2 + 2 blocks: the pool is full
    # a needs a third block for position 8: b (admitted last) gives its blocks back
    assert step(sched) == ["a"]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.kv_cache.num_allocated("b") == 0
    assert list(sched.waiting) == [b]


def test_a_preempted_sequence_recomputes_prompt_and_output_then_samples_on() -> None:
    sched = make(num_blocks=4)
    a, b = seq("a", prompt_len=8), seq("b", prompt_len=8)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)  # b preempted with one output token
    assert b.output_token_ids == [7]
    sched.finish(a)  # a leaves: room again
    batch = sched.schedule()
    (item,) = batch.items
    assert item.seq is b and item.start_position == 0
    assert item.num_new_tokens == 9  # 8 prompt tokens + the output token
    assert item.token_ids() == b.prompt_token_ids + [7]
    assert item.samples  # its logits give output position 1: the stream continues


def test_a_sequence_preempts_itself_when_it_is_the_newest() -> None:
    sched = make(num_blocks=3)
    a = seq("a", prompt_len=4)
    sched.add(a)
    step(sched)
    sched.kv_cache.allocate("parked", 8)  # 2 blocks held outside the scheduler
    assert step(sched) == []  # a needs a second block: none; a itself goes back
    assert list(sched.waiting) == [a]
    sched.kv_cache.free("parked")
    assert step(sched) == ["a"]


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make(num_blocks=4)
    a, b, c = seq("a", prompt_len=8), seq("b", prompt_len=8), seq("c", prompt_len=1)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.add(c)
    assert step(sched) == ["a"]
    assert list(sched.waiting) == [b, c]


def test_preemption_drains_every_sequence_and_returns_every_block() -> None:
    sched = make(num_blocks=6)
    seqs = [seq(f"s{i}", prompt_len=3 + i, max_tokens=12) for i in range(5)]
    for s in seqs:
        sched.add(s)
    finished: list[Sequence] = []
    for _ in range(400):
        step(sched)
        for s in list(sched.running):
            if len(s.output_token_ids) >= s.sampling.max_tokens:
                sched.finish(s)
                finished.append(s)
        if len(finished) == len(seqs):
            break
    assert sorted(s.request_id for s in finished) == [s.request_id for s in seqs]
    assert all(len(s.output_token_ids) == 12 for s in seqs)
    assert sched.num_preemptions > 0
    assert sched.kv_cache.get_num_free_blocks() == 6


def test_reserve_takes_the_prompt_blocks_only_and_refuses_when_they_are_not_free() -> None:
    sched = make(num_blocks=4, watermark=1)
    r = Sequence("r", list(range(8)), SamplingParams(max_tokens=5000), "resume", need_blocks=0)
    assert len(sched.reserve(r)) == 2
    other = Sequence("o", list(range(8)), SamplingParams(max_tokens=2), "resume", need_blocks=0)
    with pytest.raises(CapacityError):
        sched.reserve(other)  # 2 blocks + watermark 1 > 2 free
    assert sched.unreserve("r")
    assert sched.kv_cache.get_num_free_blocks() == 4


def test_fork_shares_full_blocks_and_copies_the_last_prompt_block() -> None:
    kv = KVCacheManager(LAYOUT, 8)
    src = kv.allocate("a", 10)  # blocks for positions 0..9: 3 blocks, the last partial
    kv.pool[:, src[2]] = 5.0
    table = kv.fork("a", "a#1", 9)  # the fork recomputes position 9
    assert table[:2] == src[:2] and table[2] != src[2]
    assert bool((kv.pool[:, table[2]] == 5.0).all())
    assert kv.get_num_free_blocks() == 4
    assert kv.free("a") == [src[2]]  # shared blocks stay while the fork holds them
    assert sorted(kv.free("a#1")) == sorted(table)
    assert kv.get_num_free_blocks() == 8


def test_fork_without_a_free_block_allocates_nothing() -> None:
    kv = KVCacheManager(LAYOUT, 3)
    kv.allocate("a", 10)
    assert kv.fork("a", "a#1", 9) is None
    assert kv.block_table("a#1") == [] and kv.get_num_free_blocks() == 0


def test_shared_blocks_keep_their_generation_until_the_last_reference_goes() -> None:
    kv = KVCacheManager(LAYOUT, 4)
    src = kv.allocate("a", 8)
    kv.fork("a", "a#1", 8)
    before = kv.generations(src)
    kv.free("a")
    assert kv.generations(src) == before
    kv.free("a#1")
    assert all(g > b for g, b in zip(kv.generations(src), before, strict=True))
