"""Engine request lifecycle on the tiny model: stop conditions, validation, prefill parking,
reservations, aborts, step failures, shutdown. Every test checks that no KV block leaks."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.errors import CapacityError, InvalidRequestError
from pdserve.protocol import FinishReason, SamplingParams
from pdserve.workers.engine.engine import Engine, EngineOutput, EngineRequest
from tests.support.engine import complete, make_engine, run

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # b"Hello, world"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = make_engine(tiny_model_dir, num_blocks=24, max_model_len=128)
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def no_leaked_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        eng: Engine = request.getfixturevalue("engine")
        assert eng.kv_cache.holders() == [] and not eng.parked


def test_max_tokens_ends_with_length_after_exactly_max_tokens(engine: Engine) -> None:
    got = complete(engine, "len", PROMPT, SamplingParams(max_tokens=7, ignore_eos=True, seed=1))
    assert len(got.token_ids) == 7 and got.finish_reason is FinishReason.LENGTH


def test_stop_string_ends_the_request_and_is_cut_from_the_text(engine: Engine) -> None:
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = complete(engine, "nostop", PROMPT, sampling)
    stop = full.text[6:8]
    cut = full.text[: full.text.find(stop)]
    got = complete(engine, "stop", PROMPT, sampling.model_copy(update={"stop": (stop,)}))
    assert got.finish_reason is FinishReason.STOP
    assert got.text == cut
    assert got.token_ids == full.token_ids[: len(got.token_ids)]


def test_eos_ends_the_request_unless_ignore_eos(tiny_model_dir: Path) -> None:
    eng = make_engine(tiny_model_dir, num_blocks=32)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        free_run = complete(eng, "free", PROMPT, greedy)
        eng.eos_token_ids = frozenset({free_run.token_ids[3]})  # make the 4th token "EOS"
        stopped = complete(eng, "eos", PROMPT, greedy.model_copy(update={"ignore_eos": False}))
        ignored = complete(eng, "ignored", PROMPT, greedy)
    finally:
        eng.shutdown()
    assert stopped.finish_reason is FinishReason.STOP
    assert (
        stopped.token_ids
        == free_run.token_ids[: free_run.token_ids.index(free_run.token_ids[3]) + 1]
    )
    assert ignored.token_ids == free_run.token_ids


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [
        ([], 4, "empty"),
        ([5] * 128, 1, "max_model_len"),
        ([5] * 100, 29, "max_model_len"),
        ([5, 999], 4, "token ids"),
    ],
)
def test_invalid_requests_are_refused_before_queueing(
    engine: Engine, prompt: list[int], max_tokens: int, match: str
) -> None:
    req = EngineRequest("bad", prompt, SamplingParams(max_tokens=max_tokens))
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(req, lambda out: None)


def test_resume_without_reserve_is_refused(engine: Engine) -> None:
    req = EngineRequest("orphan", PROMPT, SamplingParams(max_tokens=4), "resume", first_token=5)
    with pytest.raises(InvalidRequestError, match="reserve"):
        engine.add_request(req, lambda out: None)


def test_refused_resume_gives_its_reservation_back(engine: Engine) -> None:
    engine.reserve("rr", PROMPT, SamplingParams(max_tokens=4))
    other_prompt = EngineRequest("rr", PROMPT[:-1], SamplingParams(max_tokens=4), "resume", 5)
    with pytest.raises(InvalidRequestError, match="differs"):
        engine.add_request(other_prompt, lambda out: None)
    assert "rr" not in engine.scheduler.reserved


def test_request_whose_prompt_exceeds_the_pool_is_refused(engine: Engine) -> None:
    huge = PROMPT * 9  # 108 tokens = 27 blocks > 24
    with pytest.raises(CapacityError, match="for its prompt"):
        engine.add_request(EngineRequest("huge", huge, SamplingParams(max_tokens=4)), print)


def test_completion_longer_than_the_pool_runs_until_the_pool_is_full(engine: Engine) -> None:
    long = SamplingParams(max_tokens=100, ignore_eos=True)  # 12 + 99 tokens = 28 blocks > 24
    got = complete(engine, "long", PROMPT, long)
    assert got.finish_reason is FinishReason.LENGTH
    assert len(got.token_ids) == 24 * 4 - len(PROMPT) + 1  # the last one is never fed


def test_prefill_mode_emits_one_token_and_parks_the_prompt_blocks(engine: Engine) -> None:
    sampling = SamplingParams(max_tokens=10, ignore_eos=True, seed=3)
    (out,) = run(engine, [EngineRequest("p", PROMPT, sampling, mode="prefill")])["p"]
    assert len(out.token_ids) == 1 and out.finish_reason is None
    assert out.parked_block_ids is not None and len(out.parked_block_ids) == 3  # 12 tokens / 4
    assert engine.parked["p"] == out.parked_block_ids
    assert engine.load().parked == 1
    engine.free_parked("p")
    engine.free_parked("p")  # idempotent


def test_prefill_mode_with_max_tokens_one_finishes_and_frees(engine: Engine) -> None:
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    (out,) = run(engine, [EngineRequest("p1", PROMPT, sampling, mode="prefill")])["p1"]
    assert out.finish_reason is FinishReason.LENGTH and out.parked_block_ids is None


def test_abort_of_parked_blocks_frees_them(engine: Engine) -> None:
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    run(engine, [EngineRequest("pa", PROMPT, sampling, mode="prefill")])
    engine.abort("pa")
    assert "pa" not in engine.parked


def test_reserve_refuses_what_does_not_fit_and_unreserve_gives_it_back(engine: Engine) -> None:
    sampling = SamplingParams(max_tokens=60)  # reserves the prompt's 3 blocks, not 18
    for i in range(7):  # 21 of 24 blocks; 3 + the 1-block watermark do not fit any more
        assert len(engine.reserve(f"r{i}", PROMPT, sampling).block_ids) == 3
    with pytest.raises(CapacityError):
        engine.reserve("r7", PROMPT, sampling)
    for i in range(8):
        engine.unreserve(f"r{i}")
    engine.unreserve("r0")
    assert engine.kv_cache.get_num_free_blocks() == 24


def test_abort_of_a_running_request_ends_it_with_abort(engine: Engine) -> None:
    outs: list[EngineOutput] = []
    done = threading.Event()
    first = threading.Event()

    def sink(out: EngineOutput) -> None:
        outs.append(out)
        first.set()
        if out.finish_reason is not None:
            done.set()

    sampling = SamplingParams(max_tokens=80, ignore_eos=True)
    engine.add_request(EngineRequest("long", PROMPT, sampling), sink)
    assert first.wait(30)
    engine.abort("long")
    assert done.wait(30)
    assert outs[-1].finish_reason is FinishReason.ABORT
    assert len(outs) < 80


def test_failed_step_ends_its_requests_with_an_error_and_the_loop_goes_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine.runner.execute
    calls = [0]

    def flaky(batch, kv):  # noqa: ANN001
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected")
        return real(batch, kv)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    (failed,) = run(engine, [EngineRequest("f", PROMPT, SamplingParams(max_tokens=4))])["f"]
    assert failed.finish_reason is FinishReason.ERROR and "injected" in (failed.error or "")
    after = complete(engine, "after", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(after.token_ids) == 4


def test_a_raising_sink_does_not_stop_the_engine(engine: Engine) -> None:
    def bad_sink(out: EngineOutput) -> None:
        raise ValueError("sink broke")

    engine.add_request(EngineRequest("bad-sink", PROMPT, SamplingParams(max_tokens=3)), bad_sink)
    got = complete(engine, "good", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(got.token_ids) == 3


def test_duplicate_request_ids_are_refused(engine: Engine) -> None:
    run(engine, [EngineRequest("dup", PROMPT, SamplingParams(max_tokens=3), mode="prefill")])
    try:
        with pytest.raises(InvalidRequestError, match="in use"):
            engine.add_request(EngineRequest("dup", PROMPT, SamplingParams()), lambda out: None)
    finally:
        engine.free_parked("dup")


def test_shutdown_aborts_live_requests_and_is_idempotent(tiny_model_dir: Path) -> None:
    eng = make_engine(tiny_model_dir, num_blocks=128)
    outs: list[EngineOutput] = []
    eng.add_request(
        EngineRequest("s", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True)), outs.append
    )
    eng.reserve("r", PROMPT, SamplingParams(max_tokens=4))
    eng.shutdown()
    eng.shutdown()
    assert outs and outs[-1].finish_reason is FinishReason.ABORT
    assert eng.kv_cache.get_num_free_blocks() == 128
    with pytest.raises(InvalidRequestError):  # a shut-down engine takes nothing new
        eng.add_request(EngineRequest("late", PROMPT, SamplingParams()), outs.append)
