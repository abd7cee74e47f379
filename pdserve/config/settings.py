"""Every pdserve setting, declared once.

Each setting is one field of a section model below (``ModelSettings``, ``KVCacheSettings``, ...):
its name, type, default, range and help live there, and everything else comes from that one
declaration: the YAML file schema (``pdserve config schema``), the environment variable
``PDSERVE_<SECTION>__<FIELD>``, and, for a field annotated with a :class:`Flag`, the
command-line flag on the subcommands the flag names (:mod:`pdserve.cli` builds argparse from
:func:`settings`). The runtime configs of :mod:`pdserve.config.loading` are made of these same section
objects, so no default is stored twice. The design follows SGLang's ``ServerArgs``
(``add_cli_args``/``from_cli_args``: flags generated from one declaration) and mini-sglang's
frozen configs.

Adding a setting read by a component is two edits, its declaration here and its read
(``cfg.scheduler.foo_s``): docs/architecture.md, "Configuration", works one example through.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo

from pdserve.config.engine_settings import (
    DEFAULT_MODEL,
    ENV_CONFIG_FILE,
    ENV_PREFIX,
    EVERY,
    HOST_CACHE_CUDA_MB,
    ROLES,
    SERVING,
    Backend,
    Dtype,
    KVCacheSettings,
    KVDtype,
    ModelDtype,
    ModelSettings,
    SchedulerSettings,
    _Section,
    default_cache_dir,
)
from pdserve.config.flags import OWN_SECTION, EnvAlias, Flag
from pdserve.config.hosts import WILDCARD_HOSTS, advertised_host, is_loopback, url_host
from pdserve.config.planner_settings import PlannerSettings
from pdserve.protocol import Role

__all__ = [
    "DEFAULT_MODEL",
    "ENV_CONFIG_FILE",
    "ENV_PREFIX",
    "EVERY",
    "HOST_CACHE_CUDA_MB",
    "ROLES",
    "SERVING",
    "Backend",
    "Dtype",
    "KVCacheSettings",
    "KVDtype",
    "ModelDtype",
    "ModelSettings",
    "ObservabilitySettings",
    "PdserveConfig",
    "PlannerSettings",
    "Role",
    "SchedulerSettings",
    "Setting",
    "default_cache_dir",
    "settings",
]


class TransferSettings(_Section):
    """KV cache transfer between prefill and decode workers (``auto``: NIXL where it imports,
    else TCP; ``ucx``: ucxx tagged send/receive, :mod:`pdserve.transfer.agents.ucx`)."""

    backend: Annotated[Backend, Flag("--transfer-backend", SERVING)] = Field(
        default="auto", description="nixl, ucx (ucxx), tcp; auto: NIXL where it imports, else TCP"
    )
    host: Annotated[str | None, Flag("--transfer-host", ROLES)] = Field(
        default=None,
        description="transceiver bind address; default: the worker's host (127.0.0.1 alone)",
    )
    port: Annotated[int, Flag("--transfer-port", ROLES)] = Field(
        default=0, ge=0, le=65535, description="transceiver port; 0 picks one"
    )
    timeout_s: Annotated[float, Flag("--transfer-timeout-s", ROLES)] = Field(
        default=30.0, gt=0, description="a KV pull that makes no progress this long fails"
    )
    ucx_devices: Annotated[str | None, Flag("--ucx-devices", ROLES)] = Field(
        default=None, description="UCX net devices for nixl/ucx, e.g. 'lo', 'eth0', 'mlx5_0:1'"
    )
    integrity: Annotated[bool, Flag("--kv-integrity", SERVING)] = Field(
        default=True,
        description="decode side: digest-check every pulled KV segment (--no-kv-integrity: "
        "off; about 0.5 ms per 16 MiB a side)",
    )

    @property
    def bind_host(self) -> str:
        """The address the transceiver listens on: ``host``, else ``127.0.0.1``."""
        return self.host or "127.0.0.1"

    @property
    def net_devices(self) -> str | None:
        """The UCX network devices of the nixl and ucx backends: ``ucx_devices``, else
        ``"lo"`` when the transceiver binds a loopback address (UCX then opens its listeners
        on loopback only, as pdserve's own sockets), else None (UCX's choice: every device,
        and a TCP listener on every interface's address; set ``ucx_devices`` to limit it)."""
        if self.ucx_devices:
            return self.ucx_devices
        return "lo" if is_loopback(self.bind_host) else None


class DiscoverySettings(_Section):
    """How workers and the router find each other (the control plane)."""

    url: Annotated[str, Flag("--discovery", ("router", *ROLES))] = Field(
        default="embedded",
        description="'embedded' (the router hosts a registry), etcd://host:port or "
        "nats://host:port (JetStream); a worker also takes the URL of the router's "
        "embedded registry (http://router:8001: its internal listener, router.registry_port)",
    )
    registration_ttl_s: Annotated[float, Flag("--registration-ttl-s", ("router", *ROLES))] = Field(
        default=10.0, gt=0, description="a silent worker's record expires after this long"
    )
    kv_events: Annotated[bool, Flag("--kv-events", ("up", *ROLES))] = Field(
        default=True,
        description="publish the prefix cache's stored and evicted block hashes (KV events) "
        "through the control plane, for the router's KV-aware routing; needs prefix_caching",
    )
    kv_events_interval_s: Annotated[float, Flag("--kv-events-interval-s", ("up", *ROLES))] = Field(
        default=0.1, gt=0, le=60, description="how often KV events are sent, seconds"
    )
    kv_events_snapshot_s: Annotated[float, Flag("--kv-events-snapshot-s", ("up", *ROLES))] = Field(
        default=10.0,
        gt=0,
        description="how often a worker sends its whole set of cached block hashes, so a "
        "router that joined late or lost events resyncs within this time, seconds",
    )
    ca_file: Annotated[Path | None, Flag("--discovery-ca-file", ("router", *ROLES))] = Field(
        default=None,
        description="etcd/NATS: PEM CA bundle that signed the server's certificate; setting "
        "it (or cert_file) turns TLS on toward the control plane",
    )
    cert_file: Annotated[Path | None, Flag("--discovery-cert-file", ("router", *ROLES))] = Field(
        default=None, description="etcd/NATS: PEM client certificate (mutual TLS)"
    )
    key_file: Annotated[Path | None, Flag("--discovery-key-file", ("router", *ROLES))] = Field(
        default=None, description="etcd/NATS: PEM private key of cert_file"
    )
    nats_credentials_file: Annotated[
        Path | None, Flag("--nats-credentials-file", ("router", *ROLES))
    ] = Field(default=None, description="NATS: user credentials (.creds: JWT + NKey seed)")
    etcd_username: Annotated[str | None, Flag("--etcd-username", ("router", *ROLES))] = Field(
        default=None, description="etcd: user for role-based access control"
    )
    etcd_password_file: Annotated[Path | None, Flag("--etcd-password-file", ("router", *ROLES))] = (
        Field(default=None, description="etcd: file holding etcd_username's password")
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if v == "embedded" or re.fullmatch(r"(etcd|nats)://[^/\s:]+(:\d{1,5})?", v):
            return v
        raise ValueError("must be 'embedded', etcd://host:port or nats://host:port")


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
    url: str | None = Field(
        default=None,
        pattern=r"^https?://\S+$",
        description="how workers reach the router's embedded registry (its internal "
        "listener); default: http://<registry_host or 127.0.0.1>:<registry_port>",
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


class WorkerSettings(_Section):
    """One worker role (prefill, decode or colocated)."""

    replicas: Annotated[int, Flag("--{section}", ("up",), sections=ROLES)] = Field(
        default=1,
        ge=0,
        description="workers `pdserve up` starts (colocated: 0; colocated workers run prefill "
        "and decode in one engine and are served through the same router)",
    )
    host: Annotated[str, Flag("--host", (OWN_SECTION,))] = Field(
        default="127.0.0.1", description="bind address (request plane)"
    )
    port: Annotated[int, Flag("--port", (OWN_SECTION,))] = Field(
        default=0, ge=0, le=65535, description="request-plane port; 0 picks one"
    )
    advertise_host: Annotated[str | None, Flag("--advertise-host", (OWN_SECTION,))] = Field(
        default=None,
        description="address peers use to reach this worker; default: host, or the "
        "hostname when host is a wildcard such as 0.0.0.0",
    )
    worker_id: Annotated[str | None, Flag("--worker-id", (OWN_SECTION,))] = Field(
        default=None, description="unique id; default: role plus a random suffix"
    )
    migrate_on_drain: Annotated[bool, Flag("--migrate-on-drain", (OWN_SECTION,))] = Field(
        default=True,
        description="decode and colocated workers: on SIGTERM, after deregistering, end every "
        "running stream at once with an in-band `worker_draining` error, which the router "
        "answers by migrating the request to another worker (router migration_limit), so a "
        "rolling restart waits for no long generation; false: let running requests finish "
        "(up to the drain timeout)",
    )

    @property
    def advertised_host(self) -> str:
        """The request-plane address peers dial (:func:`advertised_host`)."""
        return advertised_host(self.host, self.advertise_host)


def _split_keys(v: Any) -> Any:
    """An environment variable holds several API keys separated by commas."""
    return [k.strip() for k in v.split(",") if k.strip()] if isinstance(v, str) else v


class SecuritySettings(_Section):
    """Who may talk to pdserve: client API keys (public plane), the cluster secret (internal).

    Public plane: the router's ``/v1/*`` routes take a client API key (``Authorization: Bearer
    KEY``) when any is set. Internal plane: the registry, the
    workers' ``/internal/*`` routes and the KV transceivers need the cluster secret, which the
    router and every worker share (docs/deploy.md, trust model). Secrets are never logged;
    ``pdserve config show`` prints them as ``**********``."""

    api_keys: Annotated[
        list[SecretStr], Flag("--api-key", ("up", "router")), EnvAlias("PDSERVE_API_KEY")
    ] = Field(
        default_factory=list,
        description="client API keys for /v1/* (repeat the flag for several; environment: "
        "comma-separated); none: /v1 is open. A key given as this flag shows in `ps` to "
        "every local user (pdserve warns): prefer --api-key-file or PDSERVE_API_KEY. "
        "`pdserve up` hands its children the keys in a 0600 file, never on their command lines",
    )
    api_key_file: Annotated[Path | None, Flag("--api-key-file", ("up", "router"))] = Field(
        default=None,
        description="file with client API keys, one per line (added to api_keys); keep it "
        "readable by the pdserve user only (chmod 600)",
    )
    cluster_secret_file: Annotated[
        Path | None, Flag("--cluster-secret-file", (*EVERY, "bench serve"))
    ] = Field(
        default=None,
        description="file holding the cluster secret (at least 32 characters) that the router "
        "and every worker share; `pdserve up` makes a fresh one for its processes",
    )
    cluster_secret: SecretStr | None = Field(
        default=None,
        description="the cluster secret itself (environment or file only; prefer "
        "cluster_secret_file, a flag would show in ps)",
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_env(cls, v: Any) -> Any:
        return _split_keys(v)


class SupervisorSettings(_Section):
    """How `pdserve up` restarts a process that exits.

    A process that exits is restarted after a backoff (doubling from restart_backoff_s up to restart_backoff_max_s); more than
    restart_limit restarts of one process within restart_window_s stops the stack."""

    restart_limit: Annotated[int, Flag("--restart-limit", ("up",))] = Field(
        default=5, ge=0, description="restarts of one process within restart_window_s; 0: never"
    )
    restart_window_s: Annotated[float, Flag("--restart-window-s", ("up",))] = Field(
        default=300.0, gt=0, description="the window restart_limit counts in, seconds"
    )
    restart_backoff_s: Annotated[float, Flag("--restart-backoff-s", ("up",))] = Field(
        default=0.5, gt=0, description="delay before the first restart, seconds"
    )
    restart_backoff_max_s: Annotated[float, Flag("--restart-backoff-max-s", ("up",))] = Field(
        default=15.0, gt=0, description="longest delay between restarts, seconds"
    )


class ObservabilitySettings(_Section):
    """Traces and logs (docs/deploy.md, "Observability").

    Tracing (OpenTelemetry, OTLP over HTTP) is off unless otlp_traces_endpoint is set: then the
    router and every worker export one trace per request, joined across processes by the W3C
    traceparent (a client's own is followed). The standard OTEL_* variables (headers, timeout,
    resource attributes) apply too. The router logs one phase line per finished request
    (phase_log; workers log theirs at debug), and JSON logs carry the request id as a field."""

    otlp_traces_endpoint: Annotated[
        str | None,
        Flag("--otlp-traces-endpoint", EVERY),
        EnvAlias("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ] = Field(
        default=None,
        description="OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces (a URL without "
        "a path gets /v1/traces); unset or empty: tracing off",
    )
    trace_sample_ratio: Annotated[float, Flag("--trace-sample-ratio", EVERY)] = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="fraction of requests traced; a request with a traceparent follows its "
        "sampled flag",
    )
    log_format: Annotated[Literal["text", "json"], Flag("--log-format", EVERY)] = Field(
        default="text",
        description="text, or json: one JSON object a line with request_id (and trace_id when "
        "traced) as fields",
    )
    phase_log: Annotated[bool, Flag("--phase-log", EVERY)] = Field(
        default=True,
        description="log each finished request's phases (router: the whole timeline with the "
        "workers' parts) at info",
    )

    @field_validator("otlp_traces_endpoint", mode="before")
    @classmethod
    def _empty_is_off(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"{v!r} is not an http(s) URL (OTLP over HTTP)")
        return v if re.match(r"^https?://[^/]+/.", v) else v.rstrip("/") + "/v1/traces"


class PdserveConfig(_Section):
    """The whole deployment's configuration: one YAML file shared by every role.

    Loaded by :func:`load_config` (layers and sources) or :func:`load_file` (a file alone);
    ``pdserve config schema`` prints its JSON schema.
    """

    model: ModelSettings = ModelSettings()
    kv_cache: KVCacheSettings = KVCacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    transfer: TransferSettings = TransferSettings()
    discovery: DiscoverySettings = DiscoverySettings()
    router: RouterSettings = RouterSettings()
    prefill: WorkerSettings = WorkerSettings()
    decode: WorkerSettings = WorkerSettings()
    colocated: WorkerSettings = WorkerSettings(replicas=0)
    security: SecuritySettings = SecuritySettings()
    supervisor: SupervisorSettings = SupervisorSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    planner: PlannerSettings = PlannerSettings()

    @property
    def router_url(self) -> str:
        """The router's public base URL on this machine (:attr:`RouterSettings.public_url`)."""
        return self.router.public_url

    @property
    def registry_url(self) -> str:
        """The URL workers use to reach the embedded registry, the router's internal listener
        (:attr:`RouterSettings.registry_url`)."""
        return self.router.registry_url

    def worker_discovery(self) -> str:
        """What a worker dials: the registry URL (embedded) or the etcd/NATS URL."""
        return self.registry_url if self.discovery.url == "embedded" else self.discovery.url

    def worker(self, role: str) -> WorkerSettings:
        """The section of ``role`` (``prefill``, ``decode`` or ``colocated``)."""
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[role]


@dataclass(frozen=True)
class Setting:
    """One declared setting, as :func:`settings` lists them: ``section.field`` with its pydantic
    ``info`` (type, default, range, description) and :class:`Flag` (None: file and environment
    only)."""

    section: str
    field: str
    info: FieldInfo
    flag: Flag | None
    env_alias: EnvAlias | None = None

    @property
    def path(self) -> str:
        return f"{self.section}.{self.field}"

    @property
    def env(self) -> str:
        """The environment variable: ``PDSERVE_<SECTION>__<FIELD>``."""
        return f"{ENV_PREFIX}{self.section.upper()}__{self.field.upper()}"

    @property
    def default(self) -> Any:
        return getattr(getattr(PdserveConfig(), self.section), self.field)

    def flag_name(self) -> str | None:
        """The flag with ``{section}`` filled in, or None when this section has none."""
        flag = self.flag
        if flag is None or (flag.sections is not None and self.section not in flag.sections):
            return None
        return flag.name.format(section=self.section)

    def flag_commands(self) -> tuple[str, ...]:
        """The subcommands that take this setting's flag."""
        if self.flag_name() is None:
            return ()
        assert self.flag is not None
        return tuple(self.section if c == OWN_SECTION else c for c in self.flag.commands)


def settings() -> Iterator[Setting]:
    """Every setting of :class:`PdserveConfig`, section by section, in declaration order."""
    for section, sinfo in PdserveConfig.model_fields.items():
        model = sinfo.annotation
        assert isinstance(model, type) and issubclass(model, _Section)
        for name, info in model.model_fields.items():
            flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
            alias = next((m for m in info.metadata if isinstance(m, EnvAlias)), None)
            yield Setting(section, name, info, flag, alias)
