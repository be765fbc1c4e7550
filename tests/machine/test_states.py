"""A state is defined once: its definition carries what it does, checked when the machine is built.

Every non-terminal state has exactly one behaviour (the trigger it fires at once, or the loop's
step it names), a step must exist, a trigger fired at once must always find an edge; and a new
core state is three files: its definition, its edges, its step (the last test makes one in a copy
of the tree and shows the diff).
"""

from __future__ import annotations

import difflib
import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import respx

from engine.local.invariants import REASON_STATUS
from engine.loop import driver
from engine.loop.driver import STEPS, drive, new_rollout
from engine.loop.runtime import Runtime
from engine.machine import guards
from engine.machine.states import STATES, TERMINALS, TOOL_STEP, Step, StateDef, Trigger
from engine.machine.table import Edge, MachineDefinitionError, MachineSpec, RolloutMachine, get_machine
from tests.conftest import run
from tests.machine.test_machine import cfg
from tests.support.helpers import SAMPLING, URL, ScriptedServer, tok, turn

ROOT = Path(__file__).resolve().parents[2]


def test_every_non_terminal_state_has_exactly_one_behaviour_and_its_step_exists() -> None:
    spec = get_machine().spec
    bound = spec.bind(STEPS)
    for state, d in spec.defs.items():
        if state in TERMINALS:
            assert d.does is None and state not in bound
            continue
        assert (d.fires is None) != (d.step is None), state  # one, never both, never neither
        assert bound[state] == (d.fires if d.fires is not None else STEPS[d.step])
    assert {d.step for d in spec.defs.values() if d.step} == set(STEPS)  # no step of the loop is unused
    assert all(spec.defs[s].does == TOOL_STEP for s in spec.tool_states)


@pytest.mark.parametrize("kind, does, message", [
    ("core", None, "needs one behaviour"),
    ("core", "check", "needs one behaviour"),  # a plain string is neither a Trigger nor a Step
    ("terminal", Trigger.CHECK, "cannot fire or run a step"),
    ("terminal", Step("x"), "cannot fire or run a step"),
])
def test_a_definition_without_exactly_one_behaviour_is_refused(kind: str, does: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StateDef("TOY", kind, "a toy", does)  # type: ignore[arg-type]


def _with_toy(spec: MachineSpec, does: Any, edges: list[Edge]) -> MachineSpec:
    toy = StateDef("TOY", "core", "a toy state", does)
    return MachineSpec(spec.states[:-4] + ("TOY",) + spec.states[-4:], spec.edges + tuple(edges),
                       spec.tool_states, {**spec.defs, "TOY": toy})


def test_a_trigger_fired_at_once_must_always_find_an_edge() -> None:
    spec = get_machine().spec
    with pytest.raises(MachineDefinitionError, match="TOY fires check at once, but no edge of check leaves it"):
        _with_toy(spec, Trigger.CHECK, [])
    with pytest.raises(MachineDefinitionError, match=r"last row of check has a guard \(answered\)"):
        _with_toy(spec, Trigger.CHECK, [Edge("TOY", "check", "COMPLETED", guards.answered)])
    with pytest.raises(MachineDefinitionError, match="joins a state the machine does not have"):
        _with_toy(spec, Trigger.CHECK, [Edge("TOY", "check", "NOWHERE")])
    assert "TOY" in _with_toy(spec, Trigger.CHECK, [Edge("TOY", "check", "COMPLETED")]).states


def test_a_step_the_loop_lacks_is_refused_when_bound_and_a_sample_driven_there_fails_recorded() -> None:
    spec = get_machine().spec
    toy = _with_toy(spec, Step("nonexistent"), [Edge("TOY", "done", "COMPLETED")])
    with pytest.raises(MachineDefinitionError, match="state TOY runs the step 'nonexistent', which the loop does not define"):
        toy.bind(STEPS)

    async def go() -> Any:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=ScriptedServer([]))
            async with Runtime.create(cfg(), tokenizer=tok()) as rt:
                r = new_rollout(rt, "What is 1?", dict(SAMPLING))
                await drive(rt, r, RolloutMachine(toy))  # never raises into the caller
                return r

    r = run(go())
    assert (r.state, r.record.reason) == ("FAILED", "crashed")
    assert "'nonexistent'" in r.record.error and r.record.trace == [("RESET", "crashed", "FAILED")]


def test_the_outcome_checker_reads_every_reason_from_the_table() -> None:
    """The environment's reasons included; each reason's status is the terminal its edge leads to."""
    spec = get_machine().spec
    statuses = spec.reason_statuses()
    assert statuses["environment_done"] == "COMPLETED" and statuses["environment_failed"] == "FAILED"
    assert statuses["observation_over_budget"] == "TRUNCATED"  # via TRIM
    assert statuses["logprobs_missing"] == "ABORTED"  # the reply's own problem, recorded by the edge's action
    for e in spec.edges:
        if e.dest in TERMINALS and e.reason is not None and not e.records and e.source != "TRIM":
            assert REASON_STATUS[e.reason] == e.dest
    assert "trim" not in statuses  # TRIM is entered by edges that record their reason: its own is never recorded
    assert "reply_unusable" not in statuses  # its action records the reply's problem instead
    assert {"environment_done", "environment_failed", "attempts_exhausted"} <= REASON_STATUS.keys()
    moved = [attrs.evolve(e, dest="FAILED") if e.guard_name == "environment_done" else e for e in spec.edges]
    assert attrs.evolve(spec, edges=tuple(moved)).reason_statuses()["environment_done"] == "FAILED"


# -- a new core state, in a copy of the tree -------------------------------------------------
# What adding a state takes, as docs/machine.md ("Adding a state") says: its definition (a State,
# its Trigger, its row in STATES), its edges (rows of the table), its step (a coroutine in the loop).
TOY_EDITS: dict[str, list[tuple[str, str]]] = {
    "engine/machine/states.py": [
        ('    ENVIRONMENT = "ENVIRONMENT"\n', '    ENVIRONMENT = "ENVIRONMENT"\n    VERIFY = "VERIFY"\n'),
        ('    ENV_FAILED = "environment_failed"\n', '    ENV_FAILED = "environment_failed"\n    VERIFIED = "verified"\n'),
        ('    StateDef(S.TRIM, ', '    StateDef(S.VERIFY,       "core",     "looks at the final answer once more", '
                                 'Step("verify", awaits=True)),\n    StateDef(S.TRIM, '),
    ],
    "engine/machine/table.py": [
        ("S.COMPLETED,    g.answered,", "S.VERIFY,       g.answered,"),
        ("        E(S.TRIM, ", "        E(S.VERIFY,       T.VERIFIED,           S.COMPLETED),\n        E(S.TRIM, "),
    ],
    "engine/loop/driver.py": [
        ("async def finished_unless_aborted(",
         '@step("verify")\nasync def step_verify(rt: Runtime, r: Rollout) -> str:\n'
         '    """Look at the final answer once more (it awaits, so a cancellation can land here)."""\n'
         "    await asyncio.sleep(0)\n    return Trigger.VERIFIED\n\n\n"
         "async def finished_unless_aborted("),
    ],
}

TOY_RUN = """
import asyncio, json, sys
import respx
import engine
from engine.machine.table import get_machine
from engine.loop.driver import drive, new_rollout
from engine.loop.runtime import Runtime
from engine.local.invariants import REASON_STATUS
from engine.trace.diagrams import render_diagrams
from tests.machine.test_machine import cfg
from tests.support.helpers import SAMPLING, URL, ScriptedServer, tok, turn

async def go():
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=ScriptedServer([turn("Answer: \\\\boxed{1}")]))
        async with Runtime.create(cfg(), tokenizer=tok()) as rt:
            r = new_rollout(rt, "What is 1?", dict(SAMPLING))
            await drive(rt, r)
            return r

r = asyncio.run(go())
spec = get_machine().spec
print(json.dumps({"engine": engine.__file__, "trace": r.record.trace, "state": r.state, "reason": r.record.reason,
                  "triples": sorted(spec.triples()), "awaiting": sorted(spec.awaiting),
                  "mermaid": render_diagrams(svg=False)["machine.mmd"].decode(), "checker": REASON_STATUS.get("verified")}))
"""


def _changed_files(a: Path, b: Path) -> list[str]:
    out: list[str] = []
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])

    def walk(c: filecmp.dircmp[str], prefix: str) -> None:
        out.extend(prefix + n for n in c.diff_files + c.left_only + c.right_only)
        for name, sub in c.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(cmp, "engine/")
    return sorted(out)


def test_a_new_core_state_is_three_files_and_builds_runs_draws_and_is_checked(tmp_path: Path) -> None:
    """VERIFY between an answer and COMPLETED: its definition, its edges, its step, and nothing else."""
    shutil.copytree(ROOT / "engine", tmp_path / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    diff: list[str] = []
    for rel, edits in TOY_EDITS.items():
        path = tmp_path / rel
        before = path.read_text(encoding="utf-8")
        after = before
        for anchor, replacement in edits:
            assert after.count(anchor) == 1, f"{rel}: the anchor {anchor!r} moved; update TOY_EDITS and docs/machine.md"
            after = after.replace(anchor, replacement)
        path.write_text(after, encoding="utf-8")
        diff += difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{rel}", f"b/{rel}", n=1)
    print("".join(diff))  # the whole change (pytest -s shows it)
    assert _changed_files(ROOT / "engine", tmp_path / "engine") == sorted(TOY_EDITS)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-c", TOY_RUN], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["engine"].startswith(str(tmp_path))
    # runs: the answer goes through VERIFY, whose step fired its trigger; the reason is its edge's
    assert [tuple(e) for e in got["trace"][-2:]] == [("GENERATE", "reply", "VERIFY"), ("VERIFY", "verified", "COMPLETED")]
    assert (got["state"], got["reason"]) == ("COMPLETED", "verified")
    # builds: with the fault edges every state gets (it awaits, so `cancelled` too), for edge coverage to demand
    triples = {tuple(t) for t in got["triples"]}
    assert {("VERIFY", "verified", "COMPLETED"), ("VERIFY", "crashed", "FAILED"), ("VERIFY", "cancelled", "ABORTED"),
            ("VERIFY", "invariant_violated", "ABORTED")} <= triples
    assert "VERIFY" in got["awaiting"]
    # draws, and the outside checker knows its reason
    assert "VERIFY --> COMPLETED : verified" in got["mermaid"] and "GENERATE --> VERIFY : reply [answered]" in got["mermaid"]
    assert got["checker"] == "COMPLETED"


def test_the_docs_name_the_files_a_new_state_takes() -> None:
    text = (ROOT / "docs" / "machine.md").read_text(encoding="utf-8")
    section = text.split("## Adding a state", 1)[1].split("\n## ", 1)[0]
    for rel in TOY_EDITS:
        assert f"`{rel}`" in section, rel
    assert "tests/machine/test_states.py" in section


def test_the_builtin_states_steps_are_checked_when_the_loop_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(STEPS, "generate")
    with pytest.raises(MachineDefinitionError, match="GENERATE runs the step 'generate'"):
        driver._check_builtin_steps()
    assert {d.step for d in STATES if d.step} <= {*STEPS, "generate"}
