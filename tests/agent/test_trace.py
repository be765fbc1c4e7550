"""`trace` and `flow` on an agent's segments: the break is drawn as the edge it took, each segment's
path is its own, and a batch of segments counts every edge of the machine's one path once."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine.local.sample import Sample
from engine.slime.sample_io import write_segments
from engine.trace.diagrams import main_flow, main_trace
from engine.trace.paths import timeline
from tests.agent.test_sessions import finish, keyed, with_sessions
from tests.support.agents import tool_task


@pytest.fixture(scope="module")
def segments() -> list[Sample]:
    async def body(sessions: Any, rt: Any, model: Any) -> list[Sample]:
        key = keyed(sessions)
        await tool_task(sessions, key, variant="compact")
        r = await finish(sessions, key)
        return write_segments(Sample(index=5, prompt="Add."), r, rt.profile.decode, requeued=False)

    samples, _ = with_sessions(body)
    return samples


def rows(samples: list[Sample]) -> list[dict[str, Any]]:
    out = []
    for s in samples:
        row = dataclasses.asdict(s)
        row["status"] = s.status.value
        out.append(row)
    return out


def test_trace_draws_the_break_that_closed_a_segment(segments: list[Sample], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(segments)))
    assert main_trace(argparse.Namespace(file=str(path), position=0, out=None)) == 0
    first = capsys.readouterr().out
    assert "segment 1 of 2 of a rollout, ended by history_compacted" in first
    assert "segment break: history_compacted" in first
    assert "harness_call [history_compacted] ×1" in first and "HARNESS --> BUDGET_CHECK" in first
    assert main_trace(argparse.Namespace(file=str(path), position=1, out=None)) == 0
    second = capsys.readouterr().out
    assert "segment 2 of 2" in second and "termination reason harness_finished" in second
    assert "harness_end [harness_finished] ×1" in second
    first_row = timeline(rows(segments)[1]).split("\n\n")[1].splitlines()[1]
    assert re.match(r"\s*1\s+BUDGET_CHECK -> GENERATE", first_row)  # it begins where the break led


def test_flow_counts_each_edge_of_the_rollout_once(segments: list[Sample], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(segments)))
    out = tmp_path / "flow.mmd"
    assert main_flow(argparse.Namespace(file=str(path), out=str(out))) == 0
    table = capsys.readouterr().out
    traces = [tuple(map(tuple, s.metadata["fsm"]["trace"])) for s in segments]
    whole = [edge for t in traces for edge in t]
    assert all(a[2] == b[0] for a, b in zip(whole, whole[1:]))  # the segments' paths join into one
    replies = Counter(whole)[("GENERATE", "reply", "HARNESS")]
    assert re.search(rf"^GENERATE -> HARNESS\s+reply \[harness_answers\]\s+2\s+{replies}$", table, re.M)
    assert re.search(r"^HARNESS -> BUDGET_CHECK\s+harness_call \[history_compacted\]\s+1\s+1$", table, re.M)
    assert "BUDGET_CHECK : 1 sample ended by a break here" in out.read_text()
    # the text says so too: a segment a break closed did not end in a terminal state called BUDGET_CHECK
    assert re.search(r"^BUDGET_CHECK \(a break\)\s+1$", table, re.M) and not re.search(r"^BUDGET_CHECK\s+1$", table, re.M)
    assert re.search(r"^history_compacted\s+BUDGET_CHECK \(a break\)\s+1$", table, re.M)
    assert "COMPLETED : 1 sample ended here" in out.read_text()
