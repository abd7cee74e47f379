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
(``cfg.scheduler.foo_s``): docs/architecture/config.md works one example through.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
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
from pdserve.config.hosts import advertised_host, is_loopback
from pdserve.config.planner_settings import PlannerSettings
from pdserve.config.router_settings import RouterSettings
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
    "RouterSettings",
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
