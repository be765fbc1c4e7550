"""The attack suite of `python -m engine attacks`, against the real sandbox.

The whole suite runs once (about 12 s) with the code interpreter's limits; then every
attack must be contained, and no process of any uid the suite leased may be alive. Needs
root and both namespaces, like the isolation tests of test_sandbox.py; elsewhere the
sandbox is weaker by design and the report says so instead.

`KNOWN_GAPS` are attacks the current sandbox does not contain (see the report): they are
strict xfails, so the test fails as soon as one is fixed and its entry must go.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from engine.tools.sandbox import runner as sandbox
from engine.tools.sandbox.attacks import suite as attacks
from engine.tools.sandbox.attacks.lab import Lab, Outcome, processes
from engine.tools.sandbox.attacks.suite import all_attacks, default_lab, exit_code, render_table, run_suite

KNOWN_GAPS: dict[str, str] = {}
NAMES = [name for name, _ in all_attacks()]


@pytest.fixture(scope="module")
def suite() -> Iterator[tuple[list[Outcome], Lab, set[int]]]:
    """Run every attack once; yields the rows, the lab and the uids the sandbox leased."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox's uid separation needs root")
    if not (sandbox.network_isolated() and sandbox.filesystem_isolated()):
        pytest.skip("no network or mount namespace here (needs root and unshare)")
    leased: set[int] = set()
    lease = sandbox._try_lease

    def recording(uids: tuple[int, ...]) -> Any:
        got = lease(uids)
        if got is not None:
            leased.add(got.uid)
        return got

    lab = default_lab()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sandbox, "_try_lease", recording)
        outcomes = asyncio.run(run_suite(lab=lab))
    yield outcomes, lab, leased


@pytest.mark.parametrize("name", NAMES)
def test_attack_is_contained(suite: tuple[list[Outcome], Lab, set[int]], name: str) -> None:
    outcomes, _, _ = suite
    row = next(o for o in outcomes if o.attack == name)
    if name in KNOWN_GAPS:
        assert not row.contained, f"{name} is contained now: drop it from KNOWN_GAPS"
        pytest.xfail(KNOWN_GAPS[name])
    assert row.contained, f"{row.how} | {row.evidence}"
    assert row.how  # the mechanism, read from what was observed


def test_nothing_of_the_sandbox_survives(suite: tuple[list[Outcome], Lab, set[int]]) -> None:
    outcomes, lab, leased = suite
    assert len(outcomes) == len(NAMES) >= 20
    assert lab.uids and lab.uids <= leased  # the uids the programs reported are ones we leased
    assert all(sandbox.UID_BASE <= uid < sandbox.UID_BASE + sandbox.UID_COUNT for uid in leased)
    assert {uid: processes(uid) for uid in leased if processes(uid)} == {}


def test_report_and_exit_code(suite: tuple[list[Outcome], Lab, set[int]], monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    outcomes, _, _ = suite
    table = render_table(outcomes).splitlines()
    assert [cell.strip() for cell in table[0].split("|")[1:-1]] == ["attack", "contained", "how", "evidence"]
    assert len(table) == len(outcomes) + 2 and len({len(line) for line in table}) == 1  # aligned
    assert exit_code(outcomes) == (0 if all(o.contained for o in outcomes) else 1)
    assert exit_code([Outcome("a", True, "h", "e", 0.0)]) == 0 and exit_code([]) == 1

    async def canned(names: list[str] | None = None, lab: Lab | None = None) -> list[Outcome]:
        return outcomes

    monkeypatch.setattr(attacks, "run_suite", canned)
    rc = attacks.main_attacks(argparse.Namespace(json=True))
    report = json.loads(capsys.readouterr().out)
    assert rc == exit_code(outcomes) and report["total"] == len(outcomes)
    assert [a["attack"] for a in report["attacks"]] == NAMES
    assert attacks.main_attacks(argparse.Namespace(json=False)) == rc
    assert capsys.readouterr().out.splitlines()[-1] == f"{report['contained']}/{len(outcomes)} attacks contained"
