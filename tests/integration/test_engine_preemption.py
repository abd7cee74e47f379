"""The engine under a KV pool too small for everything at once (max_utilization): every request
completes, recompute preemption keeps greedy output equal to a solo run, also on a decode
engine whose sequences arrived by transfer; blocks all come back. Plus ``n`` choices sharing the
prompt's blocks, the waiting-queue bound and requests without ``max_tokens``."""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.errors import CapacityError, QueueFullError
from pdserve.protocol import SamplingParams, StructuredOutput
from pdserve.workers.engine.engine import Engine, EngineOutput, EngineRequest
from tests.support.engine import copy_blocks_bytewise, engine_config, make_engine, run

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "pdserve splits prefill and decode",
    "0123456789abcdef",
    "Hello there, general",
    "KV cache blocks are the unit of allocation.",
    "x",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
Key = tuple[str, int]


def prompts(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def run_choices(
    engine: Engine, reqs: list[EngineRequest], timeout: float = 120.0
) -> dict[Key, list[int]]:
    """Submit ``reqs`` together; tokens of every (request, choice) once each choice finished."""
    tokens: dict[Key, list[int]] = defaultdict(list)
    left = [sum(r.sampling.n for r in reqs)]
    lock, done = threading.Lock(), threading.Event()

    def sink(out: EngineOutput) -> None:
        with lock:
            tokens[(out.request_id, out.index)].extend(out.token_ids)
            assert out.error is None, out.error
            if out.finish_reason is not None:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    for req in reqs:
        engine.add_request(req, sink)
    assert done.wait(timeout), f"choices did not finish in {timeout} s"
    return dict(tokens)


def split_run(
    prefill: Engine, decode: Engine, sampling: SamplingParams, tag: str
) -> dict[int, list[int]]:
    """Every prompt prefilled on ``prefill`` (first token, parked blocks), its blocks copied
    into ``decode``'s reservation, then all resumed together on ``decode``: each prompt's
    tokens, the first one included."""
    resumes = []
    for i, prompt in enumerate(prompts(prefill)):
        rid = f"{tag}-{i}"
        (first,) = run(prefill, [EngineRequest(rid, prompt, sampling, mode="prefill")])[rid]
        assert first.parked_block_ids is not None
        dst = decode.reserve(rid, prompt, sampling).block_ids  # the prompt's blocks only
        copy_blocks_bytewise(prefill, first.parked_block_ids, decode, dst)
        prefill.free_parked(rid)
        token = first.token_ids[0]
        resumes.append((token, EngineRequest(rid, prompt, sampling, "resume", token)))
    got = run_choices(decode, [req for _, req in resumes])
    return {i: [token, *got[(f"{tag}-{i}", 0)]] for i, (token, _) in enumerate(resumes)}


@pytest.fixture(scope="module")
def roomy(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = make_engine(tiny_model_dir, num_blocks=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def solo(roomy: Engine) -> dict[int, list[int]]:
    """Each prompt's greedy tokens, run alone."""
    out = {}
    for i, prompt in enumerate(prompts(roomy)):
        (toks,) = run_choices(roomy, [EngineRequest(f"solo-{i}", prompt, GREEDY)]).values()
        out[i] = toks
    return out


def test_a_pool_too_small_for_all_preempts_and_every_output_equals_its_solo_run(
    tiny_model_dir: Path, solo: dict[int, list[int]]
) -> None:
    # 6 requests of up to ~12 + 40 tokens at 4 tokens/block need ~80 blocks together: give 24
    engine = make_engine(tiny_model_dir, num_blocks=24)
    try:
        reqs = [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(engine))]
        got = run_choices(engine, reqs)
        for i in range(len(reqs)):
            assert got[(f"r{i}", 0)] == solo[i], TEXTS[i]
        assert engine.load().preemptions > 0
        assert engine.kv_cache.get_num_free_blocks() == engine.kv_cache.num_blocks
    finally:
        engine.shutdown()


def test_preemption_on_a_decode_engine_after_transfer_keeps_outputs_equal(
    tiny_model_dir: Path, roomy: Engine, solo: dict[int, list[int]]
) -> None:
    decode = make_engine(tiny_model_dir, num_blocks=48)  # the prompts take 41
    try:
        got = split_run(roomy, decode, GREEDY, "split")
        for i in range(len(TEXTS)):
            assert got[i] == solo[i], TEXTS[i]
        assert decode.load().preemptions > 0
        assert decode.kv_cache.get_num_free_blocks() == decode.kv_cache.num_blocks
    finally:
        decode.shutdown()


def test_a_request_without_max_tokens_runs_on_a_small_pool(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_blocks=16, max_model_len=512)
    try:
        prompt = prompts(engine)[0]
        whole_window = SamplingParams(temperature=0.0, max_tokens=512 - len(prompt))
        (toks,) = run_choices(engine, [EngineRequest("w", prompt, whole_window)]).values()
        assert 0 < len(toks) <= 16 * 4 - len(prompt) + 1  # EOS, or the pool's end ("length")
        assert engine.kv_cache.get_num_free_blocks() == 16
    finally:
        engine.shutdown()
    strict = make_engine(
        tiny_model_dir, num_blocks=16, max_model_len=512, capacity_policy="guaranteed_no_evict"
    )
    try:
        with pytest.raises(CapacityError):
            strict.add_request(EngineRequest("w", prompt, whole_window), lambda out: None)
    finally:
        strict.shutdown()


def test_the_waiting_queue_is_bounded(tiny_model_dir: Path) -> None:
    # not started: no step runs, so every request stays in the waiting queue
    engine = Engine(engine_config(tiny_model_dir, num_blocks=64, max_queued_requests=2))
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=8)
        prompt = prompts(engine)[1]
        engine.add_request(EngineRequest("q0", prompt, sampling), lambda out: None)
        engine.add_request(EngineRequest("q1", prompt, sampling), lambda out: None)
        with pytest.raises(QueueFullError):
            engine.add_request(EngineRequest("q2", prompt, sampling), lambda out: None)
        engine.abort("q0")
        engine._apply_aborts()  # what the step thread does between steps
        engine.add_request(EngineRequest("q2", prompt, sampling), lambda out: None)
    finally:
        engine.shutdown()


SEEDED = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True, n=3)


def test_n_choices_share_the_prompt_blocks_differ_and_repeat(roomy: Engine) -> None:
    prompt = prompts(roomy)[0]
    free = roomy.kv_cache.get_num_free_blocks()
    first = run_choices(roomy, [EngineRequest("n-a", prompt, SEEDED)])
    again = run_choices(roomy, [EngineRequest("n-b", prompt, SEEDED)])
    choices = [first[("n-a", i)] for i in range(3)]
    assert [again[("n-b", i)] for i in range(3)] == choices
    assert all(len(c) == 12 for c in choices)
    assert len({tuple(c) for c in choices}) > 1
    # choice 0 is what the request alone would give with the same seed
    alone = SEEDED.model_copy(update={"n": 1})
    assert run_choices(roomy, [EngineRequest("n-c", prompt, alone)])[("n-c", 0)] == choices[0]
    assert roomy.kv_cache.get_num_free_blocks() == free


def test_n_choices_on_a_decode_engine_equal_the_colocated_ones(
    tiny_model_dir: Path, roomy: Engine
) -> None:
    prompt = prompts(roomy)[4]
    local = run_choices(roomy, [EngineRequest("nl", prompt, SEEDED)])
    decode = make_engine(tiny_model_dir, num_blocks=64)
    try:
        (first,) = run(roomy, [EngineRequest("ns", prompt, SEEDED, mode="prefill")])["ns"]
        assert first.parked_block_ids is not None
        dst = decode.reserve("ns", prompt, SEEDED).block_ids
        copy_blocks_bytewise(roomy, first.parked_block_ids, decode, dst)
        roomy.free_parked("ns")
        resume = EngineRequest("ns", prompt, SEEDED, "resume", first.token_ids[0])
        got = run_choices(decode, [resume])
        assert [first.token_ids[0], *got[("ns", 0)]] == local[("nl", 0)]
        assert got[("ns", 1)] == local[("nl", 1)] and got[("ns", 2)] == local[("nl", 2)]
        assert decode.kv_cache.get_num_free_blocks() == 64
    finally:
        decode.shutdown()


def test_n_choices_with_one_token_each_park_on_prefill_and_finish_on_decode(
    tiny_model_dir: Path, roomy: Engine
) -> None:
    one = SamplingParams(temperature=1.0, max_tokens=1, seed=7, n=2)
    prompt = prompts(roomy)[2]
    (first,) = run(roomy, [EngineRequest("one", prompt, one, mode="prefill")])["one"]
    assert first.finish_reason is not None and first.parked_block_ids is not None
    decode = make_engine(tiny_model_dir, num_blocks=32)
    try:
        dst = decode.reserve("one", prompt, one).block_ids
        copy_blocks_bytewise(roomy, first.parked_block_ids, decode, dst)
        roomy.free_parked("one")
        got = run_choices(decode, [EngineRequest("one", prompt, one, "resume", first.token_ids[0])])
        assert got[("one", 0)] == [] and len(got[("one", 1)]) == 1
        assert decode.kv_cache.get_num_free_blocks() == 32
    finally:
        decode.shutdown()


SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 30, "maxLength": 30}},
    "required": ["note"],
    "additionalProperties": False,
}
STRUCTURED = SamplingParams(
    temperature=0.0,
    max_tokens=60,
    structured=StructuredOutput(kind="json", spec=json.dumps(SCHEMA)),
)


def test_structured_output_survives_transfer_and_preemption_token_for_token(
    tiny_model_dir: Path, roomy: Engine
) -> None:
    """Greedy JSON under a schema: a decode engine that resumes each request from the prefill's
    first token (replayed through the grammar) and preempts under a small pool gives every
    request the tokens of a solo run, each a valid document."""
    solo_json = {}
    for i, prompt in enumerate(prompts(roomy)):
        (toks,) = run_choices(roomy, [EngineRequest(f"jsolo-{i}", prompt, STRUCTURED)]).values()
        solo_json[i] = toks
        assert json.loads(roomy.tokenizer.decode(toks, skip_special_tokens=True))["note"]
    decode = make_engine(tiny_model_dir, num_blocks=48)  # the prompts take 41
    try:
        got = split_run(roomy, decode, STRUCTURED, "jsplit")
        for i in range(len(TEXTS)):
            assert got[i] == solo_json[i], TEXTS[i]
        assert decode.load().preemptions > 0
        assert decode.grammars.compiled == 1, "one schema, compiled once"
        assert decode.kv_cache.get_num_free_blocks() == decode.kv_cache.num_blocks
    finally:
        decode.shutdown()
