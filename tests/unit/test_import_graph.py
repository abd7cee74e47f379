"""The package's import graph: no cycles, and arrows between rooms run one way.

Every import counts: module level, under ``if TYPE_CHECKING:`` and inside functions (a cycle
through a type-only or a lazy import is still a tangle a reader must untie). The rooms and the
arrows they may not take (``A -/-> B``: no module of A imports one of B)::

    leaf contracts   pdserve.errors, pdserve.protocol, pdserve.block_hash -/-> anything of pdserve
    core             pdserve.<module or package> (config, security, observability, launch,
                     planner, ...) -/-> a room (the entry points pdserve.cli and
                     pdserve.launch.launcher compose the rooms)
    http             pdserve.http, the HTTP plumbing router, server and workers share
                     -/-> a room
    workers          kv -/-> engine, roles;  engine -/-> roles
    router           -/-> workers, server, transfer
    transfer         -/-> workers, router, server, discovery
    discovery        -/-> workers, router, server, transfer
    server           -/-> workers
    bench            only pdserve.cli (and the benchmarks themselves) import pdserve.bench

The checker is tested on injected cycles of each kind and on an arrow against the order.
"""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LEAVES = ("pdserve.errors", "pdserve.protocol", "pdserve.block_hash")
ROOMS = (
    "pdserve.workers",
    "pdserve.router",
    "pdserve.server",
    "pdserve.transfer",
    "pdserve.discovery",
    "pdserve.bench",
)
ENTRY_POINTS = ("pdserve.cli", "pdserve.launch.launcher")
FORBIDDEN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pdserve.workers.kv", ("pdserve.workers.engine", "pdserve.workers.roles")),
    ("pdserve.workers.engine", ("pdserve.workers.roles",)),
    ("pdserve.router", ("pdserve.workers", "pdserve.server", "pdserve.transfer")),
    ("pdserve.transfer", ("pdserve.workers", "pdserve.router", "pdserve.server", "pdserve.discovery")),
    ("pdserve.discovery", ("pdserve.workers", "pdserve.router", "pdserve.server", "pdserve.transfer")),
    ("pdserve.server", ("pdserve.workers",)),
    ("pdserve.http", ROOMS),
)  # fmt: skip
"""(room, the rooms it may not import)."""


def _modules() -> dict[str, Path]:
    """``pdserve.*`` module name -> file, through ``[tool.setuptools.package-dir]``."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    out: dict[str, Path] = {}
    for package, folder in mapping.items():
        base = ROOT / folder
        for file in base.rglob("*.py"):
            rel = file.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = file
    return out


def _sources() -> dict[str, tuple[str, bool]]:
    """Module name -> (source text, is a package ``__init__``)."""
    return {n: (f.read_text(), f.name == "__init__.py") for n, f in _modules().items()}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(node: ast.ImportFrom | ast.Import, package: str, known: Iterable[str]) -> set[str]:
    names = set(known)
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*up, base] if base else up)
    # ``from pkg import module`` needs the module; ``from pkg import name``, pkg.
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names}


def imports_of(
    name: str, source: str, is_package: bool, known: Iterable[str], *, every: bool = True
) -> set[str]:
    """The ``pdserve`` modules ``name`` imports: every import in the file (``every``), or only
    those that run at import time (module level, not under ``TYPE_CHECKING``)."""
    known = set(known)
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    if every:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                found |= _resolve(node, package, known)
    else:

        def visit(body: list[ast.stmt]) -> None:
            for node in body:
                if isinstance(node, ast.If) and _is_type_checking(node):
                    visit(node.orelse)
                elif isinstance(node, ast.If | ast.Try):
                    visit(node.body)
                    visit(getattr(node, "orelse", []))
                    for handler in getattr(node, "handlers", []):
                        visit(handler.body)
                elif isinstance(node, ast.Import | ast.ImportFrom):
                    found.update(_resolve(node, package, known))

        visit(tree.body)
    return {m for m in found if m in known and m != name}


def graph(sources: dict[str, tuple[str, bool]], *, every: bool = True) -> dict[str, set[str]]:
    return {n: imports_of(n, src, pkg, sources, every=every) for n, (src, pkg) in sources.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``g`` (first module repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(g[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := walk(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(g):
        if node not in state and (cycle := walk(node)) is not None:
            return cycle
    return None


def _under(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def wrong_arrows(g: dict[str, set[str]]) -> list[str]:
    """Every import against the rooms' order (see the module docstring), as ``"a -> b"``."""
    bad = []
    for name, deps in sorted(g.items()):
        for dep in sorted(deps):
            if name in LEAVES:
                bad.append(f"{name} -> {dep} (a leaf contract imports nothing of pdserve)")
            elif _under(dep, "pdserve.bench") and not (
                name == "pdserve.cli" or _under(name, "pdserve.bench")
            ):
                bad.append(f"{name} -> {dep} (only the CLI imports the benchmarks)")
            elif (
                not any(_under(name, r) for r in ROOMS)
                and name not in ENTRY_POINTS
                and any(_under(dep, r) for r in ROOMS)
            ):
                bad.append(f"{name} -> {dep} (the core imports no room)")
            for room, banned in FORBIDDEN:
                if _under(name, room) and any(_under(dep, b) for b in banned):
                    bad.append(f"{name} -> {dep} ({room} may not import {banned})")
    return bad


def test_the_import_graph_has_no_cycles() -> None:
    g = graph(_sources())
    assert len(g) > 50
    assert find_cycle(g) is None, "import cycle: " + " -> ".join(find_cycle(g) or [])


def test_arrows_between_rooms_run_one_way() -> None:
    assert wrong_arrows(graph(_sources())) == []


def _inject(
    sources: dict[str, tuple[str, bool]], name: str, code: str
) -> dict[str, tuple[str, bool]]:
    src, pkg = sources[name]
    return {**sources, name: (src + "\n" + code + "\n", pkg)}


@pytest.mark.parametrize(
    "code",
    [
        "from pdserve.security import ClusterKey",  # module level
        "if TYPE_CHECKING:\n    from pdserve.security import ClusterKey",  # type only
        "def _f():\n    from pdserve.security import ClusterKey",  # function-local
    ],
    ids=["module-level", "type-checking", "function-local"],
)
def test_the_checker_catches_an_injected_cycle_of_each_kind(code: str) -> None:
    # pdserve.security imports pdserve.errors (ConfigError): errors -> security closes a cycle.
    sources = _inject(_sources(), "pdserve.errors", code)
    cycle = find_cycle(graph(sources))
    assert cycle is not None and "pdserve.errors" in cycle and "pdserve.security" in cycle
    assert "pdserve.errors -> pdserve.security" in " ".join(wrong_arrows(graph(sources)))


@pytest.mark.parametrize(
    ("name", "code", "arrow"),
    [
        ("pdserve.workers.engine.engine", "from pdserve.workers.roles import worker_app as app",
         "pdserve.workers.engine.engine -> pdserve.workers.roles.worker_app"),
        ("pdserve.workers.kv.manager",
         "if TYPE_CHECKING:\n    from pdserve.workers.engine.sequence import Sequence",
         "pdserve.workers.kv.manager -> pdserve.workers.engine.sequence"),
        ("pdserve.router.policy", "def _f():\n    from pdserve.workers.kv import sizing",
         "pdserve.router.policy -> pdserve.workers.kv.sizing"),
        ("pdserve.transfer.sender", "from pdserve.bench import bench",
         "pdserve.transfer.sender -> pdserve.bench.bench"),
        ("pdserve.config.settings", "from pdserve.router import policy",
         "pdserve.config.settings -> pdserve.router.policy"),
        ("pdserve.http.error_responses", "def _f():\n    from pdserve.server import app",
         "pdserve.http.error_responses -> pdserve.server.app (pdserve.http may not import"),
    ],
)  # fmt: skip
def test_the_checker_catches_an_arrow_against_the_rooms_order(
    name: str, code: str, arrow: str
) -> None:
    bad = wrong_arrows(graph(_inject(_sources(), name, code)))
    assert any(b.startswith(arrow) for b in bad), bad


def test_the_image_model_stage_copies_every_module_the_conversion_imports() -> None:
    """The Dockerfile's ``model`` stage gets only the modules ``pdserve.models`` needs (so source
    edits rarely redo the conversion), found by ``deploy/image/model_sources.py`` on each build:
    exactly the run-time closure this test's own graph computes, and the Dockerfile uses it."""
    g = graph(_sources(), every=False)
    needed, todo = {"pdserve", "pdserve.models"}, ["pdserve.models"]
    while todo:
        for dep in g[todo.pop()] - needed:
            needed.add(dep)
            todo.append(dep)
    # the packages on the way run on import too
    needed |= {".".join(m.split(".")[:n]) for m in needed for n in range(1, m.count(".") + 1)}
    spec = importlib.util.spec_from_file_location(
        "model_sources", ROOT / "deploy" / "image" / "model_sources.py"
    )
    assert spec is not None and spec.loader is not None
    finder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finder)
    assert set(finder.closure(ROOT)) == needed
    text = (ROOT / "Dockerfile").read_text()
    stage = text[text.index("AS model-sources") :].split("\nFROM ", 1)[0]
    assert "model_sources.py /src /model-src" in stage
    model = text[text.index("AS model\n") :].split("\nFROM ", 1)[0]
    assert "COPY --from=model-sources /model-src/ /src/" in model
    assert "!deploy/image/model_sources.py" in (ROOT / ".dockerignore").read_text()


def test_test_modules_import_only_the_support_kit() -> None:
    """Shared test code lives in ``tests/support``; no test module imports another test module
    (or a helper kept beside its tests)."""
    tests = ROOT / "tests"
    bad = []
    for file in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("tests.") and not name.startswith("tests.support"):
                    bad.append(f"{file.relative_to(ROOT)} imports {name}")
    assert bad == []
