"""Every (source, trigger, dest) of the machine definition is taken by some test.

Runs last (conftest orders it so) and reads the edges the suite fired, recorded in conftest. The
machine is read from its definition, registered tools included, so a new tool or a new
row of the table fails this test until a test walks it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.machine import get_machine
from tests.conftest import TAKEN_EDGES


def test_every_edge_of_the_machine_is_taken(request: pytest.FixtureRequest) -> None:
    session = request.session
    modules = {item.module.__name__ for item in session.items}
    here = Path(__file__).parent
    suite = {".".join(("tests", *p.relative_to(here).with_suffix("").parts)) for p in here.rglob("test_*.py")}
    if not suite <= modules or session.testscollected != len(session.items):
        pytest.skip("a partial run: edge coverage is judged on the whole suite only")
    missing = sorted(get_machine().spec.triples() - TAKEN_EDGES)
    assert not missing, "edges of the machine no test takes:\n" + "\n".join(
        f"  {s} --{t}--> {d}" for s, t, d in missing
    )
