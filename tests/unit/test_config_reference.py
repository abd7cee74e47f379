"""The committed configuration reference (docs/configuration.md) is exactly what the
declarations generate (``pdserve config reference``), and it covers every declared setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.config.reference import reference_markdown
from pdserve.config.settings import PdserveConfig, settings

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def test_the_committed_reference_equals_the_generated_one() -> None:
    assert PAGE.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: run `pdserve config reference > docs/configuration.md`"
    )


def test_every_section_and_setting_is_in_the_reference() -> None:
    page = reference_markdown()
    for section in PdserveConfig.model_fields:
        assert f"## `{section}`" in page, section
    for s in settings():
        assert s.env in page, s.path


def test_the_cli_prints_the_reference() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "config", "reference"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert out == reference_markdown()


def test_the_deploy_guide_links_the_reference_and_names_every_section() -> None:
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert "configuration.md" in guide
    for section in PdserveConfig.model_fields:
        assert f"`{section}`" in guide, section
