"""pdserve.security: API keys, the cluster secret and what is derived from it; the settings
that carry them (environment alias, masking)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.config.loading import dump_config, load_config
from pdserve.config.settings import SecuritySettings
from pdserve.errors import ConfigError
from pdserve.security import (
    MIN_SECRET_CHARS,
    APIKeys,
    ClusterKey,
    bearer,
    generate_secret,
    load_api_keys,
    load_cluster_secret,
    write_secret_file,
)

SECRET = "s" * MIN_SECRET_CHARS


def test_bearer_parses_only_the_bearer_scheme() -> None:
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") is None
    assert bearer("Bearer") is None
    assert bearer(None) is None


def test_api_keys_accept_any_configured_key_and_nothing_else() -> None:
    keys = APIKeys(["k1", "k2"])
    assert keys.enabled and len(keys) == 2
    assert keys.check("Bearer k1") and keys.check("Bearer k2")
    assert not keys.check("Bearer k3")
    assert not keys.check("Bearer k1x")
    assert not keys.check(None)
    assert "k1" not in repr(keys)


def test_no_api_keys_means_open() -> None:
    keys = APIKeys([])
    assert not keys.enabled
    assert keys.check(None)


def test_api_keys_come_from_settings_and_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("file-1\n\n  file-2  \n")
    sec = SecuritySettings(api_keys=["flag-1"], api_key_file=f)
    assert load_api_keys(sec) == ("flag-1", "file-1", "file-2")
    with pytest.raises(ConfigError, match="security.api_key_file"):
        load_api_keys(SecuritySettings(api_key_file=tmp_path / "missing"))


def test_cluster_secret_from_value_or_file(tmp_path: Path) -> None:
    assert load_cluster_secret(SecuritySettings(cluster_secret=SECRET)) == SECRET.encode()
    f = write_secret_file(tmp_path / "secret", generate_secret())
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert len(load_cluster_secret(SecuritySettings(cluster_secret_file=f))) == 64


@pytest.mark.parametrize(
    "sec, match",
    [
        (SecuritySettings(), "not set.*--cluster-secret-file"),
        (SecuritySettings(cluster_secret="short"), "5 characters, at least 32"),
        (SecuritySettings(cluster_secret_file=Path("/nonexistent/x")), "cannot read"),
    ],
)
def test_cluster_secret_problems_say_what_to_do(sec: SecuritySettings, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_cluster_secret(sec)


def test_cluster_key_derives_distinct_keys_and_hides_the_secret() -> None:
    key = ClusterKey(SECRET.encode())
    other = ClusterKey(("t" * MIN_SECRET_CHARS).encode())
    assert SECRET not in key.http_token and SECRET not in repr(key)
    assert key.http_token != other.http_token
    assert key.check_http(f"Bearer {key.http_token}")
    assert not key.check_http(f"Bearer {other.http_token}")
    assert not key.check_http(None)
    assert key.http_headers() == {"Authorization": f"Bearer {key.http_token}"}


def test_proofs_bind_label_and_every_part() -> None:
    key = ClusterKey(SECRET.encode())
    p = key.proof("transfer", b"n1", "w1")
    assert len(p) == 32
    assert key.verify(p, "transfer", b"n1", "w1")
    assert not key.verify(p, "other", b"n1", "w1")
    assert not key.verify(p, "transfer", b"n1", "w2")
    # length prefixes: moving a byte between parts changes the proof
    assert not key.verify(p, "transfer", b"n1w", "1")
    assert not ClusterKey(("t" * MIN_SECRET_CHARS).encode()).verify(p, "transfer", b"n1", "w1")


def test_api_key_env_alias_and_masked_dump() -> None:
    cfg, sources = load_config(env={"PDSERVE_API_KEY": "a1, a2"})
    assert [k.get_secret_value() for k in cfg.security.api_keys] == ["a1", "a2"]
    assert sources[("security", "api_keys")] == "env PDSERVE_API_KEY"
    # the section's own variable outranks the alias
    cfg, _ = load_config(env={"PDSERVE_API_KEY": "a1", "PDSERVE_SECURITY__API_KEYS": "b1"})
    assert [k.get_secret_value() for k in cfg.security.api_keys] == ["b1"]
    dumped = dump_config(cfg, sources)
    assert "b1" not in dumped and "**********" in dumped


def test_router_refuses_to_start_without_a_cluster_secret(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDSERVE_SECURITY__CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_SECURITY__CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.delenv("PDSERVE_CONFIG", raising=False)
    assert main(["router"]) == 2
    assert "--cluster-secret-file" in capsys.readouterr().err
