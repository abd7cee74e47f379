"""Mid-stream migration on the tiny model (``EngineRequest.resume``, protocol 10): a request
stopped after ``k`` tokens of a choice and resumed on an engine with those tokens and the text
the client had continues exactly: the tokens and the text of every choice, joined, equal an
undisturbed run's (greedy, seeded with penalties and ``n > 1``, stop strings whose held-back
prefix the new engine emits, structured output). Choices left out do not run; blocks all come
back. A choice resumed inside a tool call its first worker opened (auto's lazily triggered
grammar) completes a call of a declared tool whose arguments validate."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol import FinishReason, ResumedChoice, SamplingParams, StructuredOutput
from pdserve.server.chat.tool_calls import ToolPlan
from pdserve.workers.engine.engine import Engine, EngineOutput, EngineRequest
from tests.support.engine import make_engine

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=1.0,
    top_p=0.9,
    seed=4321,
    frequency_penalty=1.0,
    max_tokens=20,
    ignore_eos=True,
    n=2,
)
SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 12, "maxLength": 12}},
    "required": ["note"],
    "additionalProperties": False,
}
STRUCTURED = SamplingParams(
    temperature=0.0,
    max_tokens=40,
    structured=StructuredOutput(kind="json", spec=json.dumps(SCHEMA)),
)


@dataclass
class Choice:
    """One choice as the client saw it: each output's tokens and text, and how it ended."""

    tokens: list[list[int]]
    texts: list[str]
    finish: FinishReason | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for ts in self.tokens for t in ts]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def cut(self, k: int, index: int = 0) -> ResumedChoice:
        """The resume entry after the output carrying the ``k``-th token (one token per
        output here): those tokens, and the characters the client got with them."""
        assert all(len(ts) == 1 for ts in self.tokens[:k])
        return ResumedChoice(
            index=index,
            token_ids=tuple(self.token_ids[:k]),
            text_chars=len("".join(self.texts[:k])),
        )


def run_choices(
    engine: Engine, req: EngineRequest, choices: set[int], timeout: float = 60.0
) -> dict[int, Choice]:
    """Submit ``req``; every choice's outputs once each of ``choices`` finished."""
    got: dict[int, Choice] = defaultdict(lambda: Choice([], []))
    left = set(choices)
    lock, done = threading.Lock(), threading.Event()

    def sink(out: EngineOutput) -> None:
        with lock:
            assert out.error is None, out.error
            choice = got[out.index]
            assert choice.finish is None, f"choice {out.index} got an output after its last"
            choice.tokens.append(out.token_ids)
            choice.texts.append(out.text)
            if out.finish_reason is not None:
                choice.finish = out.finish_reason
                left.discard(out.index)
                if not left:
                    done.set()

    engine.add_request(req, sink)
    assert done.wait(timeout), f"choices {left} did not finish in {timeout} s"
    return dict(got)


def resumed(
    rid: str, prompt: list[int], sampling: SamplingParams, *cuts: ResumedChoice
) -> EngineRequest:
    return EngineRequest(rid, prompt, sampling, resume=tuple(cuts))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = make_engine(tiny_model_dir, num_blocks=256)
    yield eng
    eng.shutdown()


@pytest.fixture
def prompt(engine: Engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)


@pytest.fixture(autouse=True)
def no_leaked_blocks(engine: Engine) -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while engine.kv_cache.holders() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.kv_cache.holders() == [] and not engine._groups and not engine._live


def check_continues(
    engine: Engine, rid: str, prompt: list[int], sampling: SamplingParams, ref: Choice, k: int
) -> Choice:
    """Resume choice 0 of ``ref`` after ``k`` tokens; assert the joined tokens and text equal
    the reference's. Returns the resumed part."""
    cut = ref.cut(k)
    rest = run_choices(engine, resumed(rid, prompt, sampling, cut), {0})[0]
    assert ref.token_ids[:k] + rest.token_ids == ref.token_ids, f"k={k}"
    assert "".join(ref.texts[:k]) + rest.text == ref.text, f"k={k}"
    assert rest.finish == ref.finish
    return rest


def test_greedy_resumed_after_k_tokens_continues_token_for_token(
    engine: Engine, prompt: list[int]
) -> None:
    ref = run_choices(engine, EngineRequest("g", prompt, GREEDY), {0})[0]
    assert len(ref.token_ids) == 24 and ref.finish is FinishReason.LENGTH
    for k in (1, 7, 23):
        rest = check_continues(engine, f"g-{k}", prompt, GREEDY, ref, k)
        assert len(rest.token_ids) == 24 - k
    # a client that got none of the text yet gets all of it from the new worker
    unseen = ResumedChoice(index=0, token_ids=tuple(ref.token_ids[:7]), text_chars=0)
    rest = run_choices(engine, resumed("g-unseen", prompt, GREEDY, unseen), {0})[0]
    assert rest.token_ids == ref.token_ids[7:] and rest.text == ref.text


def test_seeded_choices_with_penalties_resume_each_at_its_own_position(
    engine: Engine, prompt: list[int]
) -> None:
    ref = run_choices(engine, EngineRequest("s", prompt, SEEDED), {0, 1})
    assert ref[0].token_ids != ref[1].token_ids
    plain = SEEDED.model_copy(update={"frequency_penalty": 0.0})
    unpenalized = run_choices(engine, EngineRequest("s-plain", prompt, plain), {0, 1})
    for i in (0, 1):  # (0.5 changes no draw of this model: too peaked)
        assert unpenalized[i].token_ids != ref[i].token_ids, "the penalty must matter"
    cuts = (ref[0].cut(5), ref[1].cut(13, index=1))
    got = run_choices(engine, resumed("s-both", prompt, SEEDED, *cuts), {0, 1})
    for i, k in ((0, 5), (1, 13)):
        assert ref[i].token_ids[:k] + got[i].token_ids == ref[i].token_ids, i
        assert "".join(ref[i].texts[:k]) + got[i].text == ref[i].text, i


def test_only_the_listed_choices_run_and_an_empty_one_starts_fresh_without_forking(
    engine: Engine, prompt: list[int]
) -> None:
    ref = run_choices(engine, EngineRequest("o", prompt, SEEDED), {0, 1})
    # choice 0 finished on the first worker: only choice 1 runs, and the stream ends with it
    got = run_choices(engine, resumed("o-1", prompt, SEEDED, ref[1].cut(9, index=1)), {1})
    assert set(got) == {1} and not engine._groups, "choice 0 ran"
    assert ref[1].token_ids[:9] + got[1].token_ids == ref[1].token_ids
    # choice 0 with no token yet is a fresh choice 0, and forks no choice 1
    fresh = ResumedChoice(index=0)
    got = run_choices(engine, resumed("o-0", prompt, SEEDED, fresh), {0})
    assert set(got) == {0} and got[0].token_ids == ref[0].token_ids
    assert not engine._groups, "a choice 1 was forked"  # the request left with choice 0


def test_a_stop_string_prefix_held_back_by_the_first_worker_is_emitted_once(
    engine: Engine, prompt: list[int]
) -> None:
    free = run_choices(engine, EngineRequest("t-free", prompt, GREEDY), {0})[0]
    stop = free.text[12:15]
    sampling = GREEDY.model_copy(update={"stop": (stop,)})
    ref = run_choices(engine, EngineRequest("t", prompt, sampling), {0})[0]
    assert ref.finish is FinishReason.STOP and ref.text == free.text[: free.text.find(stop)]
    last = len(ref.token_ids)
    for k in range(1, last):
        cut = ref.cut(k)
        held = engine.tokenizer.decode(list(cut.token_ids))[cut.text_chars :]
        # a 3-character stop string: 2 held back, or more with an incomplete character
        assert len(held) >= min(k, 2)
        check_continues(engine, f"t-{k}", prompt, sampling, ref, k)


def test_structured_output_resumes_inside_its_grammar(engine: Engine, prompt: list[int]) -> None:
    ref = run_choices(engine, EngineRequest("j", prompt, STRUCTURED), {0})[0]
    assert json.loads(ref.text)["note"] and ref.finish is FinishReason.STOP
    for k in (3, len(ref.token_ids) - 1):
        check_continues(engine, f"j-{k}", prompt, STRUCTURED, ref, k)


WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE_ARGS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}  # fmt: skip
TOOL_ARGS = {"get_weather": WEATHER_ARGS, "get_time": ZONE_ARGS}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_choice_resumed_inside_an_opened_tool_call_completes_a_declared_valid_call(
    engine: Engine, prompt: list[int], parser: str
) -> None:
    # the random model never opens a call by itself: its first worker "did" (the resumed text)
    tools = tuple(
        {"type": "function", "function": {"name": n, "parameters": a}} for n, a in TOOL_ARGS.items()
    )
    plan = ToolPlan("auto", tools, parser=parser, parallel=False)
    opened = "Checking.<tool_call>" if parser == "hermes" else '{"name": "'
    ids = tuple(engine.tokenizer.encode(opened, add_special_tokens=False))
    names = set()
    for seed in range(4):
        sampling = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=120, structured=plan.constraint()
        )
        cut = ResumedChoice(index=0, token_ids=ids, text_chars=len(opened))
        rest = run_choices(engine, resumed(f"tool-{parser}-{seed}", prompt, sampling, cut), {0})
        _, calls = plan.parse(opened + rest[0].text)
        assert len(calls) == 1, (seed, rest[0].text)
        jsonschema.validate(json.loads(calls[0].arguments), TOOL_ARGS[calls[0].name])
        names.add(calls[0].name)
    assert names <= set(TOOL_ARGS)


def test_a_choice_its_replay_already_ended_finishes_at_once(
    engine: Engine, prompt: list[int]
) -> None:
    eos = min(engine.eos_token_ids)
    sampling = GREEDY.model_copy(update={"ignore_eos": False})
    ended = ResumedChoice(index=0, token_ids=(65, eos), text_chars=1)
    got = run_choices(engine, resumed("e", prompt, sampling, ended), {0})
    assert got[0].tokens == [[]] and got[0].finish is FinishReason.STOP


def test_resumed_tokens_outside_the_vocabulary_or_outside_full_mode_are_refused(
    engine: Engine, prompt: list[int]
) -> None:
    vocab = engine.runner.vocab_size
    bad = ResumedChoice(index=0, token_ids=(65, vocab))
    with pytest.raises(InvalidRequestError, match="resumed token ids"):
        engine.add_request(resumed("v", prompt, GREEDY, bad), lambda out: None)
    fine = ResumedChoice(index=0, token_ids=(65,))
    with pytest.raises(InvalidRequestError):
        engine.add_request(
            EngineRequest("m", prompt, GREEDY, mode="prefill", resume=(fine,)), lambda out: None
        )
    with pytest.raises(InvalidRequestError):  # choice 1 of a one-choice request
        engine.add_request(
            resumed("c", prompt, GREEDY, fine.model_copy(update={"index": 1})), lambda out: None
        )
