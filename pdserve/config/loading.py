"""Runtime configs and configuration loading.

The settings themselves are declared once, in :mod:`pdserve.config.settings` (sections, flags,
environment variables). This module layers a YAML file, the environment and command-line
overrides into a validated :class:`~pdserve.config.settings.PdserveConfig` (:func:`load_config`), and
turns it into the frozen runtime configs each process runs on (:func:`worker_config`,
:func:`router_config`): the same section objects plus what resolution adds (the model folder,
the role, the control-plane URL). Derived values are properties.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from pdserve.config.hosts import advertised_host
from pdserve.config.settings import (
    DEFAULT_MODEL,
    ENV_PREFIX,
    DiscoverySettings,
    KVCacheSettings,
    ModelSettings,
    ObservabilitySettings,
    PdserveConfig,
    Role,
    RouterSettings,
    SchedulerSettings,
    SecuritySettings,
    TransferSettings,
    WorkerSettings,
    settings,
)
from pdserve.errors import ConfigError

# --------------------------------------------------------------------------------------------
# Runtime configs: the sections a process runs on, plus what resolution adds
# --------------------------------------------------------------------------------------------


class _Runtime(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineConfig(_Runtime):
    """What an engine (model runner + KV cache manager + scheduler) runs on.

    ``model_path`` is the resolved local Hugging Face model folder (config.json, safetensors,
    tokenizer). The KV pool gets exactly ``kv_cache.num_blocks`` blocks when set, else
    ``kv_cache.budget_mb``, else a share of the machine (:mod:`pdserve.workers.kv.sizing`), of
    ``kv_cache.dtype`` elements, else the model dtype's (attention computes in the model dtype
    and casts K/V on write and read, so a narrower KV dtype halves the pool and the transfer at
    some precision). ``model.dtype`` may be ``auto``: the runner resolves it
    (:func:`pdserve.hardware.choose_dtype`).
    """

    model_path: Path
    served_model_name: str = DEFAULT_MODEL
    model: ModelSettings = ModelSettings()
    kv_cache: KVCacheSettings = KVCacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()


class WorkerConfig(_Runtime):
    """What a worker process runs on: its ``role``, its engine, the transfer section with the
    bind host resolved (the worker's host when unset), its own worker section, the discovery
    section and ``control_plane``, the URL it registers at (the router's embedded registry, or
    the etcd/NATS URL), and the security section (the cluster secret:
    :class:`pdserve.security.ClusterKey`).

    Components take these sections whole and read what they need
    (``cfg.engine.kv_cache.lease_s``, ``cfg.transfer.timeout_s``); a worker section without
    ``worker_id`` gets one here, once (``<role>-<8 hex digits>``), so every reader sees the same
    :attr:`worker_id`."""

    role: Role
    engine: EngineConfig
    transfer: TransferSettings = TransferSettings()
    worker: WorkerSettings = WorkerSettings()
    discovery: DiscoverySettings = DiscoverySettings()
    security: SecuritySettings = SecuritySettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    control_plane: str

    @model_validator(mode="before")
    @classmethod
    def _name_worker(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "role" not in data:
            return data  # pydantic reports what is missing
        worker = data.get("worker") or WorkerSettings()
        if isinstance(worker, Mapping):
            worker = WorkerSettings.model_validate(worker)
        if isinstance(worker, WorkerSettings) and worker.worker_id is None:
            name = f"{data['role']}-{uuid.uuid4().hex[:8]}"
            data = {**data, "worker": worker.model_copy(update={"worker_id": name})}
        return data

    @property
    def worker_id(self) -> str:
        """This worker's unique id (``worker.worker_id``, filled in at construction)."""
        return self.worker.worker_id or ""

    @property
    def transfer_advertised_host(self) -> str:
        """The address peers dial for KV transfer: the worker's ``advertise_host``, else the
        transceiver's bind host (a wildcard: this machine's hostname)."""
        return advertised_host(self.transfer.bind_host, self.worker.advertise_host)


class RouterConfig(_Runtime):
    """What the router runs on: the resolved model folder (for its tokenizer), the served
    name, and the router, discovery, model and security sections."""

    model_path: Path
    served_model_name: str = DEFAULT_MODEL
    router: RouterSettings = RouterSettings()
    discovery: DiscoverySettings = DiscoverySettings()
    model: ModelSettings = ModelSettings()
    security: SecuritySettings = SecuritySettings()
    observability: ObservabilitySettings = ObservabilitySettings()


Sources = dict[tuple[str, ...], str]


def _yaml_with_lines(text: str, name: str) -> tuple[dict[str, Any], Sources]:
    """Parse YAML into a dict and remember ``name:line`` of every leaf key."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        raise ConfigError.from_problems(
            [f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"]
        ) from exc
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError.from_problems(
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

    Only names with ``__`` are settings (``PDSERVE_CONFIG`` and ``PDSERVE_CACHE_DIR`` are not),
    plus the aliases a setting declares (:class:`~pdserve.config.settings.EnvAlias`, e.g.
    ``PDSERVE_API_KEY``); an empty value means null. Strings are converted by the schema's
    types.
    """
    data: dict[str, Any] = {}
    sources: Sources = {}
    for setting in settings():  # aliases first: PDSERVE_<SECTION>__<FIELD> outranks them
        alias = setting.env_alias
        if alias is not None and env.get(alias.name):
            data.setdefault(setting.section, {})[setting.field] = env[alias.name]
            sources[(setting.section, setting.field)] = f"env {alias.name}"
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
            raise ConfigError.from_problems(
                [f"{path}: cannot read the config file: {exc.strerror}"]
            ) from exc
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
        raise ConfigError.from_problems(
            _problems(exc, sources), origin=str(file or "configuration")
        ) from exc


def load_file(file: Path | str) -> PdserveConfig:
    """Validate one YAML file alone (no environment, no flags); raises :class:`ConfigError`."""
    return load_config(file, env={})[0]


def config_schema() -> dict[str, Any]:
    """The JSON schema of :class:`PdserveConfig` (what ``pdserve config schema`` prints)."""
    return PdserveConfig.model_json_schema()


def router_config(cfg: PdserveConfig, model_path: Path) -> RouterConfig:
    """The router's runtime config from the resolved file config."""
    return RouterConfig(
        model_path=model_path,
        served_model_name=served_model_name(cfg, model_path),
        router=cfg.router,
        discovery=cfg.discovery,
        model=cfg.model,
        security=cfg.security,
        observability=cfg.observability,
    )


def served_model_name(cfg: PdserveConfig, model_path: Path) -> str:
    """``model.served_name``, else the default model's name, else the folder name."""
    if cfg.model.served_name:
        return cfg.model.served_name
    return DEFAULT_MODEL if cfg.model.path in (None, Path(DEFAULT_MODEL)) else model_path.name


def worker_config(cfg: PdserveConfig, role: Role, model_path: Path) -> WorkerConfig:
    """A worker's runtime config (``role``: prefill, decode or colocated)."""
    w = cfg.worker(role)
    return WorkerConfig(
        role=role,
        engine=EngineConfig(
            model_path=model_path,
            served_model_name=served_model_name(cfg, model_path),
            model=cfg.model,
            kv_cache=cfg.kv_cache,
            scheduler=cfg.scheduler,
        ),
        transfer=cfg.transfer.model_copy(update={"host": cfg.transfer.host or w.host}),
        worker=w,
        discovery=cfg.discovery,
        security=cfg.security,
        observability=cfg.observability,
        control_plane=cfg.worker_discovery(),
    )


def dump_config(cfg: PdserveConfig, sources: Sources | None = None) -> str:
    """The config as YAML; with ``sources``, each explicitly set value is annotated with
    where it came from (``# env PDSERVE_...``, ``# a.yaml:7``, ``# command line``)."""
    data = cfg.model_dump(mode="json")
    if not sources:
        return str(yaml.safe_dump(data, sort_keys=False))
    lines = []
    for section, fields in data.items():
        lines.append(f"{section}:")
        for field, value in fields.items():
            text = yaml.safe_dump({field: value}, default_flow_style=True, width=1000).strip()
            src = sources.get((section, field))
            lines.append(f"  {text[1:-1]}" + (f"  # {src}" if src else ""))
    return "\n".join(lines) + "\n"
