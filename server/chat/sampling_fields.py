"""A request's sampling fields: the unsupported ones refused, the rest (with the structured
output or a tool choice's constraint) mapped into :class:`~pdserve.protocol.SamplingParams`.

Takes the validated request models of :mod:`pdserve.server.chat.schemas` (chat and completions
share ``_SamplingFields``); token ids are checked against ``vocab_size`` (``[0, vocab_size)``),
lengths are in tokens. Pure functions: nothing is kept, nothing is shared between calls.

Errors, each naming the field in ``param``: :class:`~pdserve.errors.UnsupportedFieldError`
(400 ``unsupported``) for a field pdserve does not implement carrying a value that would change
the output (:func:`check_unsupported`); :class:`~pdserve.errors.InvalidRequestError` (400) for
a token id outside the vocabulary, ``min_tokens > max_tokens``, two constraints on the output,
or a constraint past the size caps (:func:`pdserve.grammar.check_size`). The structured output
is only size-checked here; the router's grammar checker compiles it before dispatch
(:mod:`pdserve.server.chat.grammar_checker`).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.errors import InvalidRequestError, UnsupportedFieldError
from pdserve.grammar import JSON_OBJECT_SCHEMA, check_size
from pdserve.protocol import SamplingParams, StructuredOutput
from pdserve.server.chat.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from pdserve.server.chat.schemas import (
    EXTENSION_DEFAULTS,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from pdserve.server.chat.tool_calls import ToolPlan


def _unsupported(param: str, what: str) -> UnsupportedFieldError:
    return UnsupportedFieldError(f"{param} is not supported{what}", param=param)


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def check_unsupported(req: _SamplingFields) -> None:
    """Refuse (400 ``unsupported``, ``param`` naming the field) every field pdserve does not
    implement whose value would change the output; :mod:`pdserve.server.chat.schemas` lists them
    and the values accepted."""
    if isinstance(req, ChatCompletionRequest):
        _check_chat_unsupported(req)
    elif isinstance(req, CompletionRequest):
        if req.suffix:
            raise _unsupported("suffix", "")
        if req.best_of not in (None, requested_choices(req)):
            raise UnsupportedFieldError(
                f"best_of must equal n (got best_of={req.best_of}, n={requested_choices(req)}): "
                "best-of selection is not supported",
                param="best_of",
            )
    for name, value in (req.model_extra or {}).items():
        if name in EXTENSION_DEFAULTS and value is not None and value != EXTENSION_DEFAULTS[name]:
            raise _unsupported(name, f" (only {json.dumps(EXTENSION_DEFAULTS[name])})")


def _check_chat_unsupported(req: ChatCompletionRequest) -> None:
    if not _empty(req.functions):
        raise _unsupported("functions", ": the deprecated form; send tools")
    if req.function_call not in (None, "none", "auto"):
        raise _unsupported("function_call", ": the deprecated form; send tool_choice")
    if req.modalities not in (None, ["text"]):
        raise _unsupported("modalities", ' (only ["text"])')
    for name in ("audio", "reasoning_effort", "web_search_options"):
        if getattr(req, name) is not None:
            raise _unsupported(name, "")
    for i, m in enumerate(req.messages):
        if m.function_call is not None:
            raise _unsupported(f"messages[{i}].function_call", ": functions are not implemented")


def sampling_params(
    req: _SamplingFields,
    max_tokens: int,
    vocab_size: int,
    *,
    logprobs: bool,
    top_logprobs: int,
    tools: ToolPlan | None = None,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> tuple[SamplingParams, str | None]:
    """The worker-side settings of ``req`` (a sampling field it leaves out takes its value in
    ``defaults``, the model's: :mod:`pdserve.server.chat.sampling_defaults`) and the field its
    structured output came from (None without one); raises InvalidRequestError for a
    ``logit_bias`` or ``stop_token_ids`` id outside ``[0, vocab_size)``, for ``min_tokens >
    max_tokens``, for a structured output beside a ``tool_choice`` that constrains the output
    too, and for one past the size caps."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    bias = tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items())
    stop_ids = tuple(req.stop_token_ids or ())
    for name, ids in (("logit_bias", [t for t, _ in bias]), ("stop_token_ids", stop_ids)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{name} token ids must lie in [0, {vocab_size}); got {bad[:5]}", param=name
            )
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens"
        )
    structured, param = structured_output(req)
    calls = None
    if tools is not None and (tools.mode != "auto" or structured is None):
        calls = tools.constraint()  # auto beside a structured output: that one governs
    if calls is not None:
        if structured is not None:
            raise InvalidRequestError(
                "a structured output and tool_choice required or named both constrain the "
                "output; send one",
                param="tool_choice",
            )
        check_size(calls, "tools")
        structured, param = calls, "tools"
    sampling = SamplingParams(
        n=requested_choices(req),
        max_tokens=max_tokens,
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=defaults.top_k if req.top_k is None else max(req.top_k, 0),
        min_p=defaults.min_p if req.min_p is None else req.min_p,
        seed=req.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=stop_ids,
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=(
            defaults.repetition_penalty
            if req.repetition_penalty is None
            else req.repetition_penalty
        ),
        logit_bias=bias,
        structured=structured,
        logprobs=logprobs,
        top_logprobs=top_logprobs if logprobs else 0,
        cache_salt=req.cache_salt,  # the router namespaces it (router.router.cache_salt)
    )
    return sampling, param


def structured_output(req: _SamplingFields) -> tuple[StructuredOutput | None, str | None]:
    """The request's constraint from ``response_format`` (chat), ``structured_outputs`` or
    vLLM's older ``guided_*`` fields (at most one of them), and the field it came from; its
    size checked (:func:`pdserve.grammar.check_size`; the router's grammar checker compiles it
    later, off the tokenizer pool). Raises InvalidRequestError naming the field: two
    constraints, none in a ``structured_outputs`` object, or one past the size caps."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutput(kind="json", spec=JSON_OBJECT_SCHEMA)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError(
                "response_format json_schema needs json_schema.schema",
                param="response_format.json_schema",
            )
        spec = json.dumps(rf.json_schema.schema_)
        found.append(
            ("response_format.json_schema.schema", StructuredOutput(kind="json", spec=spec))
        )
    so = req.structured_outputs
    compact = so is None or so.disable_any_whitespace is not False
    if so is not None:
        given = [
            (name, value)
            for name, value in (
                ("json", so.json_),
                ("json_object", so.json_object or None),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar (got {len(given)})",
                param="structured_outputs",
            )
        found.append(_constraint(f"structured_outputs.{given[0][0]}", *given[0]))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, name)
        if value is not None:
            found.append(_constraint(name, name.removeprefix("guided_"), value))
    if not found:
        return None, None
    if len(found) > 1:
        raise InvalidRequestError(
            f"give one structured output, not {len(found)} ({', '.join(p for p, _ in found)})",
            param=found[1][0],
        )
    param, constraint = found[0]
    if not compact:
        constraint = constraint.model_copy(update={"whitespace": True})
    check_size(constraint, param)
    return constraint, param


def _constraint(param: str, kind: str, value: Any) -> tuple[str, StructuredOutput]:
    if kind == "json_object":
        return param, StructuredOutput(kind="json", spec=JSON_OBJECT_SCHEMA)
    if kind == "json":
        spec = value if isinstance(value, str) else json.dumps(value)
        return param, StructuredOutput(kind="json", spec=spec)
    if kind == "choice":
        return param, StructuredOutput(kind="choice", spec=json.dumps(value))
    return param, StructuredOutput(kind=kind, spec=value)


def requested_choices(req: _SamplingFields) -> int:
    """The number of choices asked for (``n``, default 1)."""
    return 1 if req.n is None else req.n
