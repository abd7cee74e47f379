"""The YAML config: every example validates, every error names its path and source, and the
layers resolve as flag > environment > file > default."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
from pydantic import SecretStr

from pdserve.cli import build_parser, main, resolve_config
from pdserve.config.loading import (
    ConfigError,
    PdserveConfig,
    dump_config,
    load_config,
    load_file,
    router_config,
    worker_config,
)
from pdserve.config.settings import ROLES, RouterSettings, SchedulerSettings, Setting, settings
from pdserve.launch.launcher import child_config
from pdserve.launch.stack import all_registered, child_env, worker_commands

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
MODEL = Path("/models/m")


def test_there_is_one_example_per_topology() -> None:
    assert {p.name for p in CONFIGS} >= {"single-host.yaml", "1p1d-etcd.yaml", "2p2d-nats.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_validates(path: Path) -> None:
    cfg = load_file(path)
    assert cfg.prefill.replicas >= 1 and cfg.decode.replicas >= 1
    # Every example keeps the lease shorter than the request deadline it documents.
    assert cfg.kv_cache.lease_s < cfg.router.request_timeout_s


def test_the_topologies_use_the_discovery_they_are_named_after() -> None:
    by_name = {p.name: load_file(p) for p in CONFIGS}
    assert by_name["single-host.yaml"].discovery.url == "embedded"
    assert by_name["1p1d-etcd.yaml"].discovery.url.startswith("etcd://")
    nats = by_name["2p2d-nats.yaml"]
    assert nats.discovery.url.startswith("nats://")
    assert (nats.prefill.replicas, nats.decode.replicas) == (2, 2)
    assert by_name["1p1d-tp3.yaml"].discovery.url.startswith("etcd://")


def test_the_tensor_parallel_example_splits_prefill_only_as_its_header_says() -> None:
    """configs/1p1d-tp3.yaml: the prefill worker runs 3 ranks (SmolLM2's 9 heads and 3 KV
    heads divide), the decode worker started with ``--tensor-parallel-size 1`` runs one."""
    from types import SimpleNamespace

    from pdserve.workers.engine.model.parallel import check_shardable

    path = str(Path(__file__).parents[2] / "configs" / "1p1d-tp3.yaml")
    sizes = {}
    for role, flags in (("prefill", []), ("decode", ["--tensor-parallel-size", "1"])):
        args = build_parser().parse_args([role, "--config", path, *flags])
        cfg, _ = resolve_config(args, role, env={})
        sizes[role] = worker_config(cfg, role, MODEL).engine.model.tensor_parallel_size
    assert sizes == {"prefill": 3, "decode": 1}
    assert load_file(Path(path)).model.device == "cpu"  # tensor parallel runs on CPU only
    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    check_shardable(smollm2, sizes["prefill"], path)
    with pytest.raises(ConfigError, match="9 attention heads"):
        check_shardable(smollm2, 2, path)


def test_config_validate_cli_accepts_the_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "validate", *map(str, CONFIGS)]) == 0
    assert capsys.readouterr().out.count(": OK") == len(CONFIGS)


BAD = """\
kv_cache:
  tokens_per_block: 0
  lease: 3
transfer:
  backend: rdma
discovery:
  url: zookeeper://zk:2181
prefill:
  port: 99999
"""


def test_an_invalid_file_reports_every_error_with_its_path_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    with pytest.raises(ConfigError) as info:
        load_file(bad)
    problems = info.value.problems
    assert len(problems) == 5
    expected = {
        "kv_cache.tokens_per_block": ("greater than 0", 2),
        "kv_cache.lease": ("unknown setting", 3),
        "transfer.backend": ("'tcp'", 5),
        "discovery.url": ("etcd://host:port", 7),
        "prefill.port": ("65535", 9),
    }
    for path, (text, line) in expected.items():
        (hit,) = [p for p in problems if p.startswith(path + ":")]
        assert text in hit and f"bad.yaml:{line}]" in hit, hit


def test_config_validate_cli_exits_2_and_prints_the_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    assert main(["config", "validate", str(CONFIGS[0]), str(bad)]) == 2
    out = capsys.readouterr()
    assert "INVALID (5 error(s))" in out.err and "transfer.backend" in out.err
    assert ": OK" in out.out


@pytest.mark.parametrize(
    ("text", "needle"),
    [("router: [\n", "bad.yaml:2:1: not valid YAML"), ("- 1\n", "must be a mapping")],
)
def test_yaml_that_is_not_a_config_is_refused_with_a_location(
    tmp_path: Path, text: str, needle: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_file(bad)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_file(tmp_path / "nope.yaml")


def test_precedence_is_flag_over_environment_over_file_over_default(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("kv_cache:\n  lease_s: 11\n  tokens_per_block: 32\nrouter:\n  port: 9001\n")
    env = {"PDSERVE_KV_CACHE__LEASE_S": "12", "PDSERVE_ROUTER__PORT": "9002"}
    args = build_parser().parse_args(["decode", "--config", str(f), "--lease-s", "13"])
    cfg, sources = resolve_config(args, "decode", env=env)
    assert cfg.kv_cache.lease_s == 13  # flag beats env and file
    assert cfg.router.port == 9002  # env beats file
    assert cfg.kv_cache.tokens_per_block == 32  # file beats default
    assert cfg.scheduler.max_num_seqs == PdserveConfig().scheduler.max_num_seqs  # default
    assert sources[("kv_cache", "lease_s")] == "command line"
    assert sources[("router", "port")] == "env PDSERVE_ROUTER__PORT"
    assert sources[("kv_cache", "tokens_per_block")].endswith("c.yaml:3")
    shown = dump_config(cfg, sources)
    assert "lease_s: 13.0  # command line" in shown


def test_pdserve_config_names_the_file_when_no_flag_does(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("discovery:\n  url: nats://nats:4222\n")
    args = build_parser().parse_args(["router"])
    cfg, _ = resolve_config(args, env={"PDSERVE_CONFIG": str(f)})
    assert router_config(cfg, MODEL).discovery.url == "nats://nats:4222"


def test_bad_environment_values_and_unknown_variables_name_the_variable() -> None:
    env = {"PDSERVE_KV_CACHE__TOKENS_PER_BLOCK": "x", "PDSERVE_TRANSFR__PORT": "1"}
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    text = str(info.value)
    assert (
        "kv_cache.tokens_per_block" in text and "[env PDSERVE_KV_CACHE__TOKENS_PER_BLOCK]" in text
    )
    assert "transfr: unknown setting" in text and "[env PDSERVE_TRANSFR__PORT]" in text


def test_an_empty_environment_value_means_null_and_plain_pdserve_variables_are_ignored() -> None:
    cfg, _ = load_config(
        env={"PDSERVE_SCHEDULER__THREADS": "", "PDSERVE_CACHE_DIR": "/x", "PDSERVE_CONFIG": ""}
    )
    assert cfg.scheduler.threads is None


def test_worker_runtime_config_follows_the_file(tmp_path: Path) -> None:
    cfg = load_file(Path(__file__).parents[2] / "configs" / "1p1d-etcd.yaml")
    w = worker_config(cfg, "prefill", MODEL)
    assert w.control_plane == "etcd://etcd:2379"
    assert (w.worker.host, w.worker.port) == ("0.0.0.0", 8100)
    assert w.engine.kv_cache.lease_s == cfg.kv_cache.lease_s
    assert (w.transfer.backend, w.transfer.host, w.transfer.port) == ("tcp", "0.0.0.0", 8200)
    # A wildcard bind advertises the hostname (compose and Kubernetes DNS resolve it) ...
    assert w.transfer_advertised_host not in ("0.0.0.0", "", None)
    # ... unless told otherwise.
    args = build_parser().parse_args(["prefill", "--advertise-host", "10.0.0.6"])
    cfg2, _ = resolve_config(args, "prefill", env={"PDSERVE_CONFIG": str(CONFIGS[0])})
    assert worker_config(cfg2, "prefill", MODEL).transfer_advertised_host == "10.0.0.6"
    assert cfg.kv_cache.budget_mb is not None
    assert w.engine.kv_cache.budget_bytes == cfg.kv_cache.budget_mb * 2**20


def test_a_worker_without_an_id_gets_one_once_and_derived_values_are_properties() -> None:
    cfg, _ = resolve_config(build_parser().parse_args(["decode"]), "decode", env={})
    w = worker_config(cfg, "decode", MODEL)
    assert re.fullmatch(r"decode-[0-9a-f]{8}", w.worker_id)
    assert w.model_copy().worker_id == w.worker_id == w.worker.worker_id  # resolved once
    assert worker_config(cfg, "decode", MODEL).worker_id != w.worker_id  # each worker its own
    args = build_parser().parse_args(["prefill", "--worker-id", "p7"])
    assert (
        worker_config(resolve_config(args, "prefill", env={})[0], "prefill", MODEL).worker_id
        == "p7"
    )
    # Derived values live on their sections: one declaration, one read.
    assert w.engine.scheduler.evicts
    strict = SchedulerSettings(capacity_policy="guaranteed_no_evict")
    assert not strict.evicts


def test_a_worker_given_a_router_url_uses_the_embedded_registry_there() -> None:
    args = build_parser().parse_args(["decode", "--discovery", "http://10.0.0.5:8001"])
    cfg, _ = resolve_config(args, "decode", env={})
    assert cfg.discovery.url == "embedded"
    assert worker_config(cfg, "decode", MODEL).control_plane == "http://10.0.0.5:8001"
    # The default worker dials the default router's registry: its internal listener, port + 1.
    cfg, _ = resolve_config(build_parser().parse_args(["decode"]), "decode", env={})
    assert worker_config(cfg, "decode", MODEL).control_plane == "http://127.0.0.1:8001"
    assert cfg.router_url == "http://127.0.0.1:8000"  # the public port: /v1, /ready


def test_the_registry_listens_on_a_port_of_its_own() -> None:
    r = RouterSettings()
    assert (r.registry_bind_host, r.registry_bind_port) == ("127.0.0.1", 8001)
    assert r.public_url == "http://127.0.0.1:8000" and r.registry_url == "http://127.0.0.1:8001"
    # port + 1 follows --port; an explicit port and host win; a wildcard is dialled on loopback.
    args = build_parser().parse_args(["up", "--port", "9000", "--host", "0.0.0.0"])
    cfg, _ = resolve_config(args, env={})
    assert cfg.registry_url == "http://127.0.0.1:9001" and cfg.router.registry_bind_port == 9001
    assert cfg.worker_discovery() == "http://127.0.0.1:9001"
    args = build_parser().parse_args(
        ["router", "--registry-port", "7000", "--registry-host", "10.0.0.5"]
    )
    cfg, _ = resolve_config(args, env={"PDSERVE_ROUTER__PORT": "9000"})
    assert (cfg.router.registry_bind_host, cfg.router.registry_bind_port) == ("10.0.0.5", 7000)
    assert cfg.registry_url == "http://10.0.0.5:7000" and cfg.router_url == "http://127.0.0.1:9000"
    # router.url (how workers reach it, e.g. through a Service name) outranks the listener's.
    cfg, _ = resolve_config(args, env={"PDSERVE_ROUTER__URL": "http://router-internal:7000/"})
    assert cfg.worker_discovery() == "http://router-internal:7000"
    assert cfg.router_url == "http://127.0.0.1:8000"
    # Port 0: the OS picks both. The public port itself is refused, and port + 1 past 65535.
    assert RouterSettings(port=0).registry_bind_port == 0
    with pytest.raises(ConfigError, match="registry_port"):
        load_config(env={}, overrides={"router": {"port": 9000, "registry_port": 9000}})
    with pytest.raises(ConfigError, match="registry_port"):
        load_config(env={}, overrides={"router": {"port": 65535}})
    assert RouterSettings(port=65535, registry_port=65534).registry_bind_port == 65534


def test_up_children_read_one_resolved_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = build_parser().parse_args(["up", "--prefill", "2", "--decode", "3", "--port", "9100"])
    cfg, _ = resolve_config(args, env={})
    resolved = child_config(cfg, MODEL)
    assert resolved.model.path == MODEL and resolved.scheduler.threads
    assert resolved.router_url == "http://127.0.0.1:9100"
    cmds = worker_commands(resolved, tmp_path / "c.yaml", "info")
    assert [name for name, _ in cmds] == ["prefill-0", "prefill-1"] + [
        f"decode-{i}" for i in range(3)
    ]
    assert all("--config" in argv for _, argv in cmds)
    monkeypatch.setenv("PDSERVE_ROUTER__PORT", "1")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "/cache")
    env = child_env()
    assert "PDSERVE_ROUTER__PORT" not in env and env["PDSERVE_CACHE_DIR"] == "/cache"


def test_schema_cli_prints_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert set(schema["properties"]) == set(PdserveConfig.model_fields)
    assert "KVCacheSettings" in schema["$defs"]


def test_help_shows_the_schema_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["decode", "--help"])
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "(default: 30.0; config kv_cache.lease_s; env PDSERVE_KV_CACHE__LEASE_S)" in text


def _example(setting: Setting) -> tuple[list[str], object]:
    """Command-line words that set ``setting`` to a non-default value, and that value."""
    name = setting.flag_name()
    assert name is not None
    if setting.info.annotation is bool:
        value = not setting.default
        return [name if value else "--no-" + name[2:]], value
    if setting.path == "discovery.url":
        return [name, "etcd://e:2379"], "etcd://e:2379"
    if setting.path == "kv_cache.remote_cache":
        return [name, "redis://r:6379/0"], "redis://r:6379/0"
    if setting.path == "observability.otlp_traces_endpoint":
        return [name, "http://c:4318/v1/traces"], "http://c:4318/v1/traces"
    if setting.path == "scheduler.speculative_ngram_min":  # at most speculative_ngram_max
        return [name, "3"], 3
    if setting.path in ("planner.min_prefill", "planner.min_decode"):  # at most the max (2)
        return [name, "2"], 2
    choices = [a for a in typing.get_args(setting.info.annotation) if isinstance(a, str)]
    literal = [
        c for a in typing.get_args(setting.info.annotation) for c in typing.get_args(a)
    ] or choices
    if literal:
        value = next(c for c in literal if c != setting.default)
        return [name, str(value)], value
    if setting.path.endswith("device"):
        return [name, "cuda:1"], "cuda:1"
    if setting.info.annotation in (float, float | None):
        return [name, "0.5"], 0.5
    if setting.info.annotation in (int, int | None):
        return [name, "7"], 7
    if setting.info.annotation == list[SecretStr]:
        return [name, "x-7", name, "x-8"], ["x-7", "x-8"]
    paths = Path in typing.get_args(setting.info.annotation)
    return [name, "x-7"], Path("x-7") if paths else "x-7"


def _plain(value: object) -> object:
    """A setting's value with secrets revealed, to compare with what the flag was given."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.get_secret_value() if isinstance(value, SecretStr) else value


@pytest.mark.parametrize(
    "command", ["up", "router", "prefill", "decode", "colocated", "bench serve"]
)
def test_every_declared_flag_sets_its_setting(command: str) -> None:
    """The flags come from the declarations: each one a command takes lands in its own
    config path (and nothing else changes)."""
    checked = 0
    for setting in settings():
        if command not in setting.flag_commands():
            continue
        words, value = _example(setting)
        args = build_parser().parse_args([*command.split(), *words])
        cfg, sources = resolve_config(args, command if command in ROLES else None, env={})
        assert _plain(getattr(getattr(cfg, setting.section), setting.field)) == value, setting.path
        assert sources == {(setting.section, setting.field): "command line"}, setting.path
        checked += 1
    assert checked >= 5


def test_up_waits_for_every_worker_of_each_role() -> None:
    assert all_registered({"prefill": ["p0"], "decode": ["d0", "d1"]}, (1, 2))
    assert not all_registered({"prefill": ["p0", "p1"], "decode": ["d0"]}, (1, 2))
    ready = {"prefill": [], "decode": [], "colocated": ["c0"]}
    assert all_registered(ready, (0, 0, 1)) and not all_registered(ready, (0, 0, 2))


def test_up_starts_colocated_workers_behind_the_router(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--prefill", "0", "--decode", "1", "--colocated", "2"])
    cfg, _ = resolve_config(args, env={})
    resolved = child_config(cfg, MODEL)
    cmds = worker_commands(resolved, tmp_path / "c.yaml", "info")
    assert [name for name, _ in cmds] == ["decode-0", "colocated-0", "colocated-1"]
    assert [argv[argv.index("--config") - 1] for _, argv in cmds] == [
        "decode",
        "colocated",
        "colocated",
    ]


def test_an_api_key_given_as_a_flag_is_warned_about_without_the_key() -> None:
    """`ps` shows a process's argv to every local user (issue 39): the flag is named, the safer
    ways too, never the key; a key file or no key gives no warning."""
    from pdserve.cli import secret_flag_warning

    for argv in (["up", "--api-key", "sk-flag-1"], ["router", "--api-key=sk-flag-1"]):
        warning = secret_flag_warning(build_parser().parse_args(argv))
        assert warning is not None and warning.startswith("--api-key on the command line")
        assert "--api-key-file" in warning and "PDSERVE_API_KEY" in warning
        assert "sk-flag-1" not in warning
    for argv in (["up", "--api-key-file", "keys"], ["up"], ["prefill"], ["bench", "serve"]):
        assert secret_flag_warning(build_parser().parse_args(argv)) is None


def test_a_remote_cache_that_is_not_a_redis_url_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache:\n  remote_cache: localhost:6379\n")
    with pytest.raises(
        ConfigError, match=r"kv_cache\.remote_cache: .*redis://, rediss://, unix://"
    ):
        load_file(bad)
    good = tmp_path / "good.yaml"
    good.write_text("kv_cache:\n  remote_cache: redis://cache:6379/0\n")
    assert load_file(good).kv_cache.remote_cache == "redis://cache:6379/0"
