"""README's test command is what CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _sh_blocks(text: str) -> list[str]:
    blocks = text.split("```sh\n")[1:]
    return [b.split("```")[0].strip() for b in blocks]


def test_ci_runs_readme_test_command_verbatim() -> None:
    blocks = _sh_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 2, "README holds exactly two set-up commands"
    serve, test = blocks
    assert serve.endswith("pdserve up")
    assert test.endswith("pytest")
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()
