"""The ``pdserve bench`` subcommands: name, help, options and what runs each (:data:`COMMANDS`).

The CLI (:mod:`pdserve.cli`) builds one subparser per :class:`BenchCommand` and dispatches to
its ``run``. Importing this module is light (argparse only; no httpx, no torch): each ``run``
imports its benchmark when the command runs. Where a benchmark starts pdserve itself (``serve``
without ``--url``, ``multiturn``, ``kv-restart``, ``handoff``), its stacks take their settings
from ``--config`` and the ``PDSERVE_*`` variables (``serve`` also from its setting flags) and
start through :class:`pdserve.launch.stack.Stack` (:func:`pdserve.bench.bench.bench_stack`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pdserve.bench.bench_descriptions import (
    FORMATTER_DESCRIPTION,
    GPU_DESCRIPTION,
    KV_DTYPE_DESCRIPTION,
    KV_RESTART_DESCRIPTION,
    MULTITURN_DESCRIPTION,
    PAGED_ATTENTION_DESCRIPTION,
    ROUTER_DESCRIPTION,
    SPECULATIVE_DESCRIPTION,
    STRUCTURED_DESCRIPTION,
    TRANSFER_DESCRIPTION,
)

if TYPE_CHECKING:
    from pdserve.config.settings import PdserveConfig

Settings = Literal["none", "config", "flags"]
"""What pdserve settings a subcommand takes: none; ``--config`` and the environment; those and
the setting flags of the ``bench serve`` command (:func:`pdserve.cli.add_setting_flags`)."""


ArgumentsFn = Callable[[argparse.ArgumentParser], None]
RunFn = Callable[[argparse.Namespace, "PdserveConfig | None"], int]


@dataclass(frozen=True)
class BenchCommand:
    """One ``pdserve bench NAME``: ``run(args, cfg)`` returns the exit code; ``cfg`` is the
    resolved settings when ``settings`` is not ``"none"``, else None."""

    name: str
    help: str
    description: str
    add_arguments: ArgumentsFn
    run: RunFn
    settings: Settings = "none"


def _need(cfg: PdserveConfig | None) -> PdserveConfig:
    if cfg is None:
        raise AssertionError("this benchmark takes settings; the CLI resolves them")
    return cfg


# --- serve, transfer (options in pdserve.bench.bench_options) -------------------------------------


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.bench_options import add_serve_arguments

    add_serve_arguments(p)


def _run_serve(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.bench import serve_main

    return serve_main(args, _need(cfg))


def _transfer_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.bench_options import add_transfer_arguments

    add_transfer_arguments(p)
    # None: each mode's own default (the measurement: tcp nixl ucx; --profile: tcp nixl).
    p.set_defaults(backends=None)
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the measurement: profile one-block pulls with both transceivers in "
        "one process, per backend of --backends (default: tcp nixl), each in a fresh child "
        "process; prints the CPU time per pull and the top functions by own time",
    )
    p.add_argument(
        "--profile-pulls",
        type=int,
        default=2000,
        metavar="N",
        help="with --profile: pulls timed, then as many profiled (default: 2000)",
    )


def _run_transfer(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.bench import transfer_main

    return transfer_main(args)


# --- multiturn ----------------------------------------------------------------------------------


def _multiturn_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=8, help="conversations (default: 8)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default: 4)")
    p.add_argument(
        "--system-tokens",
        type=int,
        default=1000,
        help="tokens of the shared system prompt (default: 1000)",
    )
    p.add_argument(
        "--concurrency", type=int, default=4, help="conversations in flight (default: 4)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=32, help="max_tokens of each reply (default: 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    _model_argument(p)
    _timeout_json_arguments(p)
    p.add_argument(
        "--compare",
        choices=("cache", "routing", "sessions"),
        default="cache",
        help="cache: prefix cache on vs off (1 prefill worker); routing: KV-aware vs "
        "least-loaded routing (--prefill-workers prefill workers, cache on); sessions: turns "
        "with an x-session-id header vs without (--decode-workers decode workers, local "
        "prefill on) (default: cache)",
    )
    p.add_argument(
        "--decode-workers",
        type=int,
        default=2,
        help="decode workers of each stack with --compare sessions (default: 2)",
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=2,
        help="prefill workers of each stack with --compare routing (default: 2)",
    )
    p.add_argument(
        "--distinct-system-prompts",
        action="store_true",
        help="every conversation gets a system prompt of its own (no prefix shared between "
        "conversations)",
    )


def _model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="local model folder the stacks serve (default: model.path of the settings, else "
        "the converted SmolLM2 in the cache)",
    )


def _timeout_json_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="per-request timeout, seconds (default: 600)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")


def _run_multiturn(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.serving.bench_multiturn import run

    return run(args, _need(cfg))


# --- fairness -----------------------------------------------------------------------------------


def _fairness_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.serving.bench_fairness import add_arguments

    add_arguments(p)


def _run_fairness(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.serving.bench_fairness import main

    return main(args, _need(cfg))


# --- kv-restart ---------------------------------------------------------------------------------


def _kv_restart_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=4000,
        help="tokens of the long prompt's text by the model's tokenizer (default: 4000)",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens (default: 8)")
    _model_argument(p)
    p.add_argument(
        "--disk-dir",
        default=None,
        metavar="DIR",
        help="the disk tier's directory; must be empty or absent (default: a fresh temporary "
        "directory, removed at the end)",
    )
    p.add_argument(
        "--tier",
        choices=("disk", "remote"),
        default="disk",
        help="the tier measured: disk (kv_cache.disk_cache_dir, target 0.5x) or remote "
        "(kv_cache.remote_cache, a Redis store; target 0.2x, then the store is stopped and "
        "--outage-requests more requests must all succeed) (default: disk)",
    )
    p.add_argument(
        "--remote-cache",
        default=None,
        metavar="URL",
        help="--tier remote: the store, empty (default: a redis-server from PATH on a free "
        "loopback port, started for the run)",
    )
    p.add_argument(
        "--outage-requests",
        type=int,
        default=4,
        help="--tier remote: requests sent after the store is stopped (default: 4)",
    )
    _timeout_json_arguments(p)


def _run_kv_restart(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.engine.bench_kv_restart import run

    return run(args, _need(cfg))


# --- kv-migrate, kv-peer: benchmarks with their own add_arguments and run ------------------------


def _own_options(module: str) -> tuple[ArgumentsFn, RunFn]:
    """The arguments and run of ``pdserve.bench.<module>`` (its ``add_arguments(p)`` with the
    shared model, timeout and JSON options; its ``run(args, cfg)``), imported when called."""
    import importlib

    def arguments(p: argparse.ArgumentParser) -> None:
        importlib.import_module(f"pdserve.bench.{module}").add_arguments(p)
        _model_argument(p)
        _timeout_json_arguments(p)

    def run(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
        return int(importlib.import_module(f"pdserve.bench.{module}").run(args, _need(cfg)))

    return arguments, run


# --- handoff ------------------------------------------------------------------------------------


def _handoff_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.transfer.bench_handoff import add_arguments

    add_arguments(p)


def _run_handoff(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.transfer.bench_handoff import main

    return main(args, _need(cfg))


# --- compile, formatter, gpu: one process, no stack ---------------------------------------------


def _compile_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.engine.bench_compile import add_arguments

    add_arguments(p)


def _run_compile(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.engine.bench_compile import run

    return run(args)


def _formatter_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="tokens per request (default: 512 2048)",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=["tcp", "nixl"],
        help="transfer backends of the pulls (default: tcp nixl)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the staging kernel and the prefill process (default: 1)",
    )


def _run_formatter(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.transfer.bench_formatter import run

    return run(args)


def _gpu_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", required=True, metavar="{engine,transfer}")
    eng = sub.add_parser("engine", help="engine TTFT and TPOT per dtype and CUDA graphs")
    eng.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    eng.add_argument(
        "--model",
        choices=["tiny", "smollm2-like"],
        default="smollm2-like",
        help="the stand-in model (default: smollm2-like)",
    )
    eng.add_argument(
        "--dtype", nargs="+", default=["float32"], help="model dtypes (default: float32)"
    )
    eng.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help="requests decoding together, one level after another (default: 1 8 32)",
    )
    eng.add_argument(
        "--prompt-tokens", type=int, default=256, help="tokens per prompt (default: 256)"
    )
    eng.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    eng.add_argument("--threads", type=int, default=None, help="torch threads (CPU runs)")
    eng.add_argument(
        "--cuda-graphs",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="engines to run: with CUDA graphs for decode steps (CUDA only), without, or both "
        "(default: on)",
    )
    tr = sub.add_parser("transfer", help="KV transfer GB/s between pools on CPU or GPU")
    tr.add_argument(
        "--backends",
        nargs="+",
        default=["tcp", "nixl"],
        help="transfer backends (default: tcp nixl)",
    )
    tr.add_argument(
        "--devices",
        nargs="+",
        default=["cuda:cuda"],
        help="SRC:DST pool devices, e.g. cuda:cuda cpu:cuda (default: cuda:cuda)",
    )
    tr.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="request sizes in KV blocks (default: 1 16 64)",
    )


def _run_gpu(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.gpu.bench_gpu import run

    return run(args)


def _module(name: str, settings: Settings = "config") -> BenchCommand:
    """A ``BenchCommand`` whose module ``pdserve.bench.<name>`` (``name`` is dotted below
    ``pdserve.bench``, e.g. ``planning.bench_profile``; light to import) holds
    ``DESCRIPTION``, ``HELP``, ``add_arguments(p)`` and ``run(args, cfg)``; ``cfg`` is the
    resolved settings, or None for ``settings="none"``."""
    import importlib

    module = importlib.import_module(f"pdserve.bench.{name}")

    def run(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
        return int(module.run(args, cfg if settings == "none" else _need(cfg)))

    command = name.rpartition(".")[2].removeprefix("bench_").replace("_", "-")
    return BenchCommand(
        command, module.HELP, module.DESCRIPTION, module.add_arguments, run, settings
    )


def _description(module: str) -> str:
    """The ``DESCRIPTION`` of ``pdserve.bench.<module>`` (a module light to import)."""
    import importlib

    return str(importlib.import_module(f"pdserve.bench.{module}").DESCRIPTION)


def _serve_description() -> str:
    from pdserve.bench.bench_options import SERVE_DESCRIPTION

    return SERVE_DESCRIPTION


def _structured_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.serving.bench_structured import add_arguments

    add_arguments(p)


def _run_structured(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.serving.bench_structured import main

    return main(args)


def _speculative_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.serving.bench_speculative import add_arguments

    add_arguments(p)


def _run_speculative(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.serving.bench_speculative import main

    return main(args)


def _kv_dtype_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.engine.bench_kv_dtype import add_arguments

    add_arguments(p)


def _run_kv_dtype(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.engine.bench_kv_dtype import main

    return main(args)


def _router_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.serving.bench_router import add_arguments

    add_arguments(p)


def _run_router(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.serving.bench_router import main

    return main(args)


def _paged_attention_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.bench.engine.bench_paged_kernel import add_arguments

    add_arguments(p)


def _run_paged_attention(args: argparse.Namespace, cfg: PdserveConfig | None) -> int:
    from pdserve.bench.engine.bench_paged_kernel import main

    return main(args)


COMMANDS: tuple[BenchCommand, ...] = (
    BenchCommand(
        "serve",
        "TTFT/ITL/TPOT of an OpenAI server (--url), or pdserve disaggregated vs colocated",
        _serve_description(),
        _serve_arguments,
        _run_serve,
        "flags",
    ),
    BenchCommand(
        "transfer",
        "KV transfer GB/s per backend vs socket/memcpy",
        TRANSFER_DESCRIPTION,
        _transfer_arguments,
        _run_transfer,
    ),
    BenchCommand(
        "multiturn",
        "multi-turn chat on stacks it starts: prefix cache on vs off, or KV-aware routing",
        MULTITURN_DESCRIPTION,
        _multiturn_arguments,
        _run_multiturn,
        "config",
    ),
    BenchCommand(
        "fairness",
        "one tenant floods, another sends one request at a time: the fair queue against none",
        _description("serving.bench_fairness"),
        _fairness_arguments,
        _run_fairness,
        "config",
    ),
    BenchCommand(
        "kv-restart",
        "TTFT of the first request after a restart, from the KV disk tier",
        KV_RESTART_DESCRIPTION,
        _kv_restart_arguments,
        _run_kv_restart,
        "config",
    ),
    BenchCommand(
        "kv-migrate",
        "a stream whose decode worker is killed: its added latency with the remote tier and without",
        _description("engine.bench_kv_migrate"),
        *_own_options("engine.bench_kv_migrate"),
        "config",
    ),
    BenchCommand(
        "kv-peer",
        "a follow-up on the worker without its prefix: TTFT with the peer prefix pull and without",
        _description("engine.bench_kv_peer"),
        *_own_options("engine.bench_kv_peer"),
        "config",
    ),
    BenchCommand(
        "handoff",
        "streamed vs whole-request KV hand-off: TTFT and time to the second token",
        _description("transfer.bench_handoff"),
        _handoff_arguments,
        _run_handoff,
        "config",
    ),
    BenchCommand(
        "compile",
        "eager vs compiled forward of the model runner (prefill, decode steps)",
        _description("engine.bench_compile"),
        _compile_arguments,
        _run_compile,
    ),
    BenchCommand(
        "formatter",
        "what KV layout conversion costs (staging kernel, pulls)",
        FORMATTER_DESCRIPTION,
        _formatter_arguments,
        _run_formatter,
    ),
    BenchCommand(
        "structured",
        "valid tool calls and JSON per tries, the grammar's ITL cost, compile times",
        STRUCTURED_DESCRIPTION,
        _structured_arguments,
        _run_structured,
    ),
    BenchCommand(
        "kv-dtype",
        "KV storage dtypes (FP8 included): pool capacity, answers, decode step time",
        KV_DTYPE_DESCRIPTION,
        _kv_dtype_arguments,
        _run_kv_dtype,
    ),
    BenchCommand(
        "router",
        "the router's added latency and request rate, over a scripted worker",
        ROUTER_DESCRIPTION,
        _router_arguments,
        _run_router,
    ),
    BenchCommand(
        "paged-attention",
        "the CPU paged-attention kernel vs gather + SDPA, per layer call",
        PAGED_ATTENTION_DESCRIPTION,
        _paged_attention_arguments,
        _run_paged_attention,
    ),
    BenchCommand(
        "speculative",
        "n-gram speculative decoding against plain decoding: TPOT, tokens per step, acceptance",
        SPECULATIVE_DESCRIPTION,
        _speculative_arguments,
        _run_speculative,
    ),
    _module("engine.bench_decode_floor", "none"),
    _module("planning.bench_profile"),
    _module("planning.bench_plan_check"),
    _module("planning.bench_autoscale"),
    BenchCommand(
        "gpu",
        "engine TTFT/TPOT and KV transfer GB/s on a GPU (random-weight models)",
        GPU_DESCRIPTION,
        _gpu_arguments,
        _run_gpu,
    ),
    _module("gpu.bench_gpu_proof", "none"),
)
"""Every ``pdserve bench`` subcommand, in the order ``--help`` lists them."""

BY_NAME = {c.name: c for c in COMMANDS}
