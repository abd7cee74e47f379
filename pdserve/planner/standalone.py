"""``pdserve planner``: the planner loop on its own, beside a router it does not own (Kubernetes:
docs/deploy.md, "Autoscaling"). It reads the router's ``/metrics`` every ``planner.interval_s``,
decides as ``pdserve up --autoscale`` does (:class:`pdserve.planner.autoscale.Planner`, each
worker on hardware of its own) and exports ``pdserve_planner_desired_workers{role}`` on
``planner.port`` for KEDA (deploy/k8s/components/autoscaling) or an HPA to scale the prefill and
decode Deployments; it starts and stops nothing itself. The worker counts it starts from are the
router's view (``pdserve_workers{role}``)."""

from __future__ import annotations

import signal
import sys
import threading
from typing import TYPE_CHECKING

from pdserve.planner.autoscale import (
    ROLES,
    AutoscaleLoop,
    Planner,
    PlannerMetrics,
    router_metrics_fetcher,
)
from pdserve.planner.profile import Profile, ProfileError

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig


def run_planner(cfg: PdserveConfig, router_url: str, host: str = "0.0.0.0") -> int:
    """Run until SIGTERM or Ctrl-C: 0; 2 when the profile cannot be read, 1 when the metrics
    port cannot be bound."""
    from prometheus_client import start_http_server

    p = cfg.planner
    try:
        profile = Profile.load(p.profile) if p.profile is not None else None
    except ProfileError as exc:
        print(f"pdserve planner: --planner-profile: {exc}", file=sys.stderr)
        return 2
    metrics = PlannerMetrics()
    if p.port:
        try:
            start_http_server(p.port, addr=host, registry=metrics.registry)
        except OSError as exc:
            print(
                f"pdserve planner: cannot serve /metrics on {host}:{p.port}: {exc}", file=sys.stderr
            )
            return 1
    planner = Planner.for_config(cfg, profile, cores=None)

    def current() -> dict[str, int]:
        seen = loop.last.workers if loop.last is not None else {}
        return {r: seen.get(r, 0) for r in ROLES}

    loop = AutoscaleLoop(
        planner, router_metrics_fetcher(router_url), current, lambda _t: None, metrics
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(
        f"pdserve planner: watching {router_url}/metrics every {p.interval_s:g} s; "
        f"desired worker counts on :{p.port}/metrics ("
        f"{'profile ' + str(p.profile) if profile else 'no profile: reacting to observed SLOs'})",
        flush=True,
    )
    loop.start()
    done.wait()
    loop.stop()
    return 0
