"""The docs read as a manual, not a lab notebook.

- No markdown table cell longer than `MAX_CELL` characters in README.md, CONTRIBUTING.md or any
  page of the docs site (docs/*.md, and benchmarks/results/*.md, which the site shows through
  the docs/results link): a long cell is a paragraph that belongs in a list or a section.
- No run-history notes in the guides (docs/*.md): "Before: ...", "an earlier run gave ...",
  "before this change / the fix". Run history lives in benchmarks/results/HISTORY.md and the
  CHANGELOG; a guide states what is true now, with the command that measured it.

Fenced code blocks are skipped (code may say `before:`).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_CELL = 300
GUIDES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *GUIDES,
         *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
HISTORY = re.compile(r"\bbefore:|\bearlier run\b|\bbefore (?:this|the) (?:change|fix)\b", re.I)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a page with its fenced code blocks blanked (line numbers kept)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return list(enumerate(text.splitlines(), start=1))


def table_cells(line: str) -> list[str]:
    """The cells of a markdown table row (`| a | b |`); [] for any other line."""
    row = line.strip()
    if not row.startswith("|"):
        return []
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip("|"))]


def long_cells(text: str) -> list[str]:
    return [f"line {n}: {len(cell)} characters: {cell[:80]}..."
            for n, line in prose_lines(text) for cell in table_cells(line) if len(cell) > MAX_CELL]


def history_notes(text: str) -> list[str]:
    return [f"line {n}: {line.strip()[:120]}" for n, line in prose_lines(text) if HISTORY.search(line)]


def test_the_checks_catch_what_they_are_for():
    row = "| fault | " + "x" * (MAX_CELL + 1) + " |\n"
    assert long_cells("| a | b |\n|---|---|\n" + row) and not long_cells("| a | b |\n")
    assert not long_cells("```\n" + row + "```\n"), "code blocks are skipped"
    assert history_notes("ok.\nBefore: 6 attempts.\n") and history_notes("an earlier run today gave 3x")
    assert history_notes("(before: 10x slower)") and history_notes("Before the fix, it rose.")
    assert not history_notes("```python\nif before:\n    pass\n```\n")
    assert not history_notes("Save the state before the step ends.")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_long_table_cell(page):
    assert not (found := long_cells(page.read_text())), (
        f"{page.relative_to(ROOT)}: table cells over {MAX_CELL} characters (use a list or a section):\n"
        + "\n".join(found))


@pytest.mark.parametrize("page", GUIDES, ids=[str(p.relative_to(ROOT)) for p in GUIDES])
def test_no_run_history_in_guides(page):
    assert not (found := history_notes(page.read_text())), (
        f"{page.relative_to(ROOT)}: run-history notes (move them to benchmarks/results/HISTORY.md "
        "or the CHANGELOG; the guide says what is true now):\n" + "\n".join(found))
