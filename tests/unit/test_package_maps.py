"""Every package's ``__init__`` docstring is its map, and no folder is a crowd.

The rules, for every package folder under the roots of ``[tool.setuptools.package-dir]``:

- the map names each direct module ``x.py`` and each subpackage ``y/`` as the literal
  ````x```` / ````y```` (double backticks), so a reader finds every file from its folder's map;
- a folder holds at most :data:`MAX_MODULES` modules directly (``__init__`` aside): past that,
  it is split into subpackages by concept;
- no stale entry: a ``:mod:`` reference (``:mod:`.x``` or ``:mod:`pdserve.a.b```) or a dotted
  ````pdserve.a.b```` in a map names a module that exists, and a bare ````x```` that names no
  module under this package must not be the name of a module elsewhere in the tree (a module
  of another package is named dotted, ````pdserve.router.policy````, or with ``:mod:``). A
  renamed or moved module thus shows up as a stale entry in the map that still names it.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULES = 14

_BARE = re.compile(r"``([A-Za-z_][A-Za-z0-9_]*)``")
_DOTTED = re.compile(r"``(pdserve(?:\.[A-Za-z_][A-Za-z0-9_]*)+)``")
_MOD = re.compile(r":mod:`~?(\.?[A-Za-z_.][A-Za-z0-9_.]*)`")


def _packages() -> dict[str, Path]:
    """``pdserve.*`` package name -> folder, through ``[tool.setuptools.package-dir]``."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    out: dict[str, Path] = {}
    for package, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            out[".".join([package, *rel.parts])] = init.parent
    return out


def _modules_in(folder: Path) -> list[str]:
    """The direct modules of a package folder (``__init__`` aside)."""
    return sorted(f.stem for f in folder.glob("*.py") if f.name != "__init__.py")


def _children(package: str, packages: dict[str, Path]) -> tuple[list[str], list[str]]:
    """(direct modules, subpackages) of a package; the root's subpackages include the rooms
    mapped from folders of their own (``pdserve.server`` = server/, ...)."""
    subpackages = sorted(
        name.rpartition(".")[2] for name in packages if name.rpartition(".")[0] == package
    )
    return _modules_in(packages[package]), subpackages


def _map(folder: Path) -> str:
    return ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""


def _all_modules(packages: dict[str, Path]) -> set[str]:
    names = set(packages)
    for package, folder in packages.items():
        names |= {f"{package}.{m}" for m in _modules_in(folder)}
    return names


def missing_entries(docstring: str, names: list[str]) -> list[str]:
    """The names a map does not give as ````name````."""
    return [n for n in names if f"``{n}``" not in docstring]


def stale_entries(package: str, docstring: str, below: set[str], modules: set[str]) -> list[str]:
    """References of a map to modules that do not exist (see the module docstring); ``below``:
    the names of the modules and packages under ``package``, at any depth."""
    bad = []
    for ref in _MOD.findall(docstring):
        target = f"{package}{ref}" if ref.startswith(".") else ref
        if target.startswith("pdserve") and target not in modules:
            bad.append(f":mod:`{ref}`")
    bad += [f"``{d}``" for d in _DOTTED.findall(docstring) if d not in modules]
    elsewhere = {m.rpartition(".")[2] for m in modules}
    bad += [
        f"``{n}``"
        for n in dict.fromkeys(_BARE.findall(docstring))
        if n not in below and n in elsewhere and n != "pdserve"
    ]
    return bad


def test_every_package_has_a_map_naming_each_module_and_subpackage() -> None:
    packages = _packages()
    assert len(packages) > 20
    missing = {}
    for package, folder in sorted(packages.items()):
        modules, subpackages = _children(package, packages)
        if gaps := missing_entries(_map(folder), modules + subpackages):
            missing[package] = gaps
    assert missing == {}, f"add ``name`` entries to these packages' __init__ docstrings: {missing}"


def test_no_folder_holds_more_than_fourteen_modules() -> None:
    crowded = {
        package: len(modules)
        for package, folder in _packages().items()
        if len(modules := _modules_in(folder)) > MAX_MODULES
    }
    assert crowded == {}, f"split these folders into subpackages by concept: {crowded}"


def test_no_map_names_a_module_that_is_gone() -> None:
    packages = _packages()
    modules = _all_modules(packages)
    stale = {}
    for package, folder in sorted(packages.items()):
        below = {m.rpartition(".")[2] for m in modules if m.startswith(package + ".")}
        if bad := stale_entries(package, _map(folder), below, modules):
            stale[package] = bad
    assert stale == {}, f"stale entries in these packages' maps: {stale}"


def test_the_checks_catch_a_missing_and_a_stale_entry() -> None:
    modules = {"pdserve.a", "pdserve.a.here", "pdserve.b", "pdserve.b.elsewhere"}
    doc = "``here`` and ``elsewhere``; :mod:`.gone`, :mod:`pdserve.b.elsewhere`, ``pdserve.a.x``"
    assert missing_entries(doc, ["here", "new"]) == ["new"]
    assert stale_entries("pdserve.a", doc, {"here"}, modules) == [
        ":mod:`.gone`",
        "``pdserve.a.x``",
        "``elsewhere``",
    ]


def test_the_root_map_leads_to_the_seed_components_in_one_hop() -> None:
    """The root map names the file (or folder) of each seed component, the scheduler, the
    router's policy and the benchmarks; each package's own map names it too."""
    root = _map(ROOT / "pdserve")
    packages = _packages()
    for path, package, entry in [
        ("transfer/transceiver.py", "pdserve.transfer", "transceiver"),  # Transceiver
        ("transfer/formatter/", "pdserve.transfer", "formatter"),  # Formatter
        ("transfer/agents/", "pdserve.transfer", "agents"),  # TransferAgent
        ("workers/kv/offload.py", "pdserve.workers.kv", "offload"),  # KV cache connector
        ("workers/engine/scheduler.py", "pdserve.workers.engine", "scheduler"),
        ("router/policy.py", "pdserve.router", "policy"),
        ("pdserve/bench/", "pdserve", "bench"),
    ]:
        assert f"``{path}``" in root, path
        assert f"``{entry}``" in _map(packages[package]), (package, entry)
