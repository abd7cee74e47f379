"""``pdserve up``: a router and N prefill + M decode (+ K colocated) workers on one machine.

Lifecycle (the processes are a :class:`~pdserve.supervisor.ProcessSupervisor`'s)::

    1 START   spawn the router (embedded registry) and the workers as child processes, each in
              its own session so a terminal Ctrl-C reaches only this supervisor
    2 READY   poll the router until every worker is registered and /ready is 200; print the URL
    3 SERVE   watch the children; one that exits is restarted after a backoff (the same
              argv: a worker keeps its worker id, with a new epoch), up to ``restart_limit``
              restarts within ``restart_window_s`` (section ``supervisor``); past that, say
              which and stop the rest (:class:`~pdserve.supervisor.RestartPolicy`)
    4 STOP    on Ctrl-C / SIGTERM: SIGTERM workers first (they deregister and free parked
              blocks), then the router; SIGKILL whatever is left after the grace period

Secrets: the children share a cluster secret (the user's, else a fresh one,
:func:`pdserve.security.generate_secret`) and the client API keys given to ``up``, each in a
0600 file of up's private temporary folder (:func:`write_child_secrets`); the children's config
file names those files and holds no secret itself.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pdserve.config import served_model_name
from pdserve.security import generate_secret, load_api_keys, write_secret_file
from pdserve.settings import ENV_PREFIX, ROLES, KVCacheSettings, PdserveConfig, settings
from pdserve.supervisor import ProcessSpec, ProcessSupervisor, RestartPolicy, pdserve_argv
from pdserve.workers.kv.sizing import available_host_memory

GRACE_S = 10.0
"""Seconds each stop tier (workers, then the router) gets after SIGTERM before SIGKILL."""
_ROUTER_TIER, _WORKER_TIER = 0, 1


def split_kv_cache(cfg: PdserveConfig, n_workers: int) -> KVCacheSettings:
    """``kv_cache`` for each of ``n_workers`` workers on this machine: with no explicit size,
    the machine's share is measured once here and split evenly (a worker sizing itself would
    not see the pools of the workers started before it); on CUDA the GPU utilization is."""
    kv = cfg.kv_cache
    if kv.budget_mb is not None or kv.num_blocks is not None:
        return kv
    if cfg.model.device != "cpu":
        return kv.model_copy(
            update={"gpu_memory_utilization": kv.gpu_memory_utilization / n_workers}
        )
    available = available_host_memory()
    budget_mb = max(1, int(available * kv.memory_fraction / n_workers) // 2**20)
    print(
        f"pdserve: KV cache: {kv.memory_fraction:.0%} of {available / 2**30:.1f} GiB available "
        f"host memory, {budget_mb} MiB for each of {n_workers} workers "
        "(set kv_cache.budget_mb / --kv-cache-mb to choose)",
        file=sys.stderr,
    )
    return kv.model_copy(update={"budget_mb": budget_mb})


def child_config(cfg: PdserveConfig, model_path: Path) -> PdserveConfig:
    """The fully resolved config the children read: the model path and name pinned,
    ``scheduler.threads`` split evenly across the workers, the KV memory share split too
    (:func:`split_kv_cache`), and UCX on loopback when unset."""
    n_workers = max(1, sum(cfg.worker(role).replicas for role in ROLES))
    threads = cfg.scheduler.threads or max(1, (os.cpu_count() or 1) // n_workers)
    return cfg.model_copy(
        update={
            "model": cfg.model.model_copy(
                update={"path": model_path, "served_name": served_model_name(cfg, model_path)}
            ),
            "kv_cache": split_kv_cache(cfg, n_workers),
            "scheduler": cfg.scheduler.model_copy(update={"threads": threads}),
            # One host: UCX (nixl, ucx backends) stays on loopback unless told otherwise.
            "transfer": cfg.transfer.model_copy(
                update={"ucx_devices": cfg.transfer.ucx_devices or "lo"}
            ),
        }
    )


def worker_commands(
    cfg: PdserveConfig, config_file: Path, log_level: str
) -> list[tuple[str, list[str]]]:
    """The (name, argv) of every worker child: ``--config`` plus a distinct ``--worker-id``."""
    cmds = []
    for role in ROLES:
        for i in range(cfg.worker(role).replicas):
            name = f"{role}-{i}"
            argv = pdserve_argv(
                [role, "--config", str(config_file), "--worker-id", name], log_level=log_level
            )
            cmds.append((name, argv))
    return cmds


def child_env() -> dict[str, str]:
    """This environment minus ``PDSERVE_<SECTION>__<FIELD>`` settings and their aliases
    (``PDSERVE_API_KEY``): the children's config file is already resolved, and a variable would
    otherwise outrank a flag given to ``up`` (or hand a child a secret the file left out)."""
    aliases = {s.env_alias.name for s in settings() if s.env_alias is not None}
    return {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(ENV_PREFIX) and "__" in k) and k not in aliases
    }


CLUSTER_SECRET_FILE = "cluster-secret"
API_KEY_FILE = "api-keys"


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
    child = write_child_secrets(cfg, folder)
    config_file = folder / "config.yaml"
    config_file.write_text(yaml.safe_dump(child.model_dump(mode="json"), sort_keys=False))
    return config_file


def all_registered(ready: dict[str, Any], expected: tuple[int, ...]) -> bool:
    """Whether the router's ``/ready`` body lists at least ``expected`` workers of each role
    (prefill, decode, then colocated when given), each role on its own."""
    return all(len(ready.get(role, ())) >= n for role, n in zip(ROLES, expected, strict=False))


def gave_up(name: str, returncode: int | None, policy: RestartPolicy) -> str:
    """The line ``up`` prints when it stops the stack because ``name`` exited once too often."""
    if policy.limit == 0:
        return (
            f"{name} exited with code {returncode}; restarts are off (--restart-limit 0); stopping"
        )
    return (
        f"{name} exited with code {returncode} after {policy.limit} restart(s) within "
        f"{policy.window_s:g} s, the limit (--restart-limit, --restart-window-s); stopping the "
        "stack"
    )


def _port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (the OS error text), or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def run_up(
    cfg: PdserveConfig, model_path: Path, *, log_level: str = "info", ready_timeout_s: float = 300
) -> int:
    """Run the whole stack until Ctrl-C; returns the exit code."""
    cfg = child_config(cfg, model_path)
    url = cfg.router_url
    name = cfg.model.served_name
    expected = tuple(cfg.worker(role).replicas for role in ROLES)
    stopping = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    taken = _port_taken(cfg.router.host, cfg.router.port)
    if taken:
        # Checked first: the stack holding the port would answer our /ready and we would
        # report "ready" for a router that could not start.
        print(
            f"pdserve: cannot serve on {cfg.router.host}:{cfg.router.port}: {taken} (another "
            "pdserve up?). Stop it or pick another port with --port.",
            file=sys.stderr,
        )
        return 1
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    supervisor = ProcessSupervisor(
        grace_s=GRACE_S, poll_s=0.5, notify=lambda line: print(f"pdserve: {line}", file=sys.stderr)
    )
    with tempfile.TemporaryDirectory(prefix="pdserve-up-") as tmp, supervisor:
        config_file = write_child_config(cfg, Path(tmp))
        env = child_env()
        try:
            router_argv = pdserve_argv(
                ["router", "--config", str(config_file)], log_level=log_level
            )
            supervisor.spawn(
                ProcessSpec("router", router_argv, env, new_session=True, tier=_ROUTER_TIER)
            )
            for wname, argv in worker_commands(cfg, config_file, log_level):
                supervisor.spawn(ProcessSpec(wname, argv, env, new_session=True, tier=_WORKER_TIER))
            workers = " + ".join(f"{n} {role}" for role, n in zip(ROLES, expected, strict=True))
            print(f"pdserve: starting router + {workers} worker(s) for {name} ...", file=sys.stderr)
            if supervisor.wait_ready(
                url,
                timeout_s=ready_timeout_s,
                what="the stack",
                accept=lambda r: all_registered(r.json(), expected),
                stopping=lambda: stopping,
            ):
                print(
                    f"pdserve: ready. OpenAI-compatible endpoint: {url}/v1  "
                    f"(model {name!r}; Ctrl-C stops)"
                )
            sys.stdout.flush()
            policy = RestartPolicy.from_settings(cfg.supervisor)
            if (dead := supervisor.watch(lambda: stopping, policy)) is not None:
                print(f"pdserve: {gave_up(dead.name, dead.returncode, policy)}", file=sys.stderr)
                return 1
            print("pdserve: stopping ...", file=sys.stderr)
            return 0
        except (RuntimeError, TimeoutError) as exc:
            print(f"pdserve: {exc}", file=sys.stderr)
            return 1
