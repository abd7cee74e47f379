"""Turn an OpenAI request into what the router runs: prompt token ids + SamplingParams.

Steps, in order (the first failure raises a typed error, nothing is sent to a worker):

1. model name: must be the served model, else :class:`ModelNotFoundError` (404).
2. unsupported fields (:func:`.sampling_fields.check_unsupported`: ``functions``, ``audio``,
   ``suffix``, ...) are a 400 ``unsupported`` naming the field; then the limits: ``n`` in
   ``[1, max_n]``, ``top_logprobs`` only with ``logprobs``, at most ``max_messages`` messages.
3. prompt -> token ids: chat messages (and tools, :mod:`.tools`) through the chat template
   (its options: ``chat_template_kwargs``, ``add_generation_prompt``,
   ``continue_final_message``; with ``router.special_tokens_in_content`` false, special-token
   text in user and tool content stays plain text, :mod:`.content_guard`), a completion prompt
   (or each of a list) through ``encode``, or the client's own token ids (checked against the
   vocabulary).
4. context window: ``len(prompt) + max_tokens <= max_model_len``, else 400 with the numbers.
   Chat without ``max_tokens`` gets the rest of the window; completions default to 16.
5. sampling (:mod:`.sampling_fields`): the sampling fields, the structured output
   (:func:`~.sampling_fields.structured_output`, compiled once to check it) or a tool choice's
   constraint (``auto``'s only where the request has no structured output of its own), into
   :class:`SamplingParams`.

Step 3 is the costly one (seconds for a multi-megabyte prompt): the router runs
:meth:`Preprocessor.chat` and :meth:`Preprocessor.completions` on its tokenizer pool
(:mod:`.tokenizer_pool`), never on the event loop. A Hugging Face fast tokenizer is called
through its backend's ``encode_batch_fast`` (the Rust encode, GIL released throughout, no
offsets computed: the same ids as ``encode``), and a prompt already past the context window is
refused from its length alone, before its ids become a Python list.

Thread-safety: the tokenizer is only read (the fast path never changes the backend's
truncation or padding); calls may run concurrently on several threads.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from pdserve.config.loading import RouterConfig
from pdserve.errors import (
    ConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedFieldError,
)
from pdserve.protocol import MAX_CHOICES, SamplingParams
from pdserve.server.chat.content_guard import ContentGuard
from pdserve.server.chat.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from pdserve.server.chat.sampling_fields import (
    check_unsupported,
    requested_choices,
    sampling_params,
)
from pdserve.server.chat.schemas import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    TokenizeRequest,
    _SamplingFields,
)
from pdserve.server.chat.tool_calls import (
    PARSERS,
    ToolPlan,
    is_special_token,
    prompt_messages,
    renders_tools,
)
from pdserve.server.chat.tool_grammar import PYTHON_TAG

log = logging.getLogger(__name__)

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
     "continue_final_message", "chat_template", "return_dict", "documents"}
)  # fmt: skip
"""``apply_chat_template`` arguments ``chat_template_kwargs`` may not set (they have fields)."""

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_UNSET_MODEL_MAX = 10**8  # transformers' "no limit" placeholder is ~1e30


@dataclass(frozen=True)
class Prepared:
    """A validated request: what to run and how."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    tools: ToolPlan | None = None  # chat with tools (tool_choice other than none)
    echo: str | None = None  # completions with echo: the prompt's text
    structured_param: str | None = None
    """The field ``sampling.structured`` came from; set with it. The constraint is checked for
    size here and compiled by the router's grammar checker before dispatch
    (:mod:`pdserve.server.chat.grammar_checker`)."""


def load_tokenizer(model_path: Path) -> Any:
    """The model folder's tokenizer (``AutoTokenizer``, local files only). Raises ConfigError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the tokenizer from {model_path}: {exc}") from exc


def context_window(cfg: RouterConfig, tokenizer: Any) -> int:
    """Tokens a request may span (prompt + completion): ``cfg.model.max_model_len``, else the model
    config's ``max_position_embeddings`` (or ``n_positions`` / ``max_seq_len``), else the
    tokenizer's ``model_max_length``. Raises ConfigError when none is known."""
    if cfg.model.max_model_len:
        return cfg.model.max_model_len
    config_file = Path(cfg.model_path) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            value = config.get(key) or config.get("text_config", {}).get(key)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < _UNSET_MODEL_MAX:
        return limit
    raise ConfigError(f"cannot tell the context window of {cfg.model_path}: set max_model_len")


class Preprocessor:
    """Validates and tokenizes requests for one served model; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        served_model_name: str,
        max_model_len: int,
        max_n: int = MAX_CHOICES,
        max_messages: int = 2048,
        tool_call_parser: str = "hermes",
        special_tokens_in_content: bool = True,
        sampling_defaults: SamplingDefaults = OPENAI_DEFAULTS,
    ) -> None:
        self.tokenizer = tokenizer
        self.sampling_defaults = sampling_defaults
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        if not 1 <= max_n <= MAX_CHOICES:
            raise ValueError(f"max_n must lie in [1, {MAX_CHOICES}] (what workers take)")
        self.max_n = max_n
        self.max_messages = max_messages
        self.vocab_size = len(tokenizer)
        self._fast = _fast_backend(tokenizer)
        if tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {PARSERS}")
        self.tool_call_parser = tool_call_parser
        self.template_renders_tools = renders_tools(tokenizer)
        # false: special-token text in user/tool content stays text (ConfigError: no fast
        # tokenizer); vLLM's behaviour, the default, makes it the control tokens
        self.content_guard = None if special_tokens_in_content else ContentGuard(tokenizer)
        self.python_tag_token = is_special_token(tokenizer, PYTHON_TAG)

    def chat(self, req: ChatCompletionRequest) -> Prepared:
        """Validate a chat request and apply the chat template; raises a typed error."""
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        text, plan, guarded = self._render_chat(req)
        if guarded is None:
            n, ids = self._encode(text, add_special_tokens=False)
        else:
            n, ids = len(guarded), guarded
        max_tokens = self._max_tokens(
            n,
            req.max_completion_tokens or req.max_tokens,
            param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
            prompt_param="messages",
        )
        assert ids is not None  # None only past the window, which _max_tokens refused
        sampling, param = sampling_params(
            req,
            max_tokens,
            self.vocab_size,
            logprobs=bool(req.logprobs),
            top_logprobs=req.top_logprobs or 0,
            tools=plan,
            defaults=self.sampling_defaults,
        )
        return Prepared(ids, sampling, plan, structured_param=param)

    def render_chat(self, req: ChatCompletionRequest) -> tuple[str, ToolPlan | None]:
        """The prompt text of ``req``'s messages (and tools) through the chat template, with
        ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``; and
        how its tools are served. Raises InvalidRequestError naming the field."""
        text, plan, _ = self._render_chat(req)
        return text, plan

    def _render_chat(
        self, req: ChatCompletionRequest
    ) -> tuple[str, ToolPlan | None, list[int] | None]:
        """:meth:`render_chat`, plus the prompt's ids where the content guard encoded them
        (:mod:`.content_guard`; None: encode the text as usual)."""
        if not req.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if len(req.messages) > self.max_messages:
            raise InvalidRequestError(
                f"too many messages: {len(req.messages)}, at most {self.max_messages}",
                param="messages",
            )
        plan = self._tool_plan(req)
        base = [_message(m, i) for i, m in enumerate(req.messages)]
        messages = prompt_messages(base, plan, self.template_renders_tools)
        tools = list(plan.tools) if plan is not None and self.template_renders_tools else None
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {reserved}: they have their own fields",
                param="chat_template_kwargs",
            )
        generation = req.add_generation_prompt is not False
        if generation and req.continue_final_message:
            raise InvalidRequestError(
                "continue_final_message needs add_generation_prompt false",
                param="continue_final_message",
            )

        def render(messages: list[dict[str, Any]]) -> str:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=generation,
                    continue_final_message=bool(req.continue_final_message),
                    tokenize=False,
                    **kwargs,
                )
            except (TemplateError, ValueError, TypeError) as exc:
                raise InvalidRequestError(
                    f"cannot apply the chat template: {exc}", param="messages"
                ) from exc
            return str(text)

        if self.content_guard is None:
            return render(messages), plan, None
        guarded = self.content_guard.render(
            base, lambda marked: render(prompt_messages(marked, plan, self.template_renders_tools))
        )
        return guarded.text, plan, guarded.ids

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        """``/tokenize``: all the token ids of ``req``'s prompt or rendered messages (no
        context-window cut: the count is the answer). Raises a typed error naming the field."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            text, special = req.prompt, req.add_special_tokens is not False
        else:
            chat = ChatCompletionRequest.model_validate(
                req.model_dump(exclude={"prompt", "add_special_tokens", "return_token_strs"})
            )
            check_unsupported(chat)  # what a chat request refuses (a function_call message)
            text, _, guarded = self._render_chat(chat)
            special = bool(req.add_special_tokens)
            if guarded is not None and self.content_guard is not None:
                return self.content_guard.with_special_tokens(guarded) if special else guarded
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def detokenize(self, req: DetokenizeRequest) -> str:
        """``/detokenize``: the text of ``req.tokens`` (special tokens kept). Raises
        InvalidRequestError for an id outside the vocabulary."""
        self.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param="tokens"
            )
        return str(self.tokenizer.decode(req.tokens, clean_up_tokenization_spaces=False))

    def _tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        """How the request's tools are served (None: no tools, or ``tool_choice`` none).
        Raises InvalidRequestError: ``tool_choice`` without tools, a named function that is no
        tool, two tools of one name."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise InvalidRequestError(
                    f"tool_choice {choice!r} needs tools", param="tool_choice"
                )
            return None
        if choice == "none":
            return None
        names = [t.function.name for t in req.tools]
        if len(set(names)) < len(names):
            raise InvalidRequestError("two tools share a name", param="tools")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if named is not None and named not in names:
            raise InvalidRequestError(
                f"tool_choice names {named!r}, which is no tool", param="tool_choice"
            )
        return ToolPlan(
            mode="named" if named else "required" if choice == "required" else "auto",
            tools=tuple(t.model_dump(mode="json", exclude_none=True) for t in req.tools),
            named=named,
            parallel=req.parallel_tool_calls is not False,
            parser=self.tool_call_parser,
            python_tag_token=self.python_tag_token,
        )

    def completion(self, req: CompletionRequest) -> Prepared:
        """Validate a completion request of one prompt and tokenize it; raises a typed error
        (a list of several prompts: :meth:`completions`)."""
        (one,) = self.completions(req, most=1)
        return one

    def completions(self, req: CompletionRequest, most: int = MAX_PROMPTS) -> list[Prepared]:
        """Validate a completion request and tokenize its prompts (a list of prompts is a
        batch, at most ``most``): one :class:`Prepared` per prompt, in order. Raises a typed
        error naming the field (``prompt[i]`` for one prompt of a list)."""
        self._check_common(req)
        prompts = _prompt_list(req.prompt)
        if len(prompts) > most:
            raise InvalidRequestError(
                f"at most {most} prompt(s) per request here, got {len(prompts)}", param="prompt"
            )
        out = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            n, ids = self._prompt_ids(prompt, param)
            max_tokens = self._max_tokens(
                n,
                req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
                param="max_tokens",
                prompt_param=param,
            )
            assert ids is not None  # None only past the window, which _max_tokens refused
            sampling, structured_param = sampling_params(
                req,
                max_tokens,
                self.vocab_size,
                logprobs=req.logprobs is not None,
                top_logprobs=req.logprobs or 0,
                defaults=self.sampling_defaults,
            )
            if req.prompt_logprobs is not None or (req.echo and req.logprobs is not None):
                top = max(req.prompt_logprobs or 0, (req.logprobs or 0) if req.echo else 0)
                sampling = sampling.model_copy(update={"prompt_logprobs": top})
            echo = None
            if req.echo:
                echo = prompt if isinstance(prompt, str) else str(self.tokenizer.decode(ids))
            out.append(Prepared(ids, sampling, echo=echo, structured_param=structured_param))
        return out

    @staticmethod
    def needs_tokenizer(req: CompletionRequest) -> bool:
        """Whether preparing ``req`` (:meth:`completions`) runs the tokenizer: a text prompt, or
        ``echo`` (which decodes id prompts). Such a request is prepared on the tokenizer pool;
        one of token ids alone is checked on the event loop, at a cost linear in its ids
        (bounded by the body limit), without the pool's thread hop."""
        return bool(req.echo) or any(isinstance(p, str) for p in _prompt_list(req.prompt))

    # --- steps -------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        """Raise ModelNotFoundError (404) unless ``model`` is the served model's name."""
        if model != self.served_model_name:
            raise ModelNotFoundError(
                f"The model {model!r} does not exist; this server serves "
                f"{self.served_model_name!r}",
                param="model",
            )

    def _check_common(self, req: _SamplingFields) -> None:
        self.check_model(req.model)
        check_unsupported(req)
        if not 1 <= requested_choices(req) <= self.max_n:
            raise InvalidRequestError(f"n must lie in [1, {self.max_n}], got n={req.n}", param="n")

    def _encode(self, text: str, *, add_special_tokens: bool) -> tuple[int, list[int] | None]:
        """``text`` -> ``(token count, ids)``; ids are None when the count alone already fills
        the context window (the caller's window check refuses it), so a huge prompt's ids never
        become a Python list (on the fast path)."""
        if self._fast is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            return len(ids), ids
        (encoding,) = self._fast.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        n = len(encoding)
        return n, (list(encoding.ids) if n < self.max_model_len else None)

    def _prompt_ids(self, prompt: str | list[int], param: str) -> tuple[int, list[int] | None]:
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                param=param,
            )
        return len(prompt), list(prompt)

    def _max_tokens(self, n: int, requested: int | None, *, param: str, prompt_param: str) -> int:
        """Check the context window for a prompt of ``n`` tokens; return max_tokens."""
        window = self.max_model_len
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        if requested is None:
            if window - n < 1:
                raise InvalidRequestError(
                    f"This model's maximum context length is {window} tokens, but the "
                    f"{prompt_param} take {n} tokens, leaving no room for a completion.",
                    param=prompt_param,
                    code="context_length_exceeded",
                )
            return window - n
        if n + requested > window:
            raise InvalidRequestError(
                f"This model's maximum context length is {window} tokens. However, you "
                f"requested {n + requested} tokens ({n} in the {prompt_param}, {requested} "
                f"in the completion). Please reduce the length of the {prompt_param} or "
                f"{param}.",
                param=param,
                code="context_length_exceeded",
            )
        return requested


def _fast_backend(tokenizer: Any) -> Any | None:
    """The Hugging Face fast tokenizer's backend (``tokenizers.Tokenizer``) when calling it
    directly gives the ids ``tokenizer.encode`` gives: it has ``encode_batch_fast`` and no
    truncation or padding configured (``transformers`` would switch those off per call, which
    also makes its ``encode`` unsafe to call from several threads at once). Else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    return backend


def _prompt_list(
    prompt: str | list[int] | list[str] | list[list[int]],
) -> list[str | list[int]]:
    """A completion's prompts: one string or id list, or each of a list of them."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return list(prompt)
    return [prompt]  # type: ignore[list-item]


def _message(m: ChatMessage, index: int) -> dict[str, Any]:
    """A chat message as the template takes it (content text, earlier calls, the call a tool
    result answers)."""
    out: dict[str, Any] = {"role": m.role, "content": _content_text(m.content, index)}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump(mode="json") for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _content_text(content: Any, index: int) -> str:
    """A message's content as one string; text parts are joined with newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text":
            raise UnsupportedFieldError(
                f"content part type {part.type!r} is not supported (only text)",
                param=f"messages[{index}].content",
            )
        if part.text is None:
            raise InvalidRequestError(
                "a text content part needs its text", param=f"messages[{index}].content"
            )
        texts.append(part.text)
    return "\n".join(texts)
