"""Input limits and unsupported fields of the router's OpenAI API: each refusal is a 4xx with an
OpenAI error body whose ``param`` names the field, nothing reaches a worker, and the no-op
values of the unsupported fields are accepted (in-process router, fake workers)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from pdserve.config.loading import RouterConfig, load_config
from pdserve.config.settings import RouterSettings
from pdserve.errors import ConfigError
from pdserve.http.error_responses import validation_error
from pdserve.protocol import MAX_CHOICES, Role, StructuredOutput
from pdserve.server.chat.preprocess import Preprocessor
from pdserve.server.chat.schemas import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from tests.support.fakes import MODEL, FakeWorker, build_tokenizer_dir, router_harness

REPLY = [(72, "H"), (105, "i"), (33, "!")]
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "hello"}
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
MAX_BYTES = 4096


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"), max_position_embeddings=64)


def router_cfg(model_dir, **limits: int) -> RouterConfig:
    """A router config with ``limits`` (RouterSettings fields)."""
    return RouterConfig(
        model_path=model_dir, served_model_name=MODEL, router=RouterSettings(**limits)
    )


@pytest.fixture
def cfg(model_dir):
    return router_cfg(model_dir, max_request_bytes=MAX_BYTES, max_messages=3, max_n=4)


def workers() -> list[FakeWorker]:
    return [FakeWorker("p0", Role.PREFILL, REPLY), FakeWorker("d0", Role.DECODE, REPLY)]


def _base(path: str) -> dict[str, Any]:
    return dict(CHAT if path == CHAT_PATH else COMPLETION)


async def _refused(cfg, path: str, body: Any, status: int = 400, **post: Any) -> dict[str, Any]:
    """POST ``body``; assert a ``status`` OpenAI error that reached no worker; return it."""
    async with router_harness(cfg, workers()) as h:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            r = await h.client.post(path, content=body, headers=headers, **post)
        else:
            r = await h.client.post(path, json=body, **post)
        assert h.workers["p0"].contexts == [], "nothing reaches a worker"
        ok = await h.client.post(CHAT_PATH, json=CHAT)
        assert ok.status_code == 200, "the router keeps serving"
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["request_id"] == r.headers["x-request-id"]
    return err


async def _accepted(cfg, path: str, body: dict[str, Any]) -> FakeWorker:
    async with router_harness(cfg, workers()) as h:
        r = await h.client.post(path, json=body)
    assert r.status_code == 200, r.text
    return h.workers["p0"]


# --- request body size -----------------------------------------------------------------------


async def test_a_body_over_the_content_length_limit_is_a_413(cfg):
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BYTES}]}
    err = await _refused(cfg, CHAT_PATH, body, status=413)
    assert err["code"] == "request_too_large" and str(MAX_BYTES) in err["message"]


async def test_a_chunked_body_over_the_limit_is_a_413_without_reading_the_rest(cfg):
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'{"model": "tiny-test", "messages": [{"role": "user", "content": "'
        for _ in range(1000):
            sent += 1
            yield b"x" * 1024
        yield b'"}]}'

    async with router_harness(cfg, workers()) as h:
        r = await h.client.post(
            CHAT_PATH, content=chunks(), headers={"content-type": "application/json"}
        )
        assert "content-length" not in r.request.headers
        assert h.workers["p0"].contexts == []
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert sent <= MAX_BYTES // 1024 + 1, f"read {sent} KiB past a {MAX_BYTES} byte limit"


async def test_a_body_just_under_the_limit_is_served(cfg):
    filler = "x" * (MAX_BYTES - 200)
    await _accepted(cfg, COMPLETION_PATH, {**COMPLETION, "user": filler})


async def test_an_invalid_content_length_is_a_400(cfg):
    async with router_harness(cfg, workers()) as h:
        r = await h.client.post(CHAT_PATH, content=b"{}", headers={"content-length": "2x"})
    assert r.status_code == 400 and "Content-Length" in r.json()["error"]["message"]


# --- limits on fields ------------------------------------------------------------------------

LONG_STOP = "s" * (MAX_STOP_CHARS + 1)

LIMITS = [
    # (path, fields merged into the base body, param, message fragment)
    (CHAT_PATH, {"messages": [{"role": "user", "content": "a"}] * 4}, "messages",
     "too many messages: 4, at most 3"),
    (CHAT_PATH, {"messages": []}, "messages", "must not be empty"),
    (CHAT_PATH, {"messages": "hello"}, "messages", "valid list"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", ""),
    (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content", "needs its text"),
    (CHAT_PATH, {"messages": [{"role": "user"}], "max_tokens": 70}, "max_tokens",
     "maximum context length is 64"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "x" * 80}]}, "messages",
     "leaving no room"),
    (COMPLETION_PATH, {"prompt": list(range(60))}, "max_tokens", "60 in the prompt"),
    (CHAT_PATH, {"stop": ["a", "b", "c", "d", "e"]}, "stop", f"at most {MAX_STOP_SEQUENCES}"),
    (CHAT_PATH, {"stop": LONG_STOP}, "stop", f"at most {MAX_STOP_CHARS} characters"),
    (COMPLETION_PATH, {"stop": ["a", LONG_STOP]}, "stop[1]", f"at most {MAX_STOP_CHARS}"),
    (CHAT_PATH, {"stop": [1]}, "stop", ""),
    (CHAT_PATH, {"n": 0}, "n", "n must lie in [1, 4], got n=0"),
    (COMPLETION_PATH, {"n": 5}, "n", "n must lie in [1, 4], got n=5"),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal"),
    (CHAT_PATH, {"top_logprobs": 0}, "top_logprobs", "requires logprobs"),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than"),
    (COMPLETION_PATH, {"logprobs": 6}, "logprobs", "less than or equal to 5"),
    (COMPLETION_PATH, {"logprobs": -1}, "logprobs", "greater than"),
    (CHAT_PATH, {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    (COMPLETION_PATH, {"max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
    (CHAT_PATH, {"max_completion_tokens": 0}, "max_completion_tokens", "greater than"),
    (COMPLETION_PATH, {"max_tokens": 10**30}, "max_tokens", "maximum context length"),
    (CHAT_PATH, {"seed": 1.5}, "seed", "valid integer"),
    (COMPLETION_PATH, {"seed": "7"}, "seed", "valid integer"),
    (CHAT_PATH, {"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    (COMPLETION_PATH, {"temperature": 2.5}, "temperature", "less than or equal to 2"),
    (CHAT_PATH, {"top_p": 0}, "top_p", "greater than 0"),
    (CHAT_PATH, {"top_k": -2}, "top_k", "greater than or equal to -1"),
    (COMPLETION_PATH, {"prompt": [0, -1]}, "prompt", "token ids must be in"),
    (COMPLETION_PATH, {"prompt": {"text": "x"}}, "prompt", ""),
    (CHAT_PATH, {"stream": "sometimes"}, "stream", "boolean"),
    (CHAT_PATH, {"max_tokens": "5"}, "max_tokens", "valid integer"),  # strict JSON types
    (CHAT_PATH, {"logprobs": 1}, "logprobs", "valid boolean"),
    (COMPLETION_PATH, {"temperature": "0.5"}, "temperature", "valid number"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields", "param", "fragment"), LIMITS)
async def test_a_field_out_of_bounds_is_a_400_naming_it(cfg, path, fields, param, fragment):
    err = await _refused(cfg, path, {**_base(path), **fields})
    assert err["param"] == param and fragment in err["message"], err


@pytest.mark.parametrize("raw", [b"NaN", b"Infinity", b"-Infinity"])
async def test_non_finite_numbers_are_refused(cfg, raw):
    body = b'{"model": "tiny-test", "prompt": "x", "temperature": ' + raw + b"}"
    err = await _refused(cfg, COMPLETION_PATH, body)
    assert err["param"] == "temperature" and "finite" in err["message"]


async def test_values_at_the_bounds_are_served(model_dir):
    cfg = router_cfg(model_dir, max_messages=3)
    stop = ["s" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES
    chat = {**CHAT, "stop": stop, "seed": 2**63 - 1, "logprobs": True, "top_logprobs": 20}
    p0 = await _accepted(cfg, CHAT_PATH, {**chat, "messages": [CHAT["messages"][0]] * 3})
    sampling = p0.contexts[0].sampling
    assert (sampling.stop, sampling.top_logprobs, sampling.seed) == (tuple(stop), 20, 2**63 - 1)
    p0 = await _accepted(cfg, COMPLETION_PATH, {**COMPLETION, "logprobs": 5, "seed": -(2**63)})
    assert p0.contexts[0].sampling.top_logprobs == 5


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64 + 12345, -(10**40)])
async def test_any_integer_seed_is_served_as_the_schema_says(cfg, seed):
    # The OpenAPI document declares seed a plain integer; the server takes every one.
    p0 = await _accepted(cfg, COMPLETION_PATH, {**COMPLETION, "seed": seed})
    assert p0.contexts[0].sampling.seed == seed


def test_n_up_to_max_n_is_accepted(model_dir):
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    pre = Preprocessor(tok, served_model_name=MODEL, max_model_len=64, max_n=4)
    assert pre.chat(ChatCompletionRequest.model_validate({**CHAT, "n": 4})).sampling.n == 4
    assert pre.completion(CompletionRequest.model_validate({**COMPLETION, "n": 1})).sampling.n == 1


def test_max_n_cannot_exceed_what_the_workers_take():
    with pytest.raises(ConfigError, match="router.max_n"):
        load_config(env={"PDSERVE_ROUTER__MAX_N": str(MAX_CHOICES + 1)})


# --- unsupported fields ----------------------------------------------------------------------


UNSUPPORTED = [
    # (path, fields, param)
    (CHAT_PATH, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (CHAT_PATH, {"function_call": {"name": "f"}}, "function_call"),
    (CHAT_PATH, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT_PATH, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT_PATH, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT_PATH, {"web_search_options": {}}, "web_search_options"),
    (CHAT_PATH, {"messages": [{"role": "assistant", "function_call": {"name": "f"}}]},
     "messages[0].function_call"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    (COMPLETION_PATH, {"suffix": "end"}, "suffix"),
    (COMPLETION_PATH, {"best_of": 3}, "best_of"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields", "param"), UNSUPPORTED)
async def test_an_unsupported_field_is_a_400_unsupported_never_ignored(cfg, path, fields, param):
    err = await _refused(cfg, path, {**_base(path), **fields})
    assert (err["code"], err["param"]) == ("unsupported", param), err
    assert "not supported" in err["message"] or "best_of must equal n" in err["message"]


NO_OPS = [
    (CHAT_PATH, {"tools": [], "tool_choice": "none", "parallel_tool_calls": True}),
    (CHAT_PATH, {"tool_choice": "auto", "functions": [], "function_call": "none"}),
    (CHAT_PATH, {"logit_bias": {}, "response_format": {"type": "text"}, "modalities": ["text"]}),
    (CHAT_PATH, {"prediction": {"type": "content", "content": "Hi!"}, "store": False,
                 "metadata": {"k": "v"}, "service_tier": "auto", "user": "u"}),
    (CHAT_PATH, {"messages": [{"role": "assistant", "content": "a", "tool_calls": []},
                              {"role": "user", "content": "b"}]}),
    (CHAT_PATH, {"min_p": 0, "repetition_penalty": 1.0, "add_generation_prompt": True,
                 "some_future_field": {"x": 1}}),
    (CHAT_PATH, {"presence_penalty": 0, "frequency_penalty": 0.0, "stream_options": None}),
    (COMPLETION_PATH, {"echo": False, "suffix": "", "best_of": 1, "logit_bias": None}),
    (COMPLETION_PATH, {"echo": None, "stream": None, "ignore_eos": None, "n": None}),
    (CHAT_PATH, {"logprobs": None, "top_logprobs": None, "stream": None, "stop": None,
                 "stream_options": {"include_usage": None}, "temperature": 1}),
]  # fmt: skip


SAMPLING = [
    # (path, fields, what the prefill worker's SamplingParams carry)
    (CHAT_PATH, {"logit_bias": {"50": 10}, "presence_penalty": 0.5, "frequency_penalty": -1},
     {"logit_bias": ((50, 10.0),), "presence_penalty": 0.5, "frequency_penalty": -1.0}),
    (COMPLETION_PATH, {"logit_bias": {"50": -100}, "min_p": 0.1, "repetition_penalty": 1.2},
     {"logit_bias": ((50, -100.0),), "min_p": 0.1, "repetition_penalty": 1.2}),
    (CHAT_PATH, {"stop_token_ids": [2], "min_tokens": 1, "max_tokens": 4},
     {"stop_token_ids": (2,), "min_tokens": 1, "max_tokens": 4}),
    (CHAT_PATH, {"response_format": {"type": "json_object"}},
     {"structured": StructuredOutput(kind="json", spec='{"type": "object"}')}),
    (COMPLETION_PATH, {"guided_json": {"type": "object"}},
     {"structured": StructuredOutput(kind="json", spec='{"type": "object"}')}),
    # issue 39: a temperature below vLLM's threshold is greedy (was: NaN logits, then EOS)
    (CHAT_PATH, {"temperature": 5e-324, "repetition_penalty": 0.01},
     {"temperature": 5e-324, "greedy": True, "repetition_penalty": 0.01}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields", "expected"), SAMPLING)
async def test_the_sampling_fields_reach_the_workers(cfg, path, fields, expected):
    worker = await _accepted(cfg, path, {**_base(path), **fields})
    sampling = worker.contexts[0].sampling
    assert {k: getattr(sampling, k) for k in expected} == expected


BAD_SAMPLING = [
    # (path, fields, param, fragment of the message)
    (CHAT_PATH, {"presence_penalty": 2.5}, "presence_penalty", "2"),
    (CHAT_PATH, {"logit_bias": {"50": 101}}, "logit_bias", "[-100, 100]"),
    (CHAT_PATH, {"logit_bias": {"fifty": 1}}, "logit_bias", "token ids"),
    (COMPLETION_PATH, {"logit_bias": {"99999": 1}}, "logit_bias", "must lie in [0, "),
    (CHAT_PATH, {"stop_token_ids": [99999]}, "stop_token_ids", "must lie in [0, "),
    (CHAT_PATH, {"min_tokens": 5, "max_tokens": 4}, "min_tokens", "exceeds max_tokens"),
    (CHAT_PATH, {"repetition_penalty": 0}, "repetition_penalty", ""),
    # issue 39: a factor that overflows float32 (the logits became NaN, the sampler emitted EOS)
    (CHAT_PATH, {"repetition_penalty": 1e-300}, "repetition_penalty", "greater than or equal"),
    (COMPLETION_PATH, {"repetition_penalty": 0.009}, "repetition_penalty", "0.01"),
    (CHAT_PATH, {"min_p": 1.5}, "min_p", ""),
    (CHAT_PATH, {"response_format": "text"}, "response_format", ""),
    (CHAT_PATH, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema", "json_schema.schema"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "fields", "param", "fragment"), BAD_SAMPLING)
async def test_a_sampling_value_out_of_range_is_a_400_naming_it(cfg, path, fields, param, fragment):
    err = await _refused(cfg, path, {**_base(path), **fields})
    assert (err["code"], err["param"]) == ("invalid_request", param), err
    assert fragment in err["message"], err


def test_logit_bias_and_stop_token_ids_are_bounded_lists() -> None:
    body = {"model": "m", "prompt": "x"}
    too_many = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(ValidationError, match="logit_bias"):
        CompletionRequest.model_validate({**body, "logit_bias": too_many})
    with pytest.raises(ValidationError, match="stop_token_ids"):
        CompletionRequest.model_validate({**body, "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)})
    ok = {**body, "logit_bias": dict(list(too_many.items())[:-1]), "stop_token_ids": [1, 2]}
    assert len(CompletionRequest.model_validate(ok).logit_bias or {}) == MAX_LOGIT_BIAS


@pytest.mark.parametrize(("path", "fields"), NO_OPS)
async def test_the_no_op_values_of_unsupported_fields_are_accepted(cfg, path, fields):
    await _accepted(cfg, path, {**_base(path), **fields})


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT_PATH, {"messages": [{"role": "bad"}] * 4000 + [{"role": "user", "content": 5}] * 4000},
         "messages[0].role"),
        (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": 5}] * 8000}]},
         "messages[0].content"),
        (COMPLETION_PATH, {"prompt": [[1, "x"]] * 8000}, "prompt"),
    ],
)  # fmt: skip
def test_a_body_of_thousands_of_bad_items_costs_a_handful_of_errors(path, fields, param):
    # Lists stop at their first bad item (and messages at MAX_MESSAGES): the error list the
    # event loop walks does not grow with the body (the hostile-client probe's 8000 messages
    # gave 12000 errors compared pairwise: 54 s on the loop).
    model = ChatCompletionRequest if path == CHAT_PATH else CompletionRequest
    with pytest.raises(ValidationError) as info:
        model.model_validate({**_base(path), **fields})
    assert info.value.error_count() <= 4
    err = validation_error([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    assert err.param == param


def test_the_schema_bounds_messages_whatever_the_setting():
    too_many = {**CHAT, "messages": [CHAT["messages"][0]] * (MAX_MESSAGES + 1)}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(too_many)
    assert info.value.error_count() == 1 and "at most" in str(info.value)
    with pytest.raises(ValidationError):
        RouterSettings(max_messages=MAX_MESSAGES + 1)
