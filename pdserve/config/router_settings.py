"""The ``router`` settings section: the OpenAI-compatible router's listeners (public port and
the embedded registry's internal listener), its limits, retries and migration, and the
KV-aware routing weights.

One pydantic model, :class:`RouterSettings`, declared once like every section (type, default,
range, help, flag: :mod:`pdserve.config.flags`) and re-exported by
:mod:`pdserve.config.settings`, whose ``PdserveConfig.router`` it is. Ports are TCP ports
(0: the OS picks), times are seconds, sizes as each field says. A value out of range, or a
registry port that collides with the public one, raises pydantic's ValidationError when the
section is built (:mod:`pdserve.config.loading` reports it as a ConfigError).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pdserve.config.engine_settings import _Section
from pdserve.config.flags import Flag
from pdserve.config.hosts import WILDCARD_HOSTS, url_host


class RouterSettings(_Section):
    """The OpenAI-compatible router."""

    host: Annotated[str, Flag("--host", ("up", "router"))] = Field(
        default="127.0.0.1", description="router bind address"
    )
    port: Annotated[int, Flag("--port", ("up", "router"))] = Field(
        default=8000,
        ge=0,
        le=65535,
        description="router public HTTP port (/v1, /health, /ready, /metrics)",
    )
    registry_host: Annotated[str | None, Flag("--registry-host", ("up", "router"))] = Field(
        default=None,
        description="bind address of the internal listener that serves the embedded registry "
        "(/registry/*, cluster token; discovery 'embedded' only); default: host",
    )
    registry_port: Annotated[int | None, Flag("--registry-port", ("up", "router"))] = Field(
        default=None,
        ge=0,
        le=65535,
        description="port of the embedded registry's internal listener, never the public "
        "port; default: port + 1 (8001)",
    )
    replicas: Annotated[int, Flag("--routers", ("up",))] = Field(
        default=1,
        ge=1,
        le=64,
        description="router processes pdserve up runs on the one public port (SO_REUSEPORT: "
        "the kernel spreads connections over them); each builds its own view and KV index, "
        "the embedded registry is shared through a SQLite file (registry_store), and the "
        "supervisor restarts a replica that dies, while the others go on serving",
    )
    name: Annotated[str | None, Flag("--router-name", ("router",))] = Field(
        default=None,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="this router replica's name in its logs; pdserve up --routers N names "
        "them router-0 ... router-<N-1>",
    )
    reuse_port: Annotated[bool, Flag("--reuse-port", ("router",))] = Field(
        default=False,
        description="bind the public port and the registry's internal listener with "
        "SO_REUSEPORT, so that several router processes of one host (same user) share them; "
        "pdserve up --routers N sets it",
    )
    registry_store: Annotated[str | None, Flag("--registry-store", ("router",))] = Field(
        default=None,
        description="SQLite file through which the router replicas of one host share the "
        "embedded registry (worker records, KV cache events); default: none, the registry "
        "lives in this process only. pdserve up --routers N sets one in its config folder",
    )
    url: str | None = Field(
        default=None,
        pattern=r"^https?://\S+$",
        description="how workers reach the router's embedded registry (its internal "
        "listener); default: http://<registry_host or 127.0.0.1>:<registry_port>",
    )
    http: Annotated[Literal["httptools", "h11"], Flag("--http", ("up", "router"))] = Field(
        default="httptools",
        description="HTTP/1.1 parser of the router's listeners: httptools (llhttp, C) or h11 "
        "(pure Python, more CPU per request); both close a connection whose request headers "
        "take over 10 s",
    )
    event_loop: Annotated[Literal["uvloop", "asyncio"], Flag("--loop", ("up", "router"))] = Field(
        default="uvloop",
        description="the router's event loop: uvloop (libuv) or asyncio's own (slower "
        "per request; for debugging with asyncio's debug mode)",
    )
    worker_client: Annotated[
        Literal["wire", "httpx"], Flag("--worker-client", ("up", "router"))
    ] = Field(
        default="wire",
        description="HTTP client of the router's calls to its workers: wire (pdserve's own "
        "HTTP/1.1 on httptools, keep-alive pool) or httpx (general purpose, more CPU per "
        "request)",
    )
    request_timeout_s: Annotated[float, Flag("--request-timeout-s", ("up", "router"))] = Field(
        default=1800.0,
        gt=0,
        description="deadline of a request, prefill and decode legs together (a request "
        "without max_tokens may decode to the end of the context window)",
    )
    max_request_bytes: Annotated[int, Flag("--max-request-bytes", ("up", "router"))] = Field(
        default=8 * 2**20, gt=0, description="largest request body, bytes (larger: HTTP 413)"
    )
    tokenizer_threads: Annotated[int, Flag("--tokenizer-threads", ("up", "router"))] = Field(
        default=2,
        ge=1,
        le=64,
        description="threads that apply the chat template and tokenize prompts, off the "
        "event loop; a request finding 4 x max_request_bytes of bodies (or 1024 requests) "
        "already waiting or being tokenized gets HTTP 429 tokenizer_busy",
    )
    max_messages: Annotated[int, Flag("--max-messages", ("up", "router"))] = Field(
        default=2048,
        gt=0,
        le=16384,
        description="most messages in one chat request (at most 16384, the schema's bound)",
    )
    tool_call_parser: Annotated[
        Literal["hermes", "llama3_json"], Flag("--tool-call-parser", ("up", "router"))
    ] = Field(
        default="hermes",
        description="how tool_choice auto replies are read: hermes (<tool_call> tags, also what "
        "a model whose chat template cannot render tools is told to use) or llama3_json",
    )
    special_tokens_in_content: Annotated[
        bool, Flag("--special-tokens-in-content", ("up", "router"))
    ] = Field(
        default=True,
        description="special-token text (<|im_start|>, <|eot_id|>, ...) inside user and tool "
        "message content becomes the control tokens, as in vLLM and SGLang, so content can "
        "open a turn of its own (a system turn); false (--no-special-tokens-in-content): "
        "such text is encoded as plain text, and only the chat template's own special tokens "
        "are control tokens (needs a fast tokenizer)",
    )
    max_n: Annotated[int, Flag("--max-n", ("up", "router"))] = Field(
        default=16, gt=0, le=16, description="most choices (n) in one request (at most 16)"
    )
    peer_pull_min_tokens: Annotated[int, Flag("--peer-pull-min-tokens", ("up", "router"))] = Field(
        default=64,
        ge=0,
        description="peer prefix pull (pdserve/router/peer_pull.py): when another worker's "
        "KV pool holds at least this many more of a prompt's leading tokens than the worker "
        "that will prefill it, that worker pulls them over the transfer plane instead of "
        "computing them; 0 turns it off. Default 64 (4 blocks of 16): measured on 2 CPU "
        "cores (docs/benchmarks.md, 'Peer prefix pull'), a pull's fixed cost (the lend call, "
        "a connection) is a few ms and each block moves in well under a tenth of its "
        "prefill time",
    )
    local_prefill_max_tokens: Annotated[
        int, Flag("--local-prefill-max-tokens", ("up", "router"))
    ] = Field(
        default=256,
        ge=0,
        description="conditional disaggregation (as TensorRT-LLM's and Dynamo's): a prompt "
        "with at most this many tokens left to compute goes straight to a decode worker, "
        "which prefills it itself, instead of through a prefill worker and a KV hand-off; 0 "
        "turns it off (without a usable prefill worker, decode workers prefill every prompt "
        "locally anyway). Default 256: with the default 512-token step "
        "(max_num_batched_tokens) such a prompt fits in one step beside a full running batch "
        "(32 decode tokens), so it costs the decode worker's batch about one step, and on a GPU "
        "a forward of a few hundred tokens is still bound by reading the weights, as a decode "
        "step is; the hand-off would add a second HTTP leg and a KV pull",
    )
    kv_stream_min_tokens: Annotated[int, Flag("--kv-stream-min-tokens", ("up", "router"))] = Field(
        default=0,
        ge=0,
        description="streamed hand-off (the seed's outlook: communication need not wait for the "
        "whole context phase): a disaggregated request with at least this many prompt tokens "
        "(and n = 1) asks the prefill worker for its handle at admission, and the decode worker "
        "pulls each prefill chunk's KV blocks while the next chunks are computed, so its pull "
        "ends right after the prefill; 0 turns it off (default: the whole-request hand-off). "
        "Pays where the transfer is a sizeable part of the prefill (GPUs); on CPUs the "
        "prefill dominates and the gain is small (docs/benchmarks.md)",
    )
    migration_limit: Annotated[int, Flag("--migration-limit", ("up", "router"))] = Field(
        default=3,
        ge=0,
        le=16,
        description="mid-stream migration (Dynamo's migration_limit): how many times one "
        "request whose decode leg failed after it started (worker killed, its registration "
        "lease lost, an in-band error, a worker shutting down) is continued on another decode "
        "or colocated worker, which recomputes the prompt plus the tokens already sent and "
        "goes on exactly where the stream stopped; 0 turns migration off (the client gets the "
        "error)",
    )
    worker_wait_s: Annotated[float, Flag("--worker-wait-s", ("up", "router"))] = Field(
        default=30.0,
        ge=0,
        description="while no worker can serve a request (all restarting), hold it up to this "
        "many seconds (and within its deadline) for a worker to register, instead of answering "
        "503 no_worker at once; also how long a migrating request waits for a decode worker. "
        "0: answer at once",
    )
    worker_wait_max_requests: Annotated[
        int, Flag("--worker-wait-max-requests", ("up", "router"))
    ] = Field(
        default=256,
        ge=0,
        description="most requests held waiting for a worker at once (worker_wait_s); one "
        "more gets 429 at once",
    )
    kv_overlap_weight: Annotated[float, Flag("--router-kv-overlap-weight", ("up", "router"))] = (
        Field(
            default=1.0,
            ge=0,
            description="KV-aware routing (Dynamo's KV router): a worker's cost is kv_overlap_weight"
            " x prompt tokens it does not hold cached + load_weight x its load (requests); the "
            "cheapest worker wins. 0 turns KV-aware routing off (least loaded worker, no expected "
            "cached prefix)",
        )
    )
    load_weight: Annotated[float, Flag("--router-load-weight", ("up", "router"))] = Field(
        default=256.0,
        ge=0,
        description="KV-aware routing: cost of one request on a worker (in flight from this "
        "router, or running + waiting as the worker reports, whichever is larger), in prompt "
        "tokens to compute",
    )

    max_requests_per_worker: Annotated[
        int | None, Flag("--max-requests-per-worker", ("up", "router"))
    ] = Field(
        default=None,
        ge=0,
        description="the router's fair queue: let a request in only while some decode or "
        "colocated worker has fewer requests than this (this router's in flight or the "
        "worker's reported running + waiting); the others wait in the router, served by tenant "
        "(deficit round robin by the API keys' weights) and by priority. Default: "
        "scheduler.max_num_seqs' default (32) when API keys name tenants, else off (requests "
        "queue in the workers); 0: off",
    )
    max_prefills_per_worker: Annotated[int, Flag("--max-prefills-per-worker", ("up", "router"))] = (
        Field(
            default=2,
            ge=1,
            description="fair queue: a request whose prompt needs a prefill worker is let in only "
            "while some prefill worker has fewer requests than this (this router's in their "
            "prefill leg, or its reported running + waiting): a prefill is compute-bound, so a "
            "longer queue there would only be first come, first served",
        )
    )
    tenant_max_queued: Annotated[int, Flag("--tenant-max-queued", ("up", "router"))] = Field(
        default=256,
        ge=0,
        description="fair queue: most requests of one tenant waiting at once (a key's "
        "max_queued overrides); one more gets HTTP 429 tenant_queue_full with Retry-After",
    )
    max_queue_wait_s: Annotated[float, Flag("--max-queue-wait-s", ("up", "router"))] = Field(
        default=60.0,
        gt=0,
        description="fair queue: longest wait of a request for a worker with room (and never "
        "past its deadline); then HTTP 429 queue_timeout",
    )
    session_ttl_s: Annotated[float, Flag("--session-ttl-s", ("up", "router"))] = Field(
        default=600.0,
        gt=0,
        description="session affinity (x-session-id header): a session's next turn prefers "
        "the worker that served its last one (credited with that turn's tokens as its cached "
        "prefix in the KV-aware cost) for this many seconds after the turn",
    )
    max_sessions: Annotated[int, Flag("--max-sessions", ("up", "router"))] = Field(
        default=100_000,
        ge=0,
        description="sessions whose last worker the router remembers (least recently used "
        "dropped first; about 200 bytes each); 0 turns session affinity off",
    )
    session_from_user: Annotated[bool, Flag("--session-from-user", ("up", "router"))] = Field(
        default=False,
        description="take a request's session id from its OpenAI 'user' field when it has no "
        "x-session-id header",
    )

    @model_validator(mode="after")
    def _check_registry_port(self) -> RouterSettings:
        if self.registry_port is None and self.port == 65535:
            raise ValueError("registry_port: port 65535 leaves no port + 1; set registry_port")
        if self.registry_bind_port != 0 and self.registry_bind_port == self.port:
            raise ValueError(
                f"registry_port: the registry's internal listener needs a port of its own, "
                f"not the public port {self.port}"
            )
        return self

    @property
    def registry_bind_host(self) -> str:
        """The address the registry's internal listener binds: ``registry_host``, else
        ``host``."""
        return self.host if self.registry_host is None else self.registry_host

    @property
    def registry_bind_port(self) -> int:
        """The registry listener's port: ``registry_port``, else ``port + 1`` (0 when ``port``
        is 0: the OS picks both)."""
        if self.registry_port is not None:
            return self.registry_port
        return self.port + 1 if self.port else 0

    @property
    def public_url(self) -> str:
        """The router's public base URL (``/v1``, ``/ready``) on this machine:
        ``http://<host, 127.0.0.1 for a wildcard>:<port>``."""
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        return f"http://{url_host(host)}:{self.port}"

    @property
    def registry_url(self) -> str:
        """How workers reach the embedded registry: ``url``, else
        ``http://<registry_bind_host, 127.0.0.1 for a wildcard>:<registry_bind_port>``."""
        if self.url:
            return self.url.rstrip("/")
        host = self.registry_bind_host
        host = "127.0.0.1" if host in WILDCARD_HOSTS else host
        return f"http://{url_host(host)}:{self.registry_bind_port}"
