"""docs/sandbox.md and docs/sandbox-modes.md say what the attack suite is: its attacks, in its order,
and figures whose totals are the suite's size and whose counts are their tables' "yes" cells.
Neither page calls an attribute on `probe()`, which is a coroutine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.sandbox.attacks.suite import all_attacks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "sandbox.md", ROOT / "docs" / "sandbox-modes.md"]


def attack_table(page: Path) -> list[list[str]]:
    """The rows of the page's table whose header starts with `attack` (cells stripped)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*attack\s*\|", line))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_pages_list_the_suites_attacks_in_its_order(page: Path) -> None:
    names = [row[0] for row in attack_table(page) if row[0] != "contained"]
    assert names == [name for name, _ in all_attacks()]


def test_every_contained_figure_counts_its_table_out_of_the_whole_suite() -> None:
    total = len(all_attacks())
    root = attack_table(PAGES[0])
    figures = re.findall(r"\*\*(\d+)/(\d+)(?: contained)?\*\*", PAGES[0].read_text(encoding="utf-8"))
    assert figures and all(int(m) == total for _, m in figures)
    assert int(figures[0][0]) == sum(row[1] == "yes" for row in root)  # the root run's table
    modes = attack_table(PAGES[1])
    counted = next(row for row in modes if row[0] == "contained")[1:]
    yes = [sum(row[i] == "yes" for row in modes if row[0] != "contained") for i in range(1, len(counted) + 1)]
    assert counted == [f"{n}/{total}" for n in yes]
    assert [f"{n}/{m}" for n, m in figures[1:]] == counted[1:]  # "as root without CAP_SYS_ADMIN: ..., as a user: ..."


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_no_page_reads_an_attribute_of_the_probe_coroutine(page: Path) -> None:
    assert not re.findall(r"probe\(\)\.", page.read_text(encoding="utf-8")), "probe() is a coroutine: await it, or probe_sync()"
