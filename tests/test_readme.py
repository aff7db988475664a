"""The README stays true: its first block holds the two commands (the docs pages are checked by test_docs.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands_and_ci_calls_the_test_one() -> None:
    first_block = README.split("```")[1].split()
    assert first_block == ["make", "demo", "make", "test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()
