"""``pdserve doctor``: what the KV transfer path can use on this host, what hurts it, and how
fast this host reaches a worker.

Design origin: the machine notes behind :mod:`pdserve.transfer` (UCX and NIXL settings):
every check stands for a setting that was measured to matter. The checks are pure functions of
one :class:`Facts` record gathered once at the start (:func:`gather_facts`), so tests inject
facts instead of changing the machine; only :func:`gather_facts` reads the environment, files
under ``/proc`` and ``/sys``, imports the optional libraries and runs ``ucx_info``.

Report: one line per :class:`Finding`, ``OK`` / ``WARN`` / ``FAIL`` with a ``fix:`` line for
anything not OK; the exit status is 1 when any check FAILs (an explicitly chosen backend that
does not load, a peer that cannot be probed), else 0.

``--peer HOST:PORT`` (a worker's transfer endpoint: the ``endpoint`` of the communicator in its
discovery record), or ``--discovery URL --worker ID`` to look it up, adds a probe of that worker
(:mod:`pdserve.transfer.bandwidth_probe`): round trips and the bandwidth of ``--probe-mib`` MiB over TCP.
A transceiver answers only a peer that proves it holds the deployment's cluster secret, so a
probe needs it: ``--cluster-secret-file``, else ``PDSERVE_SECURITY__CLUSTER_SECRET_FILE`` /
``PDSERVE_SECURITY__CLUSTER_SECRET``, else the ``--config`` / ``$PDSERVE_CONFIG`` file's
``security`` section (:func:`cluster_key`); without one the doctor refuses to probe (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench.doctor.doctor_facts import Facts, gather_facts
from pdserve.errors import ConfigError, DiscoveryError, PdserveError, TransferError

if TYPE_CHECKING:
    from pdserve.config.settings import DiscoverySettings
    from pdserve.security import ClusterKey

_SHM_TLS = {"shm", "sm", "cma", "posix", "sysv", "all"}
SLOW_GBPS = 0.5
"""Below this probe bandwidth (GB/s) the path to a worker is reported as slow."""


class Level(StrEnum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Finding:
    """One line of the report: ``check`` names what was looked at; ``fix`` says what to
    change (empty when OK)."""

    level: Level
    check: str
    message: str
    fix: str = ""


# ----------------------------------------------------------------------------- checks


def check_backends(facts: Facts, wanted: str = "auto") -> list[Finding]:
    """One finding per backend; FAIL when ``wanted`` (not ``auto``) cannot be used."""
    out = []
    for b in facts.backends:
        version = f" {b.version}" if b.version else ""
        if b.available:
            out.append(
                Finding(Level.OK, f"backend {b.name}", f"usable{version} {b.detail}".strip())
            )
            continue
        level = Level.FAIL if b.name == wanted else Level.WARN
        fix = {
            "nixl": "pip install nixl (it bundles UCX); `auto` falls back to the TCP backend",
            "ucx": "pip install ucxx-cu12 (ucx-py is deprecated and cannot be installed)",
        }.get(b.name, "")
        out.append(Finding(level, f"backend {b.name}", f"not usable: {b.detail}", fix))
    usable = {b.name for b in facts.backends if b.available}
    if wanted == "auto":
        pick = "nixl" if "nixl" in usable else "tcp"
        level = Level.OK if pick == "nixl" else Level.WARN
        fix = "" if pick == "nixl" else "install nixl for one-sided WRITEs (same host: CMA)"
        out.append(Finding(level, "backend auto", f"`auto` picks {pick}", fix))
    return out


def check_transports(facts: Facts) -> list[Finding]:
    """Which UCX transports exist; WARN without a shared-memory one or when unknown."""
    if facts.ucx_transports is None:
        return [
            Finding(
                Level.WARN,
                "ucx transports",
                f"could not list UCX transports ({facts.ucx_source or 'no UCX tools found'})",
                "install the libucx wheel (it ships ucx_info) to see what UCX can use",
            )
        ]
    listing = ", ".join(
        f"{t} ({', '.join(d)})" if d and d != ("memory",) else t
        for t, d in sorted(facts.ucx_transports.items())
    )
    local = {"cma", "posix", "sysv", "xpmem", "knem"} & set(facts.ucx_transports)
    if not local:
        return [
            Finding(
                Level.WARN,
                "ucx transports",
                f"{listing}: no shared-memory transport; workers on one host talk TCP",
                "run on a kernel/container that allows CMA or /dev/shm",
            )
        ]
    return [Finding(Level.OK, "ucx transports", f"{listing} [{facts.ucx_source}]")]


def check_same_host(facts: Facts) -> list[Finding]:
    """UCX_TLS that keeps two workers on one host off shared memory / CMA, and Yama's
    ptrace restriction (UCX does not use CMA unless ``ptrace_scope`` is 0)."""
    out = []
    tls = facts.env.get("UCX_TLS")
    if tls:
        negated = tls.startswith("^")
        names = {t.strip() for t in tls.lstrip("^").split(",") if t.strip()}
        blocked = bool(names & _SHM_TLS) if negated else not names & _SHM_TLS
        if blocked:
            out.append(
                Finding(
                    Level.WARN,
                    "UCX_TLS",
                    f"UCX_TLS={tls} keeps workers on one host off shared memory / CMA: "
                    "their KV goes over TCP loopback (measured 2.5-5x slower here)",
                    "unset UCX_TLS, or keep shared memory in it, e.g. UCX_TLS=tcp,shm,self",
                )
            )
        else:
            out.append(Finding(Level.OK, "UCX_TLS", f"UCX_TLS={tls} keeps shared memory"))
    else:
        out.append(Finding(Level.OK, "UCX_TLS", "unset: UCX picks CMA/shared memory on one host"))
    if facts.ptrace_scope:
        out.append(
            Finding(
                Level.WARN,
                "ptrace_scope",
                f"kernel.yama.ptrace_scope={facts.ptrace_scope}: UCX cannot use CMA (one-copy "
                "between processes); same-host transfers fall back to shared-memory copies",
                "sysctl -w kernel.yama.ptrace_scope=0 (or run the workers as one user in one "
                "container with CAP_SYS_PTRACE)",
            )
        )
    return out


def check_net_devices(facts: Facts) -> list[Finding]:
    """UCX_NET_DEVICES unset on a multi-NIC host, loopback only, or naming missing devices."""
    devices = facts.env.get("UCX_NET_DEVICES")
    nics = ", ".join(facts.nics) or "none"
    if not devices or devices == "all":
        if len(facts.nics) >= 2:
            return [
                Finding(
                    Level.WARN,
                    "UCX_NET_DEVICES",
                    f"unset with {len(facts.nics)} interfaces up ({nics}): UCX may send over "
                    "any of them, including ones that do not reach the other hosts",
                    "set UCX_NET_DEVICES=<nic> (or --ucx-devices <nic> on the workers) to the "
                    "interface that reaches the other workers",
                )
            ]
        return [Finding(Level.OK, "UCX_NET_DEVICES", f"unset; one interface up ({nics})")]
    names = [d.split(":")[0] for d in devices.split(",") if d.strip()]
    if set(names) <= {"lo"}:
        return [
            Finding(
                Level.WARN,
                "UCX_NET_DEVICES",
                f"UCX_NET_DEVICES={devices}: loopback only, fine on one host (shared memory / "
                "CMA are not network devices and stay usable) but no other host is reachable",
                "for workers on several hosts set it to the NIC that reaches them, e.g. eth0",
            )
        ]
    known = set(facts.nics) | {"lo"}
    missing = [n for n in names if n not in known and not n.startswith("mlx")]
    if missing:
        return [
            Finding(
                Level.WARN,
                "UCX_NET_DEVICES",
                f"UCX_NET_DEVICES={devices} names {', '.join(missing)}, not up here ({nics})",
                "use the names `ip link` shows",
            )
        ]
    return [Finding(Level.OK, "UCX_NET_DEVICES", f"UCX_NET_DEVICES={devices}")]


def check_progress(facts: Facts) -> list[Finding]:
    """How transfers are progressed: NIXL's thread (off in pdserve), ucxx's progress mode."""
    out = [
        Finding(
            Level.OK,
            "progress",
            "pdserve runs NIXL and UCX without progress threads and polls from the event "
            "loop, yielding the CPU (NIXL's thread busy-spins: 0.3-0.4 GB/s on 2 cores)",
        )
    ]
    if any(b.name == "ucx" and b.available for b in facts.backends):
        mode = facts.env.get("UCXPY_PROGRESS_MODE")
        if mode and mode != "polling":
            out.append(
                Finding(
                    Level.WARN,
                    "UCXPY_PROGRESS_MODE",
                    f"UCXPY_PROGRESS_MODE={mode}: ucxx's asyncio API progresses that way here "
                    "(thread modes measured several times slower than polling on few cores); "
                    "pdserve's ucx backend polls its own worker and is not affected",
                    "export UCXPY_PROGRESS_MODE=polling",
                )
            )
    return out


def check_cpus(facts: Facts) -> list[Finding]:
    """Few cores: workers on one host must not oversubscribe them."""
    if facts.cpu_count <= 2:
        return [
            Finding(
                Level.WARN,
                "cpus",
                f"{facts.cpu_count} CPU(s): a prefill and a decode worker on this host share "
                "them with each other and with transfer polling",
                "give each worker one torch thread (--threads 1; SmolLM2 float32 decodes as "
                "fast on one), or put the roles on separate hosts",
            )
        ]
    return [Finding(Level.OK, "cpus", f"{facts.cpu_count} CPUs")]


def check_cpu_features(flags: frozenset[str] | None = None) -> list[Finding]:
    """The CPU's model and the features pdserve's CPU paths use (:mod:`pdserve.hardware`), and
    what ``--dtype auto`` picks for a checkpoint here (:func:`pdserve.hardware.cpu_half_dtype`:
    the same for bfloat16 and float32 checkpoints)."""
    from pdserve.hardware import CPU_FEATURES, cpu_flags, cpu_half_dtype, cpu_model

    flags = cpu_flags() if flags is None else flags
    have = [f for f in CPU_FEATURES if f in flags]
    missing = [f for f in CPU_FEATURES if f not in flags]
    bf16 = cpu_half_dtype(flags)
    detail = f"{cpu_model()}: {' '.join(have) or 'none of ' + ' '.join(CPU_FEATURES)}"
    if missing:
        detail += f" (no {' '.join(missing)})"
    detail += f"; --dtype auto runs a checkpoint (float32 or bfloat16) in {bf16} here"
    if bf16 == "bfloat16" and "amx_bf16" not in flags:
        detail += " (float32 where the paged attention kernel cannot be built)"
    return [Finding(Level.OK, "cpu features", detail)]


def check_environment(facts: Facts, wanted: str = "auto") -> list[Finding]:
    """All environment checks, in report order."""
    return [
        *check_backends(facts, wanted),
        *check_transports(facts),
        *check_same_host(facts),
        *check_net_devices(facts),
        *check_progress(facts),
        *check_cpus(facts),
        *check_cpu_features(),
    ]


# ----------------------------------------------------------------------------- peer


async def resolve_endpoint(
    discovery: str,
    worker_id: str,
    *,
    key: ClusterKey,
    settings: DiscoverySettings | None = None,
    timeout_s: float = 10.0,
) -> str:
    """The transfer endpoint in ``worker_id``'s discovery record at ``discovery`` (the URL of
    the router's embedded registry, its internal listener; ``etcd://`` or ``nats://``; ``key``:
    the cluster key the registry and the records need; ``settings``: TLS toward etcd / NATS). Raises DiscoveryError when the worker does not show
    up within ``timeout_s`` or publishes no endpoint."""
    from pdserve.discovery import open_watcher

    watcher = open_watcher(discovery, key=key, discovery=settings)
    try:
        await watcher.start()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (record := watcher.workers().get(worker_id)) is None:
            if asyncio.get_running_loop().time() > deadline:
                known = ", ".join(sorted(watcher.workers())) or "none"
                raise DiscoveryError(
                    f"worker {worker_id!r} is not registered at {discovery} (registered: {known})"
                )
            await asyncio.sleep(0.2)
    finally:
        await watcher.close()
    endpoint = record.communicator.get("endpoint")
    if not endpoint:
        raise DiscoveryError(f"worker {worker_id!r} publishes no transfer endpoint")
    return endpoint


async def check_peer(
    endpoint: str, *, key: ClusterKey, nbytes: int, timeout_s: float
) -> list[Finding]:
    """Probe the transceiver at ``endpoint``, authenticating with ``key`` (the cluster secret):
    who it is, round trip, bandwidth. FAIL when it cannot be probed (a refused authentication
    says so); WARN below :data:`SLOW_GBPS` or for another protocol version."""
    from pdserve.protocol import PROTOCOL_VERSION
    from pdserve.transfer.bandwidth_probe import probe
    from pdserve.transfer.wire import AUTH_FAILED

    try:
        r = await probe(endpoint, key=key, nbytes=nbytes, timeout_s=timeout_s)
    except TransferError as exc:
        if exc.code == AUTH_FAILED:
            return [
                Finding(
                    Level.FAIL,
                    "peer",
                    f"cannot probe {endpoint}: {exc.message}",
                    "pass the cluster secret file of the worker's deployment "
                    "(--cluster-secret-file), the one its router and workers were started with",
                )
            ]
        return [
            Finding(
                Level.FAIL,
                "peer",
                f"cannot probe {endpoint}: {exc.message}",
                "pass the worker's transfer endpoint (the 'endpoint' of the communicator in "
                "its discovery record, or use --discovery URL --worker ID) and check that this "
                "host can reach that port",
            )
        ]
    lay = r.layout
    out = [
        Finding(
            Level.OK,
            "peer",
            f"{endpoint}: worker {r.worker_id} (epoch {r.epoch}), backend {r.backend}, KV "
            f"layout {lay.model} {lay.num_layers}x{lay.num_kv_heads}x{lay.head_dim} "
            f"{lay.tokens_per_block} tokens/block {lay.dtype}",
        )
    ]
    if r.protocol_version != PROTOCOL_VERSION:
        out.append(
            Finding(
                Level.WARN,
                "peer protocol",
                f"the worker speaks transfer protocol {r.protocol_version}, this pdserve "
                f"{PROTOCOL_VERSION}: workers of the two versions refuse each other",
                "run the same pdserve version on every host",
            )
        )
    out.append(
        Finding(
            Level.OK,
            "peer round trip",
            f"{r.rtt_p50_ms:.3f} ms p50 ({len(r.rtt_s)} probes; every KV request pays about "
            "one, plus the release)",
        )
    )
    level = Level.OK if r.gbps_p50 >= SLOW_GBPS else Level.WARN
    out.append(
        Finding(
            level,
            "peer bandwidth",
            f"{r.gbps_p50:.2f} GB/s p50, {r.gbps_best:.2f} best ({nbytes / 2**20:.0f} MiB x "
            f"{len(r.transfer_s)} over TCP)",
            ""
            if level is Level.OK
            else "check the NIC and route between the hosts (ethtool, MTU) and UCX_NET_DEVICES",
        )
    )
    return out


# ----------------------------------------------------------------------------- report


def format_report(findings: Sequence[Finding], title: str) -> str:
    """The findings as the report prints them, with a count line."""
    lines = [title]
    for f in findings:
        lines.append(f"  {f.level.value:<5} {f.check}: {f.message}")
        if f.fix:
            lines.append(f"        fix: {f.fix}")
    counts = {lv: sum(f.level is lv for f in findings) for lv in Level}
    lines.append(", ".join(f"{n} {lv.value}" for lv, n in counts.items()))
    return "\n".join(lines)


def exit_code(findings: Sequence[Finding]) -> int:
    """1 when any finding FAILs, else 0."""
    return 1 if any(f.level is Level.FAIL for f in findings) else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``pdserve doctor`` flags."""
    parser.add_argument(
        "--backend",
        choices=["auto", "nixl", "ucx", "tcp"],
        default="auto",
        help="the transfer backend you mean to use (an unusable explicit choice FAILs)",
    )
    parser.add_argument("--peer", default=None, help="a worker's transfer endpoint HOST:PORT")
    parser.add_argument(
        "--discovery",
        default=None,
        help="the router's embedded registry URL (its internal listener, e.g. "
        "http://router:8001), etcd:// or nats:// (with --worker)",
    )
    parser.add_argument("--worker", default=None, help="worker id to look up in --discovery")
    parser.add_argument("--probe-mib", type=float, default=64.0, help="bytes per probe, MiB")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument(
        "--cluster-secret-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the deployment's cluster secret (a probe must prove it holds it; default: "
        "PDSERVE_SECURITY__CLUSTER_SECRET_FILE, then the config file's security section)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML config to read the cluster secret from (default: $PDSERVE_CONFIG)",
    )


def deployment(args: argparse.Namespace) -> tuple[ClusterKey, DiscoverySettings]:
    """The cluster key a probe authenticates with, and the discovery settings (TLS toward etcd
    / NATS) for ``--discovery``: ``--cluster-secret-file`` > environment
    (``PDSERVE_SECURITY__CLUSTER_SECRET_FILE`` / ``..._CLUSTER_SECRET``) > the ``--config`` /
    ``$PDSERVE_CONFIG`` file, as :func:`pdserve.config.loading.load_config` layers them. Raises
    ConfigError (no secret anywhere, unreadable, too short) saying how to pass one."""
    from pdserve.config.loading import load_config
    from pdserve.config.settings import ENV_CONFIG_FILE
    from pdserve.security import ClusterKey, load_cluster_secret

    secret_file = getattr(args, "cluster_secret_file", None)
    overrides = {"security": {"cluster_secret_file": str(secret_file)}} if secret_file else None
    file = getattr(args, "config", None) or os.environ.get(ENV_CONFIG_FILE) or None
    try:
        cfg, _ = load_config(file, overrides=overrides)
        return ClusterKey(load_cluster_secret(cfg.security)), cfg.discovery
    except ConfigError as exc:
        raise ConfigError(
            "a worker's transceiver answers only a peer that proves it holds the deployment's "
            f"cluster secret; refusing to probe without it: {exc.message}"
        ) from exc


def run(args: argparse.Namespace) -> int:
    """Gather, check, probe (if asked), print; the exit status (see the module docstring).
    Raises ConfigError for flags that do not go together, DiscoveryError for a worker the
    discovery service does not list."""
    if bool(args.discovery) != bool(args.worker):
        raise ConfigError("--discovery and --worker go together")
    if args.peer and args.discovery:
        raise ConfigError("give either --peer or --discovery/--worker, not both")
    # The secret first (fail fast, exit 2): no probe, and no registry read, without it.
    key, discovery = deployment(args) if args.peer or args.discovery else (None, None)
    facts = gather_facts()
    findings = check_environment(facts, args.backend)
    endpoint = args.peer
    if args.discovery and key is not None:
        endpoint = asyncio.run(
            resolve_endpoint(args.discovery, args.worker, key=key, settings=discovery)
        )
    if endpoint and key is not None:
        nbytes = max(1, int(args.probe_mib * 2**20))
        findings += asyncio.run(
            check_peer(endpoint, key=key, nbytes=nbytes, timeout_s=args.timeout_s)
        )
    title = f"pdserve doctor: KV transfer on {socket.gethostname()} ({facts.cpu_count} CPUs)"
    print(format_report(findings, title))
    return exit_code(findings)


def main(argv: list[str] | None = None) -> int:
    """``python -m pdserve.bench.doctor.doctor``, same as ``pdserve doctor``."""
    parser = argparse.ArgumentParser(prog="pdserve doctor", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except PdserveError as exc:
        print(f"pdserve doctor: {exc.message}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
