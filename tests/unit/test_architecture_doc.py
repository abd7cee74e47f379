"""docs/architecture.md and docs/architecture/*.md state facts copied from the code; these tests
check them against the code, so the docs cannot drift: the protocol version, every repo path
in backticks, the overview's length, and the table of the modules that touch ``os.environ``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pdserve.protocol import PROTOCOL_VERSION

ROOT = Path(__file__).parents[2]
OVERVIEW = ROOT / "docs" / "architecture.md"
PAGES = sorted((ROOT / "docs" / "architecture").glob("*.md"))
DOCS = [OVERVIEW, *PAGES]
ENV_PAGE = ROOT / "docs" / "architecture" / "config.md"
ENV_HEADING = "## Environment variables (`os.environ`)"
PRODUCT = ("pdserve", "server", "router", "workers", "transfer")
MAX_OVERVIEW_LINES = 250

# A backticked span that is a relative repo path: a file ending in .py or a folder ending in /.
REPO_PATH = re.compile(r"`([A-Za-z0-9_.][A-Za-z0-9_./-]*(?:\.py|/))`")
VERSION = re.compile(r"PROTOCOL_VERSION`?\s*(?:=\s*)?(\d+)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def stated_versions(texts: list[str]) -> list[int]:
    return [int(m) for text in texts for m in VERSION.findall(text)]


def missing_paths(doc: Path) -> list[str]:
    return sorted({p for p in REPO_PATH.findall(_text(doc)) if not (ROOT / p).exists()})


def _is_os_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def environ_uses(source: str) -> set[str] | None:
    """None when the module never touches ``os.environ`` / ``os.getenv``; else the variable
    names it names literally (or through a module-level string constant) as a key."""
    tree = ast.parse(source)
    constants = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        if isinstance(n.value.value, str)
        for t in n.targets
        if isinstance(t, ast.Name)
    }

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    touched = False
    names: set[str] = set()
    for node in ast.walk(tree):
        if _is_os_attr(node, "environ") or _is_os_attr(node, "getenv"):
            touched = True
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            getter = _is_os_attr(func, "getenv") or (
                isinstance(func, ast.Attribute)
                and func.attr in ("get", "pop", "setdefault")
                and _is_os_attr(func.value, "environ")
            )
            if getter and (name := name_of(node.args[0])):
                names.add(name)
        if isinstance(node, ast.Subscript) and _is_os_attr(node.value, "environ"):
            if name := name_of(node.slice):
                names.add(name)
    return names if touched else None


def scan_product() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            names = environ_uses(_text(path))
            if names is not None:
                found[path.relative_to(ROOT).as_posix()] = names
    return found


def env_table(text: str) -> dict[str, str]:
    """The rows of the table under ENV_HEADING: module path -> the rest of its row."""
    assert ENV_HEADING in text, f"{ENV_PAGE.name} lacks the heading {ENV_HEADING!r}"
    section = text.split(ENV_HEADING, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([^`]+\.py)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_protocol_version_stated_equals_the_code() -> None:
    versions = stated_versions([_text(d) for d in DOCS])
    assert versions, "no doc states PROTOCOL_VERSION"
    assert set(versions) == {PROTOCOL_VERSION}, (versions, PROTOCOL_VERSION)


def test_version_check_can_fail() -> None:
    assert stated_versions(["`PROTOCOL_VERSION` 3 and PROTOCOL_VERSION = 4"]) == [3, 4]


def test_every_backticked_repo_path_exists() -> None:
    assert PAGES, "docs/architecture/ has no pages"
    problems = {d.relative_to(ROOT).as_posix(): missing_paths(d) for d in DOCS}
    assert not {k: v for k, v in problems.items() if v}, problems


def test_path_check_can_fail(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("`router/policy.py`, `workers/kv/`, `router/nowhere.py` and `/registry/`")
    assert missing_paths(doc) == ["router/nowhere.py"]


LINK = re.compile(r"\]\(([^)#:\s]+\.md)(?:#[^)]*)?\)")


def broken_links(doc: Path) -> list[str]:
    return sorted({link for link in LINK.findall(_text(doc)) if not (doc.parent / link).exists()})


def test_every_relative_link_resolves() -> None:
    problems = {d.relative_to(ROOT).as_posix(): broken_links(d) for d in DOCS}
    assert not {k: v for k, v in problems.items() if v}, problems


def test_link_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("[b](b.md), [c](c.md#x), [w](https://x.md)")
    (tmp_path / "b.md").write_text("")
    assert broken_links(tmp_path / "a.md") == ["c.md"]


def test_overview_is_short() -> None:
    lines = len(_text(OVERVIEW).splitlines())
    assert lines <= MAX_OVERVIEW_LINES, f"docs/architecture.md: {lines} lines"


def test_every_page_opens_with_a_reading_path() -> None:
    for page in PAGES:
        head = "\n".join(_text(page).splitlines()[:6])
        assert "Reading path" in head, page.name


def test_environ_table_lists_exactly_the_modules_that_touch_it() -> None:
    scanned = scan_product()
    table = env_table(_text(ENV_PAGE))
    assert sorted(table) == sorted(scanned), {
        "undocumented": sorted(set(scanned) - set(table)),
        "not touching os.environ": sorted(set(table) - set(scanned)),
    }
    for module, names in scanned.items():
        missing = sorted(n for n in names if f"`{n}`" not in table[module])
        assert not missing, f"{module}: the table lacks {missing}"


def test_environ_scan_can_fail() -> None:
    assert environ_uses("import os\nx = 1\n") is None
    src = 'import os\nK = "B"\nos.environ.get("A")\nos.environ[K] = "1"\nos.getenv("C")\n'
    assert environ_uses(src) == {"A", "B", "C"}
    assert environ_uses("import os\nenv = dict(os.environ)\n") == set()
    table = env_table(f"{ENV_HEADING}\n\n| module | variables |\n|---|---|\n| `a/b.py` | `X` |\n")
    assert table == {"a/b.py": " `X` "}
