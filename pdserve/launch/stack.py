"""The one way to start a stack: a router and its prefill, decode and colocated workers as child
processes of this one, under one :class:`~pdserve.launch.supervisor.ProcessSupervisor`. ``pdserve up``
(:mod:`pdserve.launch.launcher`), every benchmark that starts pdserve (:mod:`pdserve.bench`) and the
tests' stack (``tests/support/stack.py``) all build their processes here.

Lifecycle of a :class:`Stack` (made from a :class:`StackSpec`)::

    1 CONFIG  write_config(): the spec's settings (the router's port 0 pinned to a free port
              when the stack is made, and then its registry's port, unless set, to another
              one) with their secrets moved into 0600 files, written to
              ``config_dir/config.yaml``; the file names the secret files and holds no secret
    2 START   start(): the router (``router.replicas`` of them, named ``router-<i>``, when
              more than one: they share the port with SO_REUSEPORT and the embedded registry
              through ``registry.sqlite`` in the config folder), then
              ``settings.<role>.replicas`` workers of each role
              (prefill, decode, colocated), named ``<role>-<i>``; or start_router() and
              start_worker() one at a time, later ones too (a test adds a worker mid-run)
    3 READY   wait_ready(): ``GET {url}/ready`` answers 200 and its body lists at least the
              started workers of each role (or what ``accept`` asks for)
    4 STOP    stop(): workers (tier 1) before the router (tier 0) they deregister from, SIGTERM
              then SIGKILL after ``grace_s``; removes a config folder the stack made itself.
              Idempotent; also run on leaving the ``with`` block

Every process runs ``pdserve --log-level L ROLE --config FILE`` (a worker with ``--worker-id
NAME``) followed by the spec's extra arguments for its role, then for its name, then those of
the call that starts it: flags outrank the file, so a later flag wins. The children all read
the same file: give per-worker values (a port, a host) as arguments.

What the stack does not do: resolve settings for a host (``pdserve up`` splits threads and the
KV memory between its workers first, :func:`pdserve.launch.launcher.child_config`), restart children
(the caller runs :meth:`~pdserve.launch.supervisor.ProcessSupervisor.watch` on :attr:`Stack.supervisor`)
or check that the router's port is free.

Thread-safety: none, like the supervisor underneath; drive a stack from one thread.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml

from pdserve.config.hosts import free_port
from pdserve.config.settings import ENV_PREFIX, ROLES, PdserveConfig, settings
from pdserve.launch.supervisor import ManagedProcess, ProcessSpec, ProcessSupervisor, pdserve_argv
from pdserve.security import (
    ClusterKey,
    generate_secret,
    load_api_keys,
    parse_key_entry,
    write_secret_file,
)

if TYPE_CHECKING:
    import httpx

ROUTER_TIER, WORKER_TIER = 0, 1
"""Stop tiers: the supervisor stops the highest first, so workers go before the router."""
CONFIG_FILE = "config.yaml"
REGISTRY_STORE_FILE = "registry.sqlite"
CLUSTER_SECRET_FILE = "cluster-secret"
API_KEY_FILE = "api-keys"


def child_env() -> dict[str, str]:
    """This environment minus ``PDSERVE_<SECTION>__<FIELD>`` settings and their aliases
    (``PDSERVE_API_KEY``): the children's config file is already resolved, and a variable would
    otherwise outrank it (or hand a child a secret the file left out)."""
    aliases = {s.env_alias.name for s in settings() if s.env_alias is not None}
    return {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(ENV_PREFIX) and "__" in k) and k not in aliases
    }


def write_child_secrets(cfg: PdserveConfig, folder: Path) -> PdserveConfig:
    """``cfg`` with its secrets moved into 0600 files of ``folder`` (a private folder that
    lives as long as the children), so the children's config file holds none.

    - Cluster secret: ``security.cluster_secret`` when given, else a fresh
      :func:`~pdserve.security.generate_secret`, is written to ``folder/cluster-secret`` and
      named by ``security.cluster_secret_file``; a ``cluster_secret_file`` the user gave is
      kept as it is (other processes may share that secret).
    - Client API keys: when ``security.api_keys`` holds any (flags, environment, file; a
      :class:`~pydantic.SecretStr` dumps as ``**********``), they and the lines of
      ``security.api_key_file`` go to ``folder/api-keys``, named by ``security.api_key_file``,
      and ``api_keys`` is emptied.

    Raises :class:`~pdserve.errors.ConfigError` when the user's API key file cannot be read.
    """
    sec = cfg.security
    update: dict[str, object] = {"cluster_secret": None}
    if sec.cluster_secret is not None or sec.cluster_secret_file is None:
        text = sec.cluster_secret.get_secret_value().strip() if sec.cluster_secret else None
        path = write_secret_file(folder / CLUSTER_SECRET_FILE, text or generate_secret())
        update["cluster_secret_file"] = path
    if sec.api_keys:
        keys = load_api_keys(sec)
        update["api_key_file"] = write_secret_file(folder / API_KEY_FILE, "\n".join(keys))
        update["api_keys"] = []
    return cfg.model_copy(update={"security": sec.model_copy(update=update)})


def write_child_config(cfg: PdserveConfig, folder: Path) -> Path:
    """Move ``cfg``'s secrets into files (:func:`write_child_secrets`) and write the children's
    config to ``folder/config.yaml``; returns its path. Raises ConfigError as that does."""
    return _write_config(write_child_secrets(cfg, folder), folder)


def _write_config(child: PdserveConfig, folder: Path) -> Path:
    config_file = folder / CONFIG_FILE
    config_file.write_text(yaml.safe_dump(child.model_dump(mode="json"), sort_keys=False))
    return config_file


def process_argv(
    role: str,
    config_file: Path,
    log_level: str,
    *,
    name: str | None = None,
    args: Sequence[str] = (),
) -> list[str]:
    """The argv of one stack process: ``pdserve ROLE --config FILE``, ``--worker-id NAME`` for
    a worker (``name`` given), then ``args``."""
    ident = ["--worker-id", name] if name is not None and role != "router" else []
    return pdserve_argv([role, "--config", str(config_file), *ident, *args], log_level=log_level)


def worker_names(cfg: PdserveConfig) -> list[tuple[str, str]]:
    """(role, name) of every worker ``cfg`` asks for: ``settings.<role>.replicas`` of each role,
    named ``<role>-<i>``, prefill first, then decode, then colocated."""
    return [(role, f"{role}-{i}") for role in ROLES for i in range(cfg.worker(role).replicas)]


def worker_commands(
    cfg: PdserveConfig, config_file: Path, log_level: str
) -> list[tuple[str, list[str]]]:
    """The (name, argv) of every worker child: ``--config`` plus a distinct ``--worker-id``."""
    return [
        (name, process_argv(role, config_file, log_level, name=name))
        for role, name in worker_names(cfg)
    ]


def all_registered(ready: Mapping[str, Any], expected: tuple[int, ...]) -> bool:
    """Whether the router's ``/ready`` body lists at least ``expected`` workers of each role
    (prefill, decode, then colocated when given), each role on its own."""
    return all(len(ready.get(role, ())) >= n for role, n in zip(ROLES, expected, strict=False))


@dataclass(frozen=True)
class StackSpec:
    """What to start and how.

    ``settings``: what the children read (resolve them for the host first where that matters:
    :func:`pdserve.launch.launcher.child_config`); ``settings.<role>.replicas`` workers of each role
    start with :meth:`Stack.start`; a router port of 0 becomes a free port of the router's host
    (and an unset registry port another one).
    ``config_dir``: where the config file and the secret files go (made 0700 when missing);
    None: a private temporary folder, removed at :meth:`Stack.stop`. ``log_dir``: each process
    logs stdout + stderr into ``log_dir/<name>.log``; None: they inherit this process's streams.
    ``env``: the children's environment; None: :func:`child_env`. ``args``: extra arguments
    keyed by role (``router``, ``prefill``, ...) or by process name (``prefill-0``), see the
    module docstring. ``new_session``: each child in a session of its own (a terminal's Ctrl-C
    reaches only this process). ``grace_s``: seconds each stop tier gets after SIGTERM;
    ``poll_s``: the interval of every wait, seconds; ``notify``: receives the supervisor's
    lines (kills, restarts). ``place``: rewrites each process's spec before it starts (role,
    spec) -> spec, e.g. to run it in a network namespace.
    """

    settings: PdserveConfig
    config_dir: Path | None = None
    log_dir: Path | None = None
    log_level: str = "info"
    env: Mapping[str, str] | None = None
    args: Mapping[str, Sequence[str]] = field(default_factory=dict)
    new_session: bool = False
    grace_s: float = 10.0
    poll_s: float = 0.3
    notify: Callable[[str], None] | None = None
    place: Callable[[str, ProcessSpec], ProcessSpec] | None = None


class Stack:
    """The processes of one :class:`StackSpec` (module docstring for the lifecycle).

    Owns its :attr:`supervisor` (and so every child it starts) and a config folder it made
    itself; a ``config_dir`` or ``log_dir`` the spec names stays. :attr:`settings`: what the
    children read (the router port pinned; after :meth:`write_config`, the secrets as files).
    Making one starts nothing; it raises OSError only when the router's port is 0 and no port
    of the router's host can be bound.
    """

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        cfg = spec.settings
        if cfg.router.port == 0:
            r = cfg.router
            update: dict[str, Any] = {"port": free_port(r.host)}
            if r.registry_port is None:  # not port + 1: that one may be taken
                update["registry_port"] = free_port(r.registry_bind_host)
            cfg = cfg.model_copy(update={"router": r.model_copy(update=update)})
        self.settings = cfg
        self.supervisor = ProcessSupervisor(
            grace_s=spec.grace_s, poll_s=spec.poll_s, notify=spec.notify
        )
        self.roles: dict[str, str] = {}
        """Process name -> role, of every process started."""
        self._config_file: Path | None = None
        self._own_dir: Path | None = None
        self._env = dict(child_env() if spec.env is None else spec.env)

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The router's base URL (``/v1`` is the OpenAI API; ``/ready`` what the stack waits
        for): :attr:`PdserveConfig.router_url`."""
        return self.settings.router_url

    @property
    def registry_url(self) -> str:
        """The router's embedded registry (its internal listener: ``/registry/*`` with the
        cluster token), where the workers register: :attr:`PdserveConfig.registry_url`."""
        return self.settings.registry_url

    @property
    def procs(self) -> dict[str, ManagedProcess]:
        """The processes by name, the latest of each name (a restart replaces its process)."""
        return {p.name: p for p in self.supervisor.processes}

    @property
    def cluster_key(self) -> ClusterKey:
        """The key of the children's cluster secret (for the internal routes); writes the
        config first when needed. Raises ConfigError when the secret cannot be read."""
        self.write_config()
        return ClusterKey.from_settings(self.settings.security)

    def api_headers(self) -> dict[str, str]:
        """``Authorization`` for the router's ``/v1`` when the children have client API keys
        (the first one), else none; writes the config first when needed."""
        self.write_config()
        keys = load_api_keys(self.settings.security)
        return {"Authorization": f"Bearer {parse_key_entry(keys[0])[0]}"} if keys else {}

    def write_config(self) -> Path:
        """Write the children's config file and secret files once (module docstring, step 1);
        returns the file's path. Raises ConfigError when an API key file of the settings
        cannot be read, OSError when the folder cannot be written."""
        if self._config_file is not None:
            return self._config_file
        folder = self.spec.config_dir
        if folder is None:
            folder = self._own_dir = Path(tempfile.mkdtemp(prefix="pdserve-stack-"))
        else:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.settings = with_router_replicas(write_child_secrets(self.settings, folder), folder)
        self._config_file = _write_config(self.settings, folder)
        return self._config_file

    def process_spec(self, role: str, name: str, args: Sequence[str] = ()) -> ProcessSpec:
        """How process ``name`` of ``role`` starts (module docstring), after the spec's
        ``place``; writes the config first when needed."""
        extra = [*self.spec.args.get(role, ())]
        if name != role:
            extra += self.spec.args.get(name, ())
        argv = process_argv(
            role, self.write_config(), self.spec.log_level, name=name, args=[*extra, *args]
        )
        log = self.spec.log_dir / f"{name}.log" if self.spec.log_dir is not None else None
        tier = ROUTER_TIER if role == "router" else WORKER_TIER
        spec = ProcessSpec(name, argv, dict(self._env), log, self.spec.new_session, tier)
        return self.spec.place(role, spec) if self.spec.place is not None else spec

    def _spawn(self, role: str, name: str, args: Sequence[str]) -> ManagedProcess:
        spec = self.process_spec(role, name, args)
        if self.spec.log_dir is not None:
            self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        process = self.supervisor.spawn(spec)
        self.roles[name] = role
        return process

    def router_names(self) -> list[str]:
        """``["router"]``, or ``router-0`` ... for ``router.replicas`` > 1."""
        n = self.settings.router.replicas
        return ["router"] if n == 1 else [f"router-{i}" for i in range(n)]

    def start_router(self, args: Sequence[str] = ()) -> ManagedProcess:
        """Start the router, every replica of it (``args`` after the spec's; a replica also
        gets ``--router-name NAME``); returns the first. Raises OSError when it cannot run."""
        self.write_config()
        names = self.router_names()
        started = [
            self._spawn(
                "router", name, [*args, *(["--router-name", name] if len(names) > 1 else [])]
            )
            for name in names
        ]
        return started[0]

    def start_worker(
        self, role: str, name: str | None = None, args: Sequence[str] = ()
    ) -> ManagedProcess:
        """Start one worker of ``role`` (``prefill``, ``decode``, ``colocated``) named ``name``
        (default ``<role>-<n>``, n the workers of that role started so far), ``args`` after
        the spec's. Raises ValueError for another role, OSError when it cannot run."""
        if role not in ROLES:
            raise ValueError(f"no worker role {role!r} (one of {', '.join(ROLES)})")
        name = name or f"{role}-{sum(1 for r in self.roles.values() if r == role)}"
        return self._spawn(role, name, args)

    def start(self) -> None:
        """Start the router, then every worker the settings ask for (:func:`worker_names`).
        Raises ConfigError (secrets) or OSError as the steps do; what started keeps running
        until :meth:`stop`."""
        self.write_config()
        self.start_router()
        for role, name in worker_names(self.settings):
            self.start_worker(role, name)

    def expected(self) -> dict[str, int]:
        """Workers of each role started and not stopped on purpose (a killed one is not
        expected back)."""
        counts = Counter(
            self.roles[p.name]
            for p in self.supervisor.processes
            if p.tier == WORKER_TIER and not p.stopped
        )
        return {role: counts.get(role, 0) for role in ROLES}

    def wait_ready(
        self,
        timeout_s: float,
        *,
        what: str = "the stack",
        accept: Callable[[dict[str, Any]], bool] | None = None,
        stopping: Callable[[], bool] | None = None,
    ) -> bool:
        """Wait until the router's ``/ready`` answers 200 and its JSON body lists the
        :meth:`expected` workers of each role (or ``accept(body)`` holds), polling every
        ``poll_s``. True when ready, False when ``stopping()`` came first. Raises
        :class:`~pdserve.launch.supervisor.ProcessExitedError` (a RuntimeError) when a process not
        stopped on purpose exits first, :class:`~pdserve.launch.supervisor.ReadyTimeoutError` (a
        TimeoutError naming ``what``, with the end of every log) after ``timeout_s`` seconds."""
        expected = tuple(self.expected().values())

        def check(response: httpx.Response) -> bool:
            body = response.json()
            return accept(body) if accept is not None else all_registered(body, expected)

        return self.supervisor.wait_ready(
            self.url, timeout_s=timeout_s, what=what, accept=check, stopping=stopping
        )

    def stop(self) -> None:
        """Stop every process (workers first, then the router) and remove a config folder the
        stack made; idempotent."""
        self.supervisor.stop()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None


def with_router_replicas(cfg: PdserveConfig, folder: Path) -> PdserveConfig:
    """``cfg`` as its router replicas read it: with ``router.replicas`` > 1, SO_REUSEPORT on
    and, with the embedded registry, its shared store in ``folder`` (a fresh file: one left
    by an earlier stack is removed). ``cfg`` itself when there is one router."""
    r = cfg.router
    if r.replicas == 1:
        return cfg
    update: dict[str, Any] = {"reuse_port": True}
    if cfg.discovery.url == "embedded" and not r.registry_store:
        store = folder / REGISTRY_STORE_FILE
        for suffix in ("", "-wal", "-shm"):
            Path(f"{store}{suffix}").unlink(missing_ok=True)
        update["registry_store"] = str(store)
    return cfg.model_copy(update={"router": r.model_copy(update=update)})


def with_replicas(cfg: PdserveConfig, workers: Mapping[str, int]) -> PdserveConfig:
    """``cfg`` asking for ``workers[role]`` workers of each role named there."""
    update = {
        role: cfg.worker(role).model_copy(update={"replicas": n}) for role, n in workers.items()
    }
    return cfg.model_copy(update=update)
