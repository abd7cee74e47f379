"""The package's import graph has no cycles, and the data plane never imports the tools.

Module-level imports only (``if TYPE_CHECKING:`` blocks are not imports at run time); imports
inside functions are lazy by design (heavy or optional dependencies) and are left out.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
            name = ".".join([package, *parts])
            out[name] = file
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(file: Path, name: str, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(file.read_text())
    found: set[str] = set()
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # ``from pkg import module`` needs the module; ``from pkg import name``, pkg.
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)

    visit(tree.body)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _top_level_imports(file, name, modules) for name, file in modules.items()}


def test_the_import_graph_has_no_cycles() -> None:
    graph = _graph()
    assert len(graph) > 50
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                walk(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)


def test_roles_and_the_data_plane_never_import_the_tools() -> None:
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith(
            ("pdserve.transfer", "pdserve.workers", "pdserve.server", "pdserve.router")
        ):
            assert not {d for d in deps if d.startswith(("pdserve.tools", "pdserve.cli"))}, name


def test_the_image_model_stage_copies_every_module_the_conversion_imports() -> None:
    """The Dockerfile's ``model`` stage copies only the modules ``pdserve.models`` needs (so
    source edits rarely redo the conversion): exactly its module-level closure."""
    graph = _graph()
    needed, todo = {"pdserve", "pdserve.models"}, ["pdserve.models"]
    while todo:
        for dep in graph[todo.pop()] - needed:
            needed.add(dep)
            todo.append(dep)
    text = (ROOT / "Dockerfile").read_text()
    stage = text[text.index("AS model") :].split("\nFROM ", 1)[0]
    copy = stage[stage.index("\nCOPY ") : stage.index("/src/pdserve/")].replace("\\\n", " ")
    copied = {
        "pdserve" if w == "pdserve/__init__.py" else w.removesuffix(".py").replace("/", ".")
        for w in copy.split()[1:]
    }
    assert copied == needed
