"""The long-rollout demo end to end (`run --demo long`): a 100-turn tool loop under a 4k context on
the embedded server, the real sandbox running every call, compacts k times and comes back as k+1
samples, each segment whole (checked from the outside by engine.local.invariants), and `trace`
draws each segment with its header and the compaction edge that closed it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from engine.cli import build_parser
from engine.local.demos import DEMOS, demo_file
from engine.local.invariants import sample_violations
from engine.run import main_run
from engine.settings.core import COMPACTION_PROMPT
from engine.trace.diagrams import main_trace
from tests.support.helpers import tok

pytestmark = pytest.mark.slow

CONTEXT = 4096
GENERATION_PROMPT = "<|im_start|>assistant\n"


def script() -> tuple[list[str], str]:
    """The demo's scripted model turns and its summary, from the shipped replay."""
    entries = [json.loads(line) for line in open(demo_file(DEMOS["long"][1]), encoding="utf-8")]
    [summary] = next(e["turns"] for e in entries if e["prompt"] == COMPACTION_PROMPT)
    return next(e["turns"] for e in entries if e["prompt"] != COMPACTION_PROMPT), summary


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("long") / "long.jsonl"
    ns = build_parser().parse_args(["run", "--demo", "long", "--no-progress", "--output", str(out)])
    assert main_run(ns) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_100_turn_rollout_under_a_4k_context_compacts_k_times_into_k_plus_1_samples(rows: list[dict[str, Any]]) -> None:
    turns, summary = script()
    assert len(turns) == 100
    k = len(rows) - 1
    assert k >= 2, "the demo compacts more than once: a middle segment both starts and ends at COMPACT"
    fsm = [r["metadata"]["fsm"] for r in rows]
    assert [f["segment"] for f in fsm] == [{"index": i, "count": k + 1, "ended_by": "summarized" if i < k else None}
                                           for i in range(k + 1)]
    assert all(f["breaks"] == ["summarized"] * k for f in fsm)
    assert {r["index"] for r in rows} == {0} and {r["rollout_id"] for r in rows} == {0}
    assert [r["status"] for r in rows] == ["completed"] * (k + 1)
    assert [f["termination_reason"] for f in fsm] == ["summarized"] * k + ["answered"]
    # every model turn of the script was played once, in order, across the segments, and one summary per compaction
    logged = [t for f in fsm for t in f["turns"]]
    assert [t["turn"] for t in logged if "compaction" not in t] == list(range(1, 101))
    assert [t["compaction"] for t in logged if "compaction" in t] == ["summarize"] * k
    assert fsm[0]["tool_stats"]["calls"] == 99 and not fsm[0]["tool_stats"]["errors"]
    assert [r["reward"]["score"] for r in rows] == [1.0] * (k + 1)  # the rollout's reward, each segment's share


def test_every_segment_is_whole_and_starts_from_the_prompt_and_the_summary(rows: list[dict[str, Any]]) -> None:
    decode = tok().decode
    turns, summary = script()
    first_prompt = rows[0]["tokens"][: len(rows[0]["tokens"]) - rows[0]["response_length"]]
    task = decode(first_prompt)
    assert task.endswith(GENERATION_PROMPT) and "Print the squares of 1 to 99" in task
    for n, row in enumerate(rows):
        prompt = row["tokens"][: len(row["tokens"]) - row["response_length"]]
        assert sample_violations(row, prompt_ids=prompt, budget=CONTEXT, decode=decode) == [], n
        response = decode(row["tokens"][len(prompt):])
        # the trained tokens are the script's turns, each played as written
        trained = [decode([t for t, m in zip(row["tokens"][len(prompt) + a: len(prompt) + b], row["loss_mask"][a:b]) if m])
                   for a, b in (t["span"] for t in row["metadata"]["fsm"]["turns"])]
        assert all(text.removesuffix("<|im_end|>") in (*turns, summary) for text in trained), n
        if n < len(rows) - 1:
            # COMPACT asked in the segment's own context, and the policy's summary ends it
            assert response.rstrip().endswith(summary + "<|im_end|>") and COMPACTION_PROMPT in response
        if n:
            text = decode(prompt)
            # the compacted prompt: the original prompt, the summary, the latest exchanges, rendered by the template
            assert text.startswith(task.removesuffix(GENERATION_PROMPT)) and text.endswith(GENERATION_PROMPT)
            assert summary in text and COMPACTION_PROMPT not in text
            before = [t for t in rows[n - 1]["metadata"]["fsm"]["turns"] if "compaction" not in t][-1]["turn"]
            assert turns[before - 1].split("\n")[0] in text  # the last exchange before the compaction is kept
            assert turns[0].split("\n")[0] not in text
            assert len(prompt) < len(rows[n - 1]["tokens"])


def test_trace_draws_each_segment_and_the_compaction_that_closed_it(rows: list[dict[str, Any]], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    count = len(rows)
    for n in range(count):
        assert main_trace(argparse.Namespace(file=str(path), position=n, out=None)) == 0
        drawn = capsys.readouterr().out
        head = drawn.split("\n\n", 1)[0]
        assert "turns" in head and "the rollout: tool calls 99" in head
        ended = ", ended by summarized" if n < count - 1 else ""
        assert f"segment {n + 1} of {count} of a rollout{ended} (breaks: {', '.join(['summarized'] * (count - 1))})" in head
        compacts = "BUDGET_CHECK -> COMPACT" in drawn and "COMPACT -> BUDGET_CHECK" in drawn
        assert compacts == (n < count - 1), n
        if n < count - 1:
            assert "compacted [summarized]" in drawn and "BUDGET_CHECK --> COMPACT : check [compaction_due] ×1" in drawn
            assert "COMPACT --> BUDGET_CHECK : compacted [summarized] ×1" in drawn
        else:
            assert "GENERATE --> COMPLETED : reply [answered] ×1" in drawn
