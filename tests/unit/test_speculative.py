"""N-gram proposals, the acceptance rule and the scheduler's drafts (speculative decoding)."""

from __future__ import annotations

import pytest

from pdserve.config.settings import SchedulerSettings
from pdserve.protocol import KVLayout, SamplingParams
from pdserve.workers.engine.sampling.speculative import (
    MAX_BACKOFF,
    NgramProposer,
    accepted,
    record_outcome,
    speculates,
    take_turn,
)
from pdserve.workers.engine.scheduler import Scheduler
from pdserve.workers.engine.sequence import Sequence
from pdserve.workers.kv.manager import KVCacheManager

TPB = 4
LAYOUT = KVLayout(
    model="test", num_layers=1, num_kv_heads=1, head_dim=2, tokens_per_block=TPB, dtype="float32"
)


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    p = NgramProposer(3, max_n=2, min_n=1)
    #          0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 2, 3]
    # suffix (2, 3) occurred at 1 and 5; the latest (5) is followed by 5, 2, 3
    assert p.propose(tokens) == [5, 2, 3]
    assert p.propose(tokens, limit=1) == [5]
    assert p.propose(tokens, limit=0) == []


def test_longest_ngram_first_and_falls_back_to_shorter() -> None:
    p = NgramProposer(2, max_n=3, min_n=1)
    # (7, 8, 9) occurred at 0 -> propose 10, 11; (8, 9) alone at 5 would give 0
    assert p.propose([7, 8, 9, 10, 11, 8, 9, 0, 7, 8, 9]) == [10, 11]
    # no 3- or 2-gram match; the 1-gram (4,) occurred at 1 -> 5, 6
    assert p.propose([3, 4, 5, 6, 1, 4]) == [5, 6]
    assert NgramProposer(2, max_n=3, min_n=2).propose([3, 4, 5, 6, 1, 4]) == []


def test_matches_whole_tokens_only() -> None:
    """Token ids are searched as 4-byte words: a byte pattern straddling two tokens is no
    match (256 * 1 + 0 ... would alias without the alignment check)."""
    p = NgramProposer(2, max_n=1, min_n=1)
    tokens = [0x0100, 0x0002, 7, 0x0201]
    assert p.propose(tokens) == []
    assert p.propose([5, 0x0201, 6, 9, 0x0201]) == [6, 9]


def test_nothing_to_propose_for_short_or_unique_sequences() -> None:
    p = NgramProposer(4)
    assert p.propose([]) == [] and p.propose([1, 2]) == []
    assert p.propose(list(range(100))) == []


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(4, max_n=2, min_n=3)
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError, match="exceeds"):
        SchedulerSettings(speculative_ngram_min=5, speculative_ngram_max=4)


def test_acceptance_keeps_the_first_mismatch() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 4  # all drafts right: k + 1 tokens
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 2  # t1 != d2: t0, t1
    assert accepted([5, 6, 7], [4, 6, 7, 8]) == 1  # the first token is always emitted
    assert accepted([], [3]) == 1


def test_which_requests_speculate() -> None:
    assert speculates(SamplingParams())
    assert speculates(SamplingParams(temperature=0.7, seed=3, logprobs=True))
    assert not speculates(SamplingParams(repetition_penalty=1.2))
    assert not speculates(SamplingParams(min_tokens=3))


def _scheduler(spec: int, num_blocks: int = 64, **kw: object) -> Scheduler:
    kv = KVCacheManager(LAYOUT, num_blocks)
    settings = SchedulerSettings(speculative_tokens=spec, **kw)  # type: ignore[arg-type]
    return Scheduler(kv, settings, watermark_blocks=0)


def _decoding(sched: Scheduler, rid: str, prompt: list[int], out: list[int]) -> Sequence:
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=50), "full", 0)
    sched.add(seq)
    batch = sched.schedule()  # prefill
    assert any(s.seq is seq and s.start_position == 0 for s in batch.prefill)
    seq.num_computed_tokens = len(prompt)
    seq.output_token_ids = list(out)
    return seq


def test_scheduler_feeds_drafts_as_a_chunk_and_counts_only_verified_kv() -> None:
    sched = _scheduler(3)
    seq = _decoding(sched, "a", [1, 2, 3, 4, 1, 2], [3])
    batch = sched.schedule()
    (item,) = batch.prefill
    assert not batch.decode
    assert item.draft == (4, 1, 2)  # after (2, 3) came 4, 1, 2
    assert item.token_ids() == [3, 4, 1, 2]
    assert item.num_new_tokens == 4 and item.num_rows == 4 and item.samples
    assert item.start_position == 6
    assert item.num_kv_tokens_after_step == 7  # drafts count once verified
    assert sched.kv_cache.num_allocated("a") == sched.kv_cache.blocks_for_tokens(10)  # 3 of 4
    assert seq.num_computed_tokens == 6


def test_no_drafts_in_a_full_batch_or_without_free_blocks() -> None:
    sched = _scheduler(3, speculative_max_batch=1)
    _decoding(sched, "a", [1, 2, 3, 4, 1, 2], [3])
    _decoding(sched, "b", [5, 6, 7, 8, 5, 6], [7])
    batch = sched.schedule()
    assert len(batch.decode) == 2 and not batch.prefill  # 2 > speculative_max_batch

    tight = _scheduler(3, num_blocks=2)
    _decoding(tight, "c", list(range(1, 2 * TPB - 1)) + [1], [2])  # 2 * TPB tokens after it
    batch = tight.schedule()
    (item,) = batch.decode  # drafts would need a third block: none is free
    assert item.draft == () and tight.num_preemptions == 0


def test_back_off_after_misses_and_reset_on_a_match() -> None:
    seq = Sequence("a", [1], SamplingParams(), "full", 0)
    assert take_turn(seq)
    skipped = []
    for _ in range(7):  # seven misses in a row: skip 1, 2, 4, 8, 16, 32, 32 steps
        record_outcome(seq, 0)
        n = 0
        while not take_turn(seq):
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 8, 16, MAX_BACKOFF, MAX_BACKOFF]
    record_outcome(seq, 2)
    assert take_turn(seq) and seq.spec_backoff == 0
    record_outcome(seq, 0)
    assert not take_turn(seq) and take_turn(seq)  # back to one step
