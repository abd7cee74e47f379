"""``pdserve up --autoscale``: the planner loop (:mod:`pdserve.planner.autoscale`) acting on the
stack ``up`` supervises.

Sizing: every worker gets the threads and KV memory share it would get with the maximum number
of workers running (:func:`autoscale_settings`), so a worker started later finds its share free
and the ones running never need resizing. The stack starts with the configured replicas
clamped into the planner's bounds.

Acting (:class:`LocalActuator`): the planner thread only posts its target; the supervisor's
thread applies it between polls (:meth:`pdserve.launch.supervisor.ProcessSupervisor.watch`'s
``tick``): a missing worker is started (``<role>-<n>``, a new name each time), one surplus
worker, the newest of its role, is retired: SIGTERM, so it deregisters, migrates its running
streams and lets its parked KV be pulled (docs/reliability.md, "Draining"), SIGKILL only after
``drain_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.planner.autoscale import (
    ROLES,
    AutoscaleLoop,
    Planner,
    PlannerMetrics,
    router_metrics_fetcher,
)

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig
    from pdserve.launch.stack import Stack
    from pdserve.planner.profile import Profile

logger = logging.getLogger(__name__)


def autoscale_settings(cfg: PdserveConfig) -> tuple[PdserveConfig, dict[str, int]]:
    """``(cfg sized for the maximum, initial worker counts)``: replicas set to the planner's
    ``max_*`` (threads and KV are split by them; :func:`pdserve.launch.launcher.child_config`), and
    the configured replicas clamped into ``min_*``..``max_*`` as the counts to start with."""
    p = cfg.planner
    bounds = {"prefill": (p.min_prefill, p.max_prefill), "decode": (p.min_decode, p.max_decode)}
    initial = {r: min(max(cfg.worker(r).replicas, lo), hi) for r, (lo, hi) in bounds.items()}
    sized = {r: cfg.worker(r).model_copy(update={"replicas": hi}) for r, (_, hi) in bounds.items()}
    return cfg.model_copy(update=sized), initial


class LocalActuator:
    """Applies the planner's latest target to ``stack`` on the supervisor's thread (module
    docstring). ``notify`` gets one line per worker started or retired."""

    def __init__(self, stack: Stack, drain_timeout_s: float, notify: Callable[[str], None]) -> None:
        self.stack, self.drain_timeout_s, self.notify = stack, drain_timeout_s, notify
        self._lock = threading.Lock()
        self._pending: dict[str, int] | None = None
        self._counts = self._expected()

    def _expected(self) -> dict[str, int]:
        expected = self.stack.expected()
        return {r: expected.get(r, 0) for r in ROLES}

    def current(self) -> dict[str, int]:
        """The worker counts as of the last tick (any thread)."""
        with self._lock:
            return dict(self._counts)

    def request(self, target: dict[str, int]) -> None:
        """Post a target (any thread); the next :meth:`tick` applies it."""
        with self._lock:
            self._pending = dict(target)

    def tick(self) -> None:
        """Apply the posted target (the supervisor's thread only)."""
        with self._lock:
            target, self._pending = self._pending, None
        if target is not None:
            now = self._expected()
            for role in ROLES:
                for _ in range(target[role] - now[role]):
                    p = self.stack.start_worker(role)
                    self.notify(f"autoscale: started {p.name}")
                if now[role] > target[role]:
                    self._retire_newest(role)
        with self._lock:
            self._counts = self._expected()

    def _retire_newest(self, role: str) -> None:
        live = [
            p
            for p in self.stack.supervisor.processes
            if self.stack.roles.get(p.name) == role and not p.stopped
        ]
        if live:
            victim = live[-1]
            self.stack.supervisor.retire(victim, self.drain_timeout_s)
            self.notify(f"autoscale: draining {victim.name}")


def start_autoscaler(
    cfg: PdserveConfig, stack: Stack, profile: Profile | None, notify: Callable[[str], None]
) -> tuple[AutoscaleLoop, LocalActuator]:
    """The planner for ``stack`` (``profile``: the loaded ``planner.profile``, None for
    reaction only), its metrics on ``planner.port`` (0: none; a port in use is logged and
    skipped), its loop started."""
    from prometheus_client import start_http_server

    p = cfg.planner
    planner = Planner.for_config(
        cfg, profile, cores=os.cpu_count(), threads_per_worker=cfg.scheduler.threads
    )
    drain_s = cfg.kv_cache.lease_s + cfg.router.request_timeout_s
    actuator = LocalActuator(stack, drain_s, notify)
    metrics = PlannerMetrics()
    if p.port:
        try:
            start_http_server(p.port, addr=cfg.router.host, registry=metrics.registry)
        except OSError as exc:
            logger.warning("planner: no /metrics on port %d: %s", p.port, exc)
    loop = AutoscaleLoop(
        planner, router_metrics_fetcher(stack.url), actuator.current, actuator.request, metrics
    )
    loop.start()
    mode = "profile " + str(p.profile) if profile else "no profile: reacting to observed SLOs"
    notify(
        f"autoscale: {p.min_prefill}..{p.max_prefill} prefill, {p.min_decode}.."
        f"{p.max_decode} decode workers, TTFT <= {p.ttft_slo_ms:g} ms, ITL p90 <= "
        f"{p.itl_slo_ms:g} ms, every {p.interval_s:g} s ({mode})"
    )
    return loop, actuator
