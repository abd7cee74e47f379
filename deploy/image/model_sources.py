"""Copy the modules ``pdserve.models`` imports at run time, and nothing else, for the image's
``model`` stage (Dockerfile): the default model's conversion is redone only when one of them
changes. The list is derived from the source on every build, never kept by hand.

usage: python model_sources.py SRC DEST   (SRC holds the ``pdserve`` folder; DEST receives the
closure's files under the same relative paths). Imports nothing of pdserve: only ``ast``.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path


def _module_file(src: Path, name: str) -> Path | None:
    """The file of module ``name`` (``pdserve.x.y``) under ``src``, or None (not pdserve's)."""
    base = src.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _runtime_imports(file: Path, name: str) -> set[str]:
    """Modules ``file`` imports when it runs: module level and under ``if``/``try``, not under
    ``if TYPE_CHECKING:`` and not inside functions."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                test = node.test
                typing_only = getattr(test, "id", None) == "TYPE_CHECKING" or (
                    getattr(test, "attr", None) == "TYPE_CHECKING"
                )
                if not typing_only:
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)

    visit(ast.parse(file.read_text()).body)
    return found


def closure(src: Path, root: str = "pdserve.models") -> dict[str, Path]:
    """Module name -> file for ``root`` and every pdserve module it imports at run time,
    with the ``__init__`` of each package on the way (Python runs them on import)."""
    out: dict[str, Path] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for n in range(1, len(parts) + 1):
            prefix = ".".join(parts[:n])
            file = _module_file(src, prefix)
            if file is not None and prefix not in out:
                out[prefix] = file
                todo.extend(
                    m
                    for m in _runtime_imports(file, prefix)
                    if m.split(".")[0] == "pdserve" and _module_file(src, m) is not None
                )
    return out


def main() -> None:
    src, dest = Path(sys.argv[1]), Path(sys.argv[2])
    for file in sorted(closure(src).values()):
        target = dest / file.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, target)
        print(target.relative_to(dest))


if __name__ == "__main__":
    main()
