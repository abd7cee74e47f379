"""Typed, versioned wire messages shared by the router, the workers and the transfer path.

Every message that crosses a process boundary is one pydantic model here, serialised as JSON.
Peers compare ``PROTOCOL_VERSION`` (HTTP header ``x-pdserve-protocol`` and the transfer
handshake) and the KV layout's ``compat_hash`` before exchanging KV blocks.

Protocol history: docs/protocol-history.md (what each version added; 16: tier-aware KV cache
events, ``KVCacheEvent.medium``).

Clocks: deadlines on the wire are wall-clock UNIX seconds (``time.time()``), never monotonic
readings, because a monotonic clock does not cross processes.
"""

from __future__ import annotations

import hashlib
import json
import time
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

PROTOCOL_VERSION = 17
PROTOCOL_HEADER = "x-pdserve-protocol"


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Traceparent = Annotated[
    str | None,
    Field(
        pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
        description="W3C traceparent of the router's span for this leg (tracing on and "
        "sampled): the worker's spans join that trace",
    ),
]
Phases = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], float],
    Field(
        max_length=32,
        description="the worker's phases of this request, name -> seconds "
        "(pdserve.observability.tracing.Timeline.durations): the router's phase line shows them",
    ),
]


class Role(StrEnum):
    """Worker roles. ``colocated`` runs prefill and decode in one engine (benchmark baseline)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


MAX_TOKENS_PER_BLOCK = 4096
"""Upper bound of ``KVLayout.tokens_per_block`` (``kv_cache.tokens_per_block`` has the same).
A peer's layout arrives in a handshake: bounding it keeps what a converting formatter stages
for that peer proportional to the request's own tokens."""
MAX_LAYOUT_DIM = 4096
"""Upper bound of a layout's layers, KV heads and head size (far above any model's)."""
MAX_TP_SIZE = 64
"""Upper bound of ``KVLayout.tp_size`` (and of ``model.tensor_parallel_size``)."""


def rank_kv_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads (global indices) tensor parallel rank ``rank`` of ``tp_size`` holds:
    ``num_kv_heads // tp_size`` consecutive heads, or, when the heads are fewer than the ranks,
    the one head its query heads attend to (vLLM's replication). Raises ValueError for a rank
    outside ``[0, tp_size)``."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside tp_size {tp_size}")
    if num_kv_heads >= tp_size:
        n = num_kv_heads // tp_size
        return range(rank * n, (rank + 1) * n)
    first = rank * num_kv_heads // tp_size
    return range(first, first + 1)


class KVLayout(_Msg):
    """Geometry of a worker's KV cache pool, its tensor parallel ranks included.

    With ``tp_size`` 1 the pool is one contiguous tensor ``[num_layers, num_blocks, 2,
    tokens_per_block, num_kv_heads, head_dim]`` (index 0 of dim 2 is K, 1 is V); one KV block of
    one layer is ``block_bytes_per_layer`` contiguous bytes. Keys are stored after rotary
    embedding. With ``tp_size`` N > 1 each rank owns a *shard* holding only its KV heads
    (:meth:`rank_heads`), and the pool is the shards rank-major in one buffer
    ``[N, num_layers, num_blocks, 2, tokens_per_block, kv_heads_per_rank, head_dim]``;
    ``block_bytes_per_layer`` is then one shard's block. ``num_kv_heads`` is always the model's.

    Heads per rank follow vLLM: ``num_kv_heads / N`` when N divides the KV heads; when the KV
    heads are fewer than the ranks (N a multiple of them) every rank holds one KV head, the one
    its query heads attend to, so each KV head is replicated on ``N / num_kv_heads`` ranks.
    """

    model: str = Field(max_length=512, description="model identity (name + config digest)")
    num_layers: int = Field(gt=0, le=MAX_LAYOUT_DIM)
    num_kv_heads: int = Field(gt=0, le=MAX_LAYOUT_DIM)
    head_dim: int = Field(gt=0, le=MAX_LAYOUT_DIM)
    tokens_per_block: int = Field(gt=0, le=MAX_TOKENS_PER_BLOCK)
    dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = Field(
        description="KV storage dtype: a torch dtype name without the prefix, e.g. 'float32', "
        "or fp8_e4m3 / fp8_e5m2 (torch's float8_e4m3fn / float8_e5m2, scale 1.0)"
    )
    tp_size: int = Field(
        default=1, gt=0, le=MAX_TP_SIZE, description="tensor parallel ranks holding the pool"
    )

    @model_validator(mode="after")
    def _check_ranks(self) -> KVLayout:
        kvh, tp = self.num_kv_heads, self.tp_size
        if kvh % tp and tp % kvh:
            raise ValueError(
                f"{kvh} KV heads cannot be split over tp_size {tp} ranks (one must divide the "
                "other)"
            )
        return self

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in one rank's shard: ``num_kv_heads // tp_size``, at least 1."""
        return max(1, self.num_kv_heads // self.tp_size)

    def rank_heads(self, rank: int) -> range:
        """The model's KV heads (global indices) rank ``rank`` holds, in shard order; e.g. 3
        heads over 3 ranks: rank 1 -> ``range(1, 2)``; 2 heads over 4 ranks: rank 3 ->
        ``range(1, 2)`` (replicated on ranks 2 and 3)."""
        return rank_kv_heads(self.num_kv_heads, self.tp_size, rank)

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.dtype, 1)

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block of one layer in one rank's shard (K and V):
        ``2 * tpb * kv_heads_per_rank * head_dim * itemsize`` (all KV heads when tp_size 1)."""
        return 2 * self.tokens_per_block * self.kv_heads_per_rank * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id across every layer and rank (what a block costs the pool)."""
        return self.tp_size * self.num_layers * self.block_bytes_per_layer

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers and ranks (replicated heads count
        once per rank that holds them)."""
        return self.block_bytes // self.tokens_per_block

    def compat_hash(self) -> str:
        """Short digest of every field; equal hashes mean byte-compatible pools."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def describe_mismatch(self, other: KVLayout) -> str:
        """Human-readable list of the fields that differ, e.g. ``tokens_per_block: 16 != 32``."""
        diffs = [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in type(self).model_fields
            if getattr(self, name) != getattr(other, name)
        ]
        return ", ".join(diffs) or "none"

    def describe_unmappable(self, dst: KVLayout) -> str:
        """The differences that no KV formatter can bridge when this (prefill) layout is sent
        into ``dst`` (decode), as :meth:`describe_mismatch` writes them; ``""`` when it can.
        ``tokens_per_block`` and ``dtype`` may differ (``pdserve.transfer.formatter.mapping`` re-blocks
        and converts, and maps KV heads between tensor parallel layouts, ``tp_size``); model
        identity, layers, KV heads and head size must be equal."""
        fields = ("model", "num_layers", "num_kv_heads", "head_dim")
        return ", ".join(
            f"{name}: {getattr(self, name)!r} != {getattr(dst, name)!r}"
            for name in fields
            if getattr(self, name) != getattr(dst, name)
        )

    def can_map_to(self, dst: KVLayout) -> bool:
        """True when a formatter maps this (prefill) layout onto ``dst`` (torch-free, so the
        router can pair workers with it)."""
        return not self.describe_unmappable(dst)


MAX_CHOICES = 16
"""Upper bound of ``SamplingParams.n`` (choices per request)."""


class StructuredOutput(_Msg):
    """A constraint on a choice's text (vLLM's ``structured_outputs`` kinds), enforced token by
    token by a grammar (:mod:`pdserve.grammar`).

    ``kind``: ``json`` (``spec`` is a JSON Schema, as JSON text; ``json_object`` is the schema
    ``{"type": "object"}``), ``regex`` (``spec`` is the pattern), ``choice`` (``spec`` is a JSON
    list of strings: the text is exactly one of them) or ``grammar`` (``spec`` is a Lark
    grammar, llguidance's dialect, or a GBNF one as vLLM's xgrammar backend takes). ``whitespace``: whether JSON may hold whitespace between
    tokens; off by default, so output is compact JSON and a model cannot spend ``max_tokens``
    on newlines inside an unfinished object.
    """

    kind: Literal["json", "regex", "choice", "grammar"]
    spec: str
    whitespace: bool = False

    def key(self) -> str:
        """A string naming this constraint (equal constraints, equal keys): the cache key of its
        compiled grammar."""
        return f"{self.kind}:{int(self.whitespace)}:{self.spec}"


MAX_REPETITION_PENALTY = 10.0
"""Largest ``repetition_penalty`` (vLLM sets none; past 2 it already garbles text)."""

MIN_REPETITION_PENALTY = 0.01
"""Smallest ``repetition_penalty`` (vLLM takes any positive one): a seen token's logit grows at
most 100-fold. A smaller factor overflows float32 (1e-300 is 0 there: the logits became inf and
NaN, and the sampler picked whatever argmax made of NaN, often EOS)."""

GREEDY_TEMPERATURE = 1e-5
"""A temperature below this (0 included) is greedy: the argmax, as vLLM (its
``_SAMPLING_EPS``). Dividing logits by a smaller one overflows float32 (5e-324 made them
inf and the softmax NaN); at this one the sampled distribution is the argmax's in practice."""

MAX_LOGIT_BIAS_VALUE = 100.0
"""Largest ``logit_bias`` bias, either sign (OpenAI's range)."""


LogitBiasValue = Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]
"""A ``logit_bias`` bias: finite, within :data:`MAX_LOGIT_BIAS_VALUE` either way."""


class Share(_Msg):
    """A request's claim on a worker's compute where tenants contend, set by the router for a
    request its fair queue admitted (:mod:`pdserve.router.admission`). The worker's scheduler
    gives the next context-phase chunk to the tenant that has had the fewest prompt tokens
    computed lately per unit of ``weight`` (:mod:`pdserve.workers.engine.scheduler`, "Shares"),
    then to the lowest ``priority`` (vLLM's request field: lower is earlier), then to the
    oldest: a short prompt of a quiet tenant waits for one chunk of a flooding tenant's long
    prefills, not for all of them."""

    tenant: str = Field(max_length=64)
    weight: float = Field(default=1.0, gt=0, le=1e6)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)


class SamplingParams(_Msg):
    """Per-request sampling settings.

    A ``temperature`` below :data:`GREEDY_TEMPERATURE` (0 included) means greedy
    (:attr:`greedy`); every value these fields accept keeps the logits finite. ``seed`` makes sampling reproducible: the random draw for
    output position ``i`` depends only on ``(seed, i)``, so it is identical whether the token is
    sampled by the prefill worker (position 0) or the decode worker (positions >= 1).

    ``n`` choices share the prompt's KV blocks; choice ``i`` of a seeded request samples as if
    its seed were ``seed + i`` (vLLM's convention), so the choices differ and each repeats.
    ``max_tokens`` bounds each choice.

    Logits processing (:mod:`pdserve.workers.engine.sampling.sampler`, in vLLM's order): while fewer
    than ``min_tokens`` tokens are out, EOS and ``stop_token_ids`` are masked; ``logit_bias``
    (token id, bias) pairs are added; ``repetition_penalty`` (CTRL's: a logit of a token seen
    in the prompt or the output is divided by it when positive, multiplied when negative), then
    ``frequency_penalty`` x count and ``presence_penalty`` (OpenAI's, over the output only) are
    subtracted; then temperature, ``min_p`` (tokens below ``min_p`` x the top probability are
    dropped), top-k and top-p. A token of ``stop_token_ids`` ends the choice (``stop``) and its
    text is not emitted. Every rule reads only the prompt and the output so far, so a
    disaggregated request samples exactly what a colocated one does.

    ``structured``: the text must match this constraint; tokens that would break it are masked
    before sampling (on both legs: the decode worker replays the prefill's first token through
    the grammar before it samples the second).

    ``share``: not a sampling setting but the request's :class:`Share` of the workers'
    compute, carried here because the sampling settings reach every worker and every engine
    path the request takes (None: no tenant; the scheduler keeps arrival order). Likewise
    ``cache_salt``: the salt of the request's KV block hashes (:mod:`pdserve.block_hash`; the
    client's ``cache_salt`` and, when API keys name tenants, its tenant's), so that its prompt
    never reuses blocks computed for another salt.
    """

    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="choices per request")
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(
        default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    logit_bias: tuple[tuple[int, LogitBiasValue], ...] = Field(
        default=(), description="(token id, bias in [-100, 100]) pairs"
    )
    structured: StructuredOutput | None = None
    share: Share | None = None  # scheduling, not sampling: carried where the request goes
    cache_salt: str | None = Field(default=None, min_length=1, max_length=600)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="the logprob of every prompt token after the first (the prompt is then "
        "computed whole, no prefix-cache reuse) with this many top alternatives; None: none",
    )

    @property
    def greedy(self) -> bool:
        """Whether the sampler takes the argmax: a temperature below
        :data:`GREEDY_TEMPERATURE`, or ``top_k`` 1. Both legs of a request decide alike."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether any rule before temperature changes the logits (penalties, bias, a
        ``min_tokens`` mask): the sampler's all-greedy fast path needs none."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


class TokenLogprob(_Msg):
    """Log-probability (natural log, of the raw model distribution) of one sampled token."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class TransferHandle(_Msg):
    """What a prefill worker hands back for a parked request: enough for a decode worker to pull
    the KV blocks. Ownership: the blocks stay owned by the prefill worker until the decode worker
    releases them or ``lease_deadline`` passes, whichever comes first.

    Fencing: ``epoch`` names the prefill worker's incarnation (its registration epoch) and
    ``lease_id`` the one park of ``block_ids`` it issued (``ParkedBlocks.park``); both sides
    refuse a handle whose epoch, lease id, lease deadline or block ids do not match what the
    prefill worker holds now (``pdserve.workers.roles.parking``).
    """

    worker_id: str
    epoch: int
    request_id: str
    lease_id: str = Field(min_length=1, description="unique per park; binds the handle to it")
    block_ids: tuple[int, ...]
    num_tokens: int = Field(ge=1, description="tokens whose K/V the blocks hold (= prompt length)")
    lease_deadline: float = Field(description="wall-clock UNIX seconds")
    layout: KVLayout
    backend: str = Field(description="transfer backend the prefill worker serves: nixl | ucx | tcp")
    transfer_endpoint: str = Field(description="host:port of the prefill worker's transceiver")
    streamed: bool = Field(
        default=False,
        description="published at admission (streamed hand-off): no block ids yet; the pull "
        "receives each prefill chunk's blocks as they are computed, and the first token last",
    )

    def lease_remaining(self, now: float | None = None) -> float:
        return self.lease_deadline - (time.time() if now is None else now)


PrefixHandle = Annotated[
    TransferHandle | None,
    Field(
        description="peer prefix pull: the lease of the prompt's leading blocks another worker "
        "holds (LendResponse.handle); the worker pulls them into its prefix cache before the "
        "prefill and computes only the rest (a failed pull costs a recompute, never an error)",
    ),
]


class ContextRequest(_Msg):
    """Router -> prefill worker: run the context phase for ``prompt_token_ids``."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    sampling: SamplingParams
    deadline: float = Field(description="wall-clock UNIX seconds")
    traceparent: Traceparent = None
    prefix: PrefixHandle = None


class ContextStarted(_Msg):
    """Prefill worker -> router, first line of ``POST /internal/context/stream``: the request
    was admitted and its KV blocks can be pulled as they are computed, with ``handle``
    (``streamed``: no block ids; its lease lasts until the request's deadline). The
    :class:`ContextResponse` line follows once the first token is sampled."""

    type: Literal["started"] = "started"
    request_id: str
    handle: TransferHandle


class ContextFailed(_Msg):
    """Prefill worker -> router, the last line of ``POST /internal/context/stream`` when the
    prefill failed after :class:`ContextStarted`: the HTTP ``status`` and the error envelope
    (``body``, JSON) a plain ``/internal/context`` would have answered with."""

    type: Literal["failed"] = "failed"
    status: int = Field(ge=400, le=599)
    body: str


class ContextResponse(_Msg):
    """Prefill worker -> router: choice 0's first token and, unless the request already
    finished, the handle of its parked KV blocks.

    With ``sampling.n == 1`` exactly one of ``finish_reason`` and ``handle`` is set. With
    ``n > 1`` the prefill worker always parks (choices 1..n-1 still need the blocks), so
    ``handle`` is always set and ``finish_reason`` is set too when the first token already ended
    choice 0."""

    request_id: str
    first_token: int
    text: str
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    handle: TransferHandle | None = None
    cached_tokens: int = Field(default=0, ge=0, description="prompt tokens the prefix cache held")
    prompt_logprobs: tuple[TokenLogprob | None, ...] = Field(
        default=(), description="with sampling.prompt_logprobs: one per prompt token (None first)"
    )
    phases: Phases = {}


DRAINING_ERROR = "worker_draining"
"""How a decode or colocated worker that shuts down (SIGTERM, ``worker.migrate_on_drain``)
begins the in-band error that ends each running stream: the router migrates those requests."""


class ResumedChoice(_Msg):
    """One choice of a migrated request (``GenerationRequest.resume``): the output tokens the
    client already has (``token_ids``, at most ``max_tokens - 1``) and how many characters of
    that choice's text it got (``text_chars``: text held back for a possible stop string, or
    an incomplete UTF-8 character, is not counted, so the new worker emits it)."""

    index: int = Field(ge=0, lt=MAX_CHOICES, description="choice")
    token_ids: tuple[int, ...] = ()
    text_chars: int = Field(default=0, ge=0)


class GenerationRequest(_Msg):
    """Router -> decode worker. With ``handle``: resume after the prefill worker's first token
    (``first_token`` is choice 0's; the decode worker samples the first token of choices
    1..n-1). Without it (colocated baseline), the worker runs prefill itself.

    ``resume`` (mid-stream migration, no handle and no ``first_token``): the request was
    running on another worker, which died or is shutting down. The worker runs only the listed
    choices (distinct indices < ``sampling.n``; the others finished), each as a recompute
    preemption would (Kwon et al., vLLM): the prompt plus the choice's ``token_ids`` are
    prefilled here, the choice continues at output position ``len(token_ids)`` (so seeded and
    greedy choices sample what the first worker would have), the penalties, ``min_tokens``,
    ``max_tokens``, the grammar and stop strings see those tokens as output, and its text
    resumes after ``text_chars`` characters. Dynamo migrates by re-sending the tokens too but
    restarts the sampler; this continuation is exact."""

    request_id: str
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    sampling: SamplingParams
    deadline: float
    first_token: int | None = None
    handle: TransferHandle | None = None
    resume: tuple[ResumedChoice, ...] | None = Field(default=None, min_length=1)
    traceparent: Traceparent = None
    prefix: PrefixHandle = None

    @model_validator(mode="after")
    def _resume_alone(self) -> GenerationRequest:
        if self.prefix is not None and self.handle is not None:
            raise ValueError("prefix goes without a handle (the hand-off brings the whole prompt)")
        if self.resume is None:
            return self
        if self.handle is not None or self.first_token is not None:
            raise ValueError("resume goes without a handle and without first_token")
        indices = [c.index for c in self.resume]
        if len(set(indices)) != len(indices) or max(indices) >= self.sampling.n:
            raise ValueError(f"resume names choices {indices}; need distinct ones < n")
        if any(len(c.token_ids) >= self.sampling.max_tokens for c in self.resume):
            raise ValueError("a resumed choice has max_tokens tokens already: it is finished")
        return self

    @property
    def choices(self) -> tuple[int, ...]:
        """The choices this request runs: those of ``resume``, else ``0..n-1``."""
        if self.resume is not None:
            return tuple(c.index for c in self.resume)
        return tuple(range(self.sampling.n))


class GenerationChunk(_Msg):
    """One line of the decode worker's NDJSON stream, for choice ``index`` (``0..n-1``; the
    choices' chunks interleave). Each choice's last chunk has ``finish_reason`` set; the stream
    ends after every choice's. An error chunk has ``finish_reason == 'error'`` and ``error`` set.
    A choice that ended at the prefill leg (``ContextResponse.finish_reason``) may get one more
    final chunk without tokens, which the router drops."""

    request_id: str
    index: int = Field(default=0, ge=0, lt=MAX_CHOICES, description="choice")
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = Field(
        default=None,
        max_length=64,
        description="with error, when the request itself is at fault (a 400 code such as "
        "grammar_failed): the router ends it with that error instead of migrating it",
    )
    cached_tokens: int | None = Field(
        default=None,
        ge=0,
        description="on a choice's first chunk when this worker prefilled the prompt: the "
        "prompt tokens its prefix cache held",
    )
    prompt_logprobs: tuple[TokenLogprob | None, ...] = Field(
        default=(), description="as ContextResponse.prompt_logprobs, where this worker prefilled"
    )
    phases: Phases = {}


class WorkerLoad(_Msg):
    """A worker's load: sequences running and waiting, requests parked, KV blocks, and
    counters since start: recompute preemptions, and speculative decoding's verifying steps,
    drafts proposed and drafts accepted."""

    running: int = 0
    waiting: int = 0
    parked: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    preemptions: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class WorkerRecord(_Msg):
    """A worker's discovery record, held under a lease/TTL and refreshed by the worker.

    ``communicator`` is the transfer communicator handle: backend name and transceiver endpoint
    only (NIXL agent metadata and UCX addresses travel in the authenticated transfer handshake,
    never in a record that the registry, etcd or NATS serve).

    ``signature`` proves the record was written by a holder of the cluster secret: 64 hex
    characters, ``ClusterKey.proof("record", signing_bytes()).hex()``, set by the worker's
    registration (:meth:`pdserve.security.ClusterKey.sign_record`) and checked by every watcher
    (:meth:`~pdserve.security.ClusterKey.record_signed`); empty on an unsigned record, which
    watchers drop.
    """

    role: Role
    worker_id: str
    epoch: int
    model: str
    http_url: str = Field(description="request-plane base URL, e.g. http://127.0.0.1:8101")
    communicator: dict[str, str] = Field(default_factory=dict)
    layout: KVLayout
    load: WorkerLoad = WorkerLoad()
    protocol_version: int = PROTOCOL_VERSION
    updated_at: float = Field(default_factory=time.time)
    signature: str = Field(default="", max_length=128, description="hex HMAC of the record")

    def signing_bytes(self) -> bytes:
        """The canonical bytes the signature covers: every field but ``signature`` as compact
        JSON with sorted keys (stable across a JSON round trip: floats print as the shortest
        text that reads back the same)."""
        data = self.model_dump(mode="json", exclude={"signature"})
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


class ReleaseRequest(_Msg):
    """Router -> prefill worker: free a parked request; ``lease_id`` (the handle's, a secret)
    is required and must be the current park's."""

    request_id: str
    epoch: int
    lease_id: str = Field(min_length=1)
