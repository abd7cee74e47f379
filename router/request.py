"""A routed request at the router's boundary: what the router was asked to run
(:class:`RequestSpec`, built by the HTTP layer after preprocessing) and what its transaction
streams back, one :class:`TokenEvent` per step of one choice.

Both are frozen values: the HTTP layer owns the spec and the events it receives; nothing here
does I/O or raises (a :class:`~pdserve.protocol.GenerationRequest` built by
:meth:`RequestSpec.generation` validates its fields, pydantic's ValidationError on a wrong one).
Token counts are tokens, ``deadline`` is wall-clock UNIX seconds (``time.time()``), choices are
indexed 0..n-1 (``sampling.n``). :class:`pdserve.router.transaction.Transaction` produces the
events; :mod:`pdserve.server.rendering` turns them into OpenAI chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.observability.tracing import Timeline
from pdserve.protocol import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
    TransferHandle,
)


@dataclass(frozen=True)
class TokenEvent:
    """One step of output of choice ``index``: new token ids, their text and (if asked)
    logprobs. Each choice's last event in a successful transaction has ``finish_reason`` STOP
    or LENGTH. ``cached_tokens``, on the first event of the worker that prefilled the prompt:
    the prompt tokens its prefix cache held (``usage.prompt_tokens_details.cached_tokens``)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    index: int = 0
    cached_tokens: int | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # with cached_tokens, when asked


@dataclass(frozen=True)
class RequestSpec:
    """What the router was asked to run. ``deadline`` is wall-clock UNIX seconds;
    ``session_id``: the conversation it continues (session affinity); ``timeline``: the
    request's (:mod:`pdserve.observability.tracing`), which the legs mark and whose
    span their ``traceparent`` continues."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    deadline: float
    timeline: Timeline
    session_id: str | None = None
    """The client's session (:mod:`pdserve.router.sessions`), if it named one."""
    prefix: TransferHandle | None = None
    """A peer's lease on the prompt's leading blocks (:mod:`pdserve.router.peer_pull`), for the
    leg that prefills the prompt."""

    def generation(self, **fields: Any) -> GenerationRequest:
        """A :class:`GenerationRequest` for this request with ``fields`` (the leg's span's
        ``traceparent`` among them); it carries :attr:`prefix` unless it resumes at a
        ``handle`` (the hand-off brings the whole prompt)."""
        if fields.get("handle") is None:
            fields.setdefault("prefix", self.prefix)
        return GenerationRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            deadline=self.deadline,
            **fields,
        )
