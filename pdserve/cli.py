"""Command line: ``pdserve up | router | prefill | decode | colocated | model prepare | bench |
doctor``.

Configuration is resolved here, once: flags > ``PDSERVE_<SECTION>__<FIELD>`` environment
variables > the ``--config`` YAML file > defaults (:func:`pdserve.config.loading.load_config`), then
turned into the frozen runtime models of :mod:`pdserve.config.loading` and passed down.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError

from pdserve.config.loading import (
    RouterConfig,
    Sources,
    config_schema,
    dump_config,
    load_config,
    load_file,
    router_config,
    worker_config,
)
from pdserve.config.settings import (
    DEFAULT_MODEL,
    ENV_CONFIG_FILE,
    PdserveConfig,
    Role,
    Setting,
    settings,
)
from pdserve.errors import ConfigError

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
  pdserve bench multiturn --compare routing    # KV-aware vs least-loaded routing, multi-turn chat
  pdserve doctor --peer 10.0.0.6:8200          # transfer environment + bandwidth to a worker
"""


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML config (see `pdserve config schema`; default: $PDSERVE_CONFIG). Precedence: "
        "flag > PDSERVE_<SECTION>__<FIELD> environment variable > file > default",
    )


def _value_type(setting: Setting) -> tuple[type[int] | type[float] | type[str], list[str] | None]:
    """The argparse ``type`` and ``choices`` of a setting, from its annotation: ints and floats
    convert early (argparse names the flag on a bad value), Literal gives the choices, anything
    else stays a string that the schema validates."""
    ann = setting.info.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)] or [ann]
    inner = args[0] if len(args) == 1 else ann
    if typing.get_origin(inner) is typing.Literal:
        return str, [str(c) for c in typing.get_args(inner)]
    if inner is int:
        return int, None
    if inner is float:
        return float, None
    return str, None


def _flag_help(setting: Setting) -> str:
    default = setting.default
    shown = (
        "null"
        if default is None
        else str(default).lower()
        if isinstance(default, bool)
        else default
    )
    env = setting.env + (f" or {setting.env_alias.name}" if setting.env_alias else "")
    return (
        f"{setting.info.description} (default: {shown}; config {setting.path}; env {env})"
    ).replace("%", "%%")


def add_setting_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the flag of every setting that ``command`` takes (:class:`pdserve.config.settings.Flag`),
    grouped by config section. A flag's ``dest`` is the setting's dotted path and its default
    None, so that only flags actually given override the environment and the file."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for setting in settings():
        name = setting.flag_name()
        if name is None or command not in setting.flag_commands():
            continue
        if setting.section not in groups:
            doc = (PdserveConfig.model_fields[setting.section].annotation.__doc__ or "").strip()
            groups[setting.section] = parser.add_argument_group(
                f"{setting.section} settings", doc.split("\n")[0]
            )
        group = groups[setting.section]
        if setting.info.annotation is bool:
            group.add_argument(
                name,
                dest=setting.path,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_flag_help(setting),
            )
            continue
        value_type, choices = _value_type(setting)
        many = typing.get_origin(setting.info.annotation) is list
        group.add_argument(
            name,
            dest=setting.path,
            action="append" if many else "store",
            type=value_type,
            choices=choices,
            default=None,
            metavar=None if choices else name.lstrip("-").replace("-", "_").upper(),
            help=_flag_help(setting),
        )


CONFIG_HELP = f"""\
One YAML file configures every role. Sections: {", ".join(PdserveConfig.model_fields)}
(`pdserve config schema` lists every field, `pdserve config reference` documents it).
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
    add_setting_flags(up, "up")
    up.add_argument(
        "--ready-timeout-s",
        type=float,
        default=300.0,
        help="seconds to wait for every process to be ready (default: 300)",
    )

    router = sub.add_parser("router", help="the OpenAI-compatible router alone")
    _add_config_arg(router)
    add_setting_flags(router, "router")

    for role, text in (
        ("prefill", "a context (prefill) worker"),
        ("decode", "a generation (decode) worker"),
        ("colocated", "a worker doing prefill and decode in one engine (baseline)"),
    ):
        w = sub.add_parser(role, help=text)
        _add_config_arg(w)
        add_setting_flags(w, role)

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
    csub.add_parser(
        "reference",
        help="print the configuration reference (Markdown: every setting with its flag, "
        "variable, default and meaning; docs/configuration.md)",
    )
    cshow = csub.add_parser(
        "show", help="print the effective settings (file + environment) and where each came from"
    )
    _add_config_arg(cshow)

    model = sub.add_parser("model", help="model cache commands")
    msub = model.add_subparsers(dest="model_command", required=True)
    prep = msub.add_parser("prepare", help=f"convert {DEFAULT_MODEL} into the cache")
    prep.add_argument("--cache-dir", type=Path, default=None)
    prep.add_argument("--force", action="store_true", help="convert again even if cached")

    bench = sub.add_parser(
        "bench",
        help="benchmarks that print numbers",
        description="Benchmarks that print numbers (docs/benchmarks.md has runs of each). "
        "`pdserve bench NAME --help` describes one.",
    )
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    from pdserve.bench.bench_commands import COMMANDS as BENCH_COMMANDS  # light: no httpx

    for command in BENCH_COMMANDS:
        b = bsub.add_parser(
            command.name,
            help=command.help,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(b)
        if command.settings != "none":
            _add_config_arg(b)
        if command.settings == "flags":
            add_setting_flags(b, f"bench {command.name}")

    from pdserve.planner.plan import add_arguments as add_plan_arguments  # light: no torch

    add_plan_arguments(
        sub.add_parser(
            "plan",
            help="predict TTFT, ITL and goodput of P:D configurations from a profile",
            description="Simulate each candidate deployment (prefill and decode worker counts, "
            "chunk size, conditional-disaggregation threshold) on a workload with the timings "
            "of a `pdserve bench profile` file, print the predictions and recommend the one "
            "that meets the SLOs with the fewest workers (docs/planning.md). Exit status 0: "
            "the recommendation meets the attainment target; 1: none does; 2: bad input.",
        )
    )
    planner = sub.add_parser(
        "planner",
        help="the autoscaling planner beside a router: exports the wanted worker counts",
        description="Read a router's /metrics every planner.interval_s, decide how many prefill "
        "and decode workers meet the SLOs (with --planner-profile: predicted by simulation; "
        "always: observed misses), log each decision and export "
        "pdserve_planner_desired_workers{role} on --planner-port for KEDA or an HPA "
        "(docs/planning.md). `pdserve up --autoscale` runs the same planner and acts itself.",
    )
    planner.add_argument("--router-url", required=True, help="the router, e.g. http://router:8000")
    _add_config_arg(planner)
    add_setting_flags(planner, "planner")
    from pdserve.bench.doctor.doctor import add_arguments as add_doctor_arguments  # light: no torch

    add_doctor_arguments(
        sub.add_parser("doctor", help="check the KV transfer environment, probe a worker")
    )
    return parser


def cli_overrides(args: argparse.Namespace, role: str | None = None) -> dict[str, Any]:
    """The setting flags actually given, as a nested dict shaped like the YAML config.

    A worker's ``--discovery http://router:8001`` means the embedded registry at that URL, the
    router's internal listener (``discovery.url: embedded`` and ``router.url``).
    """
    out: dict[str, Any] = {}
    for setting in settings():
        value = getattr(args, setting.path, None)
        if value is None:
            continue
        if setting.path == "discovery.url" and role and value.startswith(("http://", "https://")):
            out.setdefault("discovery", {})["url"] = "embedded"
            out.setdefault("router", {})["url"] = value
            continue
        out.setdefault(setting.section, {})[setting.field] = (
            str(value) if isinstance(value, Path) else value
        )
    return out


def resolve_config(
    args: argparse.Namespace, role: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[PdserveConfig, Sources]:
    """Layer flags > environment > ``--config``/``$PDSERVE_CONFIG`` file > defaults.
    Raises :class:`pdserve.errors.ConfigError` naming every bad setting and its source."""
    env = os.environ if env is None else env
    file = getattr(args, "config", None) or env.get(ENV_CONFIG_FILE) or None
    return load_config(file, env=env, overrides=cli_overrides(args, role))


def _resolve_model(cfg: PdserveConfig) -> Path:
    from pdserve.models import resolve_model

    path = str(cfg.model.path) if cfg.model.path is not None else None
    return resolve_model(path, cache_dir=cfg.model.cache_dir)


def _observe(
    cfg: PdserveConfig, level: str, service: str | None = None, instance: str = ""
) -> None:
    """Apply the observability section to this process: the log format (JSON: its stderr
    relayed as JSON lines, and a serving process's stdout too), and (``service`` given: a
    serving process) tracing."""
    from pdserve.observability import tracing
    from pdserve.observability.logs import configure_logging, relay_output_as_json

    configure_logging(level, cfg.observability.log_format)
    if cfg.observability.log_format == "json":
        # pdserve up keeps its stdout: its one "ready" line for a person or a script
        relay_output_as_json(stdout=service is not None)
    if service is not None:
        tracing.configure(cfg.observability, service, instance or f"{service}-{os.getpid()}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pdserve.observability.logs import configure_logging

    configure_logging(args.log_level)
    warning = secret_flag_warning(args)
    if warning is not None:
        log.warning("%s", warning)
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
            from pdserve.launch.launcher import run_up

            cfg, _ = resolve_config(args)
            _observe(cfg, args.log_level)
            return run_up(
                cfg,
                _resolve_model(cfg),
                log_level=args.log_level,
                ready_timeout_s=args.ready_timeout_s,
            )
        if args.command == "router":
            cfg, _ = resolve_config(args)
            _check_secrets(cfg)
            _observe(cfg, args.log_level, "pdserve-router")
            return _run_router(router_config(cfg, _resolve_model(cfg)), args.log_level)
        if args.command in ("prefill", "decode", "colocated"):
            from pdserve.workers.roles.worker_app import run_worker

            cfg, _ = resolve_config(args, args.command)
            _check_secrets(cfg)
            role = Role(args.command)
            wcfg = worker_config(cfg, role, _resolve_model(cfg))
            _observe(cfg, args.log_level, f"pdserve-{role}", wcfg.worker_id)
            run_worker(wcfg, log_level=args.log_level)
            return 0
        if args.command == "bench":
            from pdserve.bench.bench_commands import BY_NAME

            command = BY_NAME[args.bench_command]
            settings = resolve_config(args)[0] if command.settings != "none" else None
            return command.run(args, settings)
        if args.command == "planner":
            from pdserve.planner.standalone import run_planner

            return run_planner(resolve_config(args)[0], args.router_url)
        if args.command == "plan":
            from pdserve.planner.plan import run as run_plan

            return run_plan(args)
        if args.command == "doctor":
            from pdserve.bench.doctor.doctor import run as run_doctor

            return run_doctor(args)
    except ConfigError:
        raise  # exit 2, like a bad flag (main)
    except PdserveError as exc:
        print(f"pdserve: {exc.message}", file=sys.stderr)
        return 1
    raise AssertionError(f"unhandled command {args.command}")


def _is_secret(setting: Setting) -> bool:
    """A setting whose value is a secret (``SecretStr``, alone or in a list or optional)."""
    ann = setting.info.annotation
    return SecretStr in (ann, *typing.get_args(ann))


def secret_flag_warning(args: argparse.Namespace) -> str | None:
    """The warning for a secret given as a flag (``--api-key``): it shows in ``ps``
    (``/proc/PID/cmdline``) to every local user, and Python cannot portably take it back out
    of the process's argv. Names the flags and the safer ways, never the secret; None when no
    secret came as a flag."""
    given = [
        str(setting.flag_name())
        for setting in settings()
        if _is_secret(setting) and getattr(args, setting.path, None) is not None
    ]
    if not given:
        return None
    return (
        f"{', '.join(given)} on the command line is visible to every local user (ps, "
        "/proc/PID/cmdline); pass the keys with --api-key-file FILE (mode 0600) or the "
        "PDSERVE_API_KEY environment variable instead"
    )


def _check_secrets(cfg: PdserveConfig) -> None:
    """Fail fast (exit 2, before the model loads) when the cluster secret or the API key file
    cannot be read; raises :class:`ConfigError` saying how to make a secret."""
    from pdserve.security import load_api_keys, load_cluster_secret

    load_cluster_secret(cfg.security)
    load_api_keys(cfg.security)


def _run_config(args: argparse.Namespace) -> int:
    if args.config_command == "schema":
        print(json.dumps(config_schema(), indent=2))
        return 0
    if args.config_command == "reference":
        from pdserve.config.reference import reference_markdown

        print(reference_markdown(), end="")
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
            f"decode x{cfg.decode.replicas}, colocated x{cfg.colocated.replicas}, "
            f"transfer {cfg.transfer.backend})"
        )
    return 2 if failed else 0


def _run_router(cfg: RouterConfig, log_level: str) -> int:
    from pdserve.server.serve import run_router

    return run_router(cfg, log_level)


if __name__ == "__main__":
    sys.exit(main())
