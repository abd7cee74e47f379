"""``pdserve up``: a router and N prefill + M decode (+ K colocated) workers on one machine.

Lifecycle (the processes are a :class:`pdserve.launch.stack.Stack`, the one way pdserve starts a
stack; ``up`` adds the settings resolved for this host, the port check, the signals, the
messages and the restart policy)::

    0 CHECK   the router's port (and, with embedded discovery, its registry's internal port,
              ``router.registry_port``: port + 1 by default) is free, else say so and exit 1
              (another stack on it would answer our /ready, or take our workers' records)
    1 START   spawn the router (embedded registry) and the workers as child processes, each in
              its own session so a terminal Ctrl-C reaches only this process
    2 READY   poll the router until every worker is registered and /ready is 200; print the URL
    3 SERVE   watch the children; one that exits is restarted after a backoff (the same
              argv: a worker keeps its worker id, with a new epoch), up to ``restart_limit``
              restarts within ``restart_window_s`` (section ``supervisor``); past that, say
              which and stop the rest (:class:`~pdserve.launch.supervisor.RestartPolicy`)
    4 STOP    on Ctrl-C / SIGTERM: SIGTERM workers first (they deregister and free parked
              blocks), then the router; SIGKILL whatever is left after the grace period

Secrets: the children share a cluster secret (the user's, else a fresh one,
:func:`pdserve.security.generate_secret`) and the client API keys given to ``up``, each in a
0600 file of the stack's private temporary folder (:func:`pdserve.launch.stack.write_child_secrets`);
the children's config file names those files and holds no secret itself.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

from pdserve.config.loading import served_model_name
from pdserve.config.settings import ROLES, KVCacheSettings, PdserveConfig
from pdserve.launch.stack import Stack, StackSpec
from pdserve.launch.supervisor import RestartPolicy
from pdserve.workers.kv.sizing import available_host_memory

__all__ = [
    "GRACE_S",
    "child_config",
    "gave_up",
    "run_up",
    "split_kv_cache",
]

GRACE_S = 10.0
"""Seconds each stop tier (workers, then the router) gets after SIGTERM before SIGKILL."""


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
    ``scheduler.threads`` split evenly across the workers' processes (a tensor parallel worker
    runs ``model.tensor_parallel_size`` of them), the KV memory share split too
    (:func:`split_kv_cache`), and UCX on loopback when unset."""
    n_workers = max(1, sum(cfg.worker(role).replicas for role in ROLES))
    n_procs = n_workers * cfg.model.tensor_parallel_size
    threads = cfg.scheduler.threads or max(1, (os.cpu_count() or 1) // n_procs)
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


def _say(line: str) -> None:
    print(f"pdserve: {line}", file=sys.stderr, flush=True)


def run_up(
    cfg: PdserveConfig, model_path: Path, *, log_level: str = "info", ready_timeout_s: float = 300
) -> int:
    """Run the whole stack until Ctrl-C; returns the exit code. With ``planner.autoscale``
    the workers are sized for the planner's maximum and their number follows its decisions
    (:mod:`pdserve.planner.local`)."""
    autoscale = cfg.planner.autoscale
    profile = None
    if autoscale:
        from pdserve.launch.stack import with_replicas
        from pdserve.planner.local import autoscale_settings
        from pdserve.planner.profile import Profile, ProfileError

        try:
            profile = Profile.load(cfg.planner.profile) if cfg.planner.profile else None
        except ProfileError as exc:
            print(f"pdserve: --planner-profile: {exc}", file=sys.stderr)
            return 2
        sized, initial = autoscale_settings(cfg)
        cfg = with_replicas(child_config(sized, model_path), initial)
    else:
        cfg = child_config(cfg, model_path)
    name = cfg.model.served_name
    expected = tuple(cfg.worker(role).replicas for role in ROLES)
    stopping = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    listeners = [(cfg.router.host, cfg.router.port, "--port")]
    if cfg.discovery.url == "embedded":
        r = cfg.router
        listeners.append((r.registry_bind_host, r.registry_bind_port, "--registry-port"))
    for host, port, flag in listeners:
        taken = _port_taken(host, port) if port else None
        if taken:
            # Checked first: the stack holding the port would answer our /ready (or register
            # our workers) and we would report "ready" for a router that could not start.
            print(
                f"pdserve: cannot serve on {host}:{port}: {taken} (another pdserve up?). Stop "
                f"it or pick another port with {flag}.",
                file=sys.stderr,
            )
            return 1
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    spec = StackSpec(
        cfg,
        log_level=log_level,
        new_session=True,
        grace_s=GRACE_S,
        poll_s=0.5,
        notify=_say,
    )
    with Stack(spec) as stack:
        url = stack.url
        stack.write_config()  # ConfigError (an unreadable API key file) goes up: exit 2
        try:
            stack.start()
            workers = " + ".join(f"{n} {role}" for role, n in zip(ROLES, expected, strict=True))
            routers = "router" if cfg.router.replicas == 1 else f"{cfg.router.replicas} routers"
            print(
                f"pdserve: starting {routers} + {workers} worker(s) for {name} ...", file=sys.stderr
            )
            # ready: every worker of each role registered, not just a first pair
            if stack.wait_ready(ready_timeout_s, stopping=lambda: stopping):
                print(
                    f"pdserve: ready. OpenAI-compatible endpoint: {url}/v1  "
                    f"(model {name!r}; Ctrl-C stops)"
                )
            sys.stdout.flush()
            policy = RestartPolicy.from_settings(cfg.supervisor)
            loop, tick = None, None
            if autoscale and not stopping:
                from pdserve.planner.local import start_autoscaler

                loop, actuator = start_autoscaler(cfg, stack, profile, _say)
                tick = actuator.tick
            try:
                dead = stack.supervisor.watch(lambda: stopping, policy, tick)
            finally:
                if loop is not None:
                    loop.stop()
            if dead is not None:
                print(f"pdserve: {gave_up(dead.name, dead.returncode, policy)}", file=sys.stderr)
                return 1
            print("pdserve: stopping ...", file=sys.stderr)
            return 0
        except (RuntimeError, TimeoutError) as exc:
            print(f"pdserve: {exc}", file=sys.stderr)
            return 1
