"""Every Python package of the source tree is in pyproject.toml's explicit package list, so the
wheel (the container image installs it) ships it: an editable install finds a missing one
anyway, so only this check or the image build would notice."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_tree_is_in_the_wheel_list() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    # a mapped folder holds its own packages; the root "pdserve" folder holds the others too
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed but not in the tree: {sorted(listed - found)}"
