"""docs/internals.md is the tree and the machine: its layout, its states, its termination reasons.

The states table has a row per core state and terminal of the machine's definition; the reasons
table names every reason the machine can record (and those set outside it) in its status's row.

The layout is the code block under "## Layout". A line starting at the left names a path from
the project's root and sets the folder of the lines below it; every word that looks like a
path (`name.py`, `folder/`) is looked up in that folder, then from the root. Every package
under engine/ (its folder or its `__init__.py`) and the top-level folders the project keeps
(engine/, tools/, tests/, diagrams/, docs/) must be named.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.local.invariants import REASON_STATUS
from engine.machine.states import STATES

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "internals.md"
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py|(?:[\w-]+/)+)(?=[\s,;:)]|$)")
TOP_LEVEL = ("engine/", "tools/", "tests/", "diagrams/", "docs/")


def layout_block(text: str) -> list[str]:
    section = text.split("\n## Layout", 1)[1]
    return section.split("```\n", 2)[1].splitlines()


def named_paths(lines: list[str], root: Path = ROOT) -> tuple[set[Path], list[str]]:
    """Every path the layout names (resolved), and the names that resolve to nothing."""
    named: set[Path] = set()
    missing: list[str] = []
    folder = root
    for line in lines:
        if not line.strip():
            continue
        first = line.split()[0]
        if not line[0].isspace() and PATH.fullmatch(first):  # a path from the root: the folder of what follows
            folder = root / first if first.endswith("/") else (root / first).parent
        for name in PATH.findall(line):
            candidate = next((c for c in (folder / name, root / name) if c.exists()), None)
            if candidate is None:
                missing.append(f"{name} (on the line {line.strip()[:60]!r})")
            else:
                named.add(candidate.resolve())
    return named, missing


def packages(root: Path = ROOT) -> list[Path]:
    return sorted(p.parent.resolve() for p in (root / "engine").rglob("__init__.py") if "__pycache__" not in p.parts)


def test_every_path_the_layout_names_exists() -> None:
    _, missing = named_paths(layout_block(PAGE.read_text(encoding="utf-8")))
    assert not missing, "docs/internals.md's layout names what the tree does not have:\n" + "\n".join(missing)


def test_every_package_and_top_level_folder_is_in_the_layout() -> None:
    named, _ = named_paths(layout_block(PAGE.read_text(encoding="utf-8")))
    wanted = [*packages(), *((ROOT / t).resolve() for t in TOP_LEVEL)]
    absent = [str(p.relative_to(ROOT)) for p in wanted if p not in named and p / "__init__.py" not in named]
    assert not absent, "docs/internals.md's layout does not name: " + ", ".join(absent)


def test_the_checker_sees_a_missing_module_and_an_unlisted_package(tmp_path: Path) -> None:
    """Negative controls on a tree of its own: a named module that is gone, a package nobody named."""
    for rel in ("engine/__init__.py", "engine/machine/__init__.py", "engine/machine/states.py", "engine/envs/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    lines = ["engine/machine/      THE MACHINE", "    states.py          states", "    table.py           edges"]
    named, missing = named_paths(lines, tmp_path)
    assert missing == ["table.py (on the line 'table.py           edges')"]
    assert (tmp_path / "engine" / "machine" / "states.py").resolve() in named
    assert [p for p in packages(tmp_path) if p not in named and p / "__init__.py" not in named] == [
        (tmp_path / "engine").resolve(), (tmp_path / "engine" / "envs").resolve()]


def _table_rows(text: str, header: str) -> dict[str, str]:
    """A markdown table's rows under the line `header`, by the first cell."""
    rows = text.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return {row.split("|")[1].strip(): row for row in rows if row.startswith("|")}


def test_every_state_and_every_reason_is_in_the_tables() -> None:
    text = PAGE.read_text(encoding="utf-8")
    states = _table_rows(text, "| state | what happens there |")
    listed = {name.strip() for key in states for name in key.split(",")}
    assert {d.name for d in STATES} <= listed, "docs/internals.md's states table lacks a state"
    reasons = _table_rows(text, "| status | reasons |")
    for reason, status in REASON_STATUS.items():
        row = next((row for key, row in reasons.items() if key.split()[0] == status), "")
        assert f"`{reason}`" in row, f"docs/internals.md does not list `{reason}` under {status}"
