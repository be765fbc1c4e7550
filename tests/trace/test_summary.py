"""The batch summary: error texts, warnings, and when a batch as a whole failed."""

from __future__ import annotations

import math
from typing import Any

from engine.trace.summary import batch_failure, format_summary, summarize, warnings
from tests.support.helpers import tok


def row(status: str, *, calls: int = 0, errors: dict[str, int] | None = None, turns: list[dict[str, Any]] | None = None,
        obs: str | None = None, engine_error: str | None = None) -> dict[str, Any]:
    """A sample dict as `run` writes it; `obs` becomes the response's one observation segment."""
    fsm: dict[str, Any] = {"termination_reason": "x", "tool_stats": {"calls": calls, "errors": errors or {}},
                           "turns": turns or [], "trace": [["RESET", "start", "BUDGET_CHECK"]]}
    sample: dict[str, Any] = {"status": status, "metadata": {"fsm": fsm}, "tokens": [], "response_length": 0}
    if obs is not None:
        ids = list(tok()(obs, add_special_tokens=False)["input_ids"])
        sample.update(tokens=[1, 2, *ids], response_length=len(ids))
        fsm["segments"] = [["observation", 0, len(ids), None]]
    if engine_error:
        fsm["engine_error"] = engine_error
    return sample


def decode(ids: list[int]) -> str:
    return tok().decode(ids)


def test_a_batch_whose_every_tool_call_failed_is_a_failure_named_by_its_error() -> None:
    obs = "\n\n<interpreter>\nError: Failed to execute code: sandbox down\n</interpreter>\n\n"
    rows = [row("completed", calls=1, errors={"sandbox": 1}, obs=obs, turns=[{"tools": ["code_interpreter"]}])
            for _ in range(3)]
    s = summarize(rows, wall_seconds=1.0, decode=decode, retries=2)
    assert batch_failure(s) == "every tool call failed (3 of 3: sandbox 3)"
    text = format_summary(s)
    assert "      3  Error: Failed to execute code: sandbox down" in text and "requests retried: 2" in text
    assert warnings(s) == ["3 of 3 tool calls (code_interpreter) failed with 'sandbox': Error: Failed to execute code: sandbox down"]


def test_per_tool_warnings_when_turns_record_each_calls_error() -> None:
    turns = [{"tools": ["code_interpreter", "word_count"], "errors": ["timeout", None]}]
    rows = [row("completed", calls=2, errors={"timeout": 1}, turns=turns) for _ in range(2)]
    s = summarize(rows)
    assert warnings(s) == ["2 of 2 calls of code_interpreter failed with 'timeout'"]
    assert batch_failure(s) is None  # word_count worked


def test_every_sample_failed_and_the_model_s_own_mistakes_and_truncation_are_not_tool_failures() -> None:
    s = summarize([row("aborted", engine_error="unavailable: ConnectError"), row("failed")])
    assert batch_failure(s) == "every sample failed (ABORTED 1, FAILED 1)"
    assert "most common engine errors" in format_summary(s) and "unavailable: ConnectError" in format_summary(s)
    ok = summarize([row("completed", calls=1, errors={"malformed_call": 1, "output_truncated": 1})])
    assert batch_failure(ok) is None and warnings(ok) == []
    assert "wall: not measured" in format_summary(summarize([], wall_seconds=math.nan))


def test_calls_to_a_tool_not_offered_count_as_calls_that_failed() -> None:
    """The demo run with only `calculator` offered: every call names code_interpreter and is answered
    'unknown tool' without running. They are calls, they failed, most the same way: warned, exit 1."""
    turns = [{"tools": ["code_interpreter"], "errors": ["unknown_tool"]}]
    rows = [row("completed", calls=0, errors={"unknown_tool": 1}, turns=turns) for _ in range(19)]
    s = summarize(rows)
    assert s["tool_calls"]["sum"] == 19
    assert batch_failure(s) == "every tool call failed (19 of 19: unknown_tool 19)"
    assert warnings(s) == ["19 of 19 calls of code_interpreter failed with 'unknown_tool': the tool is not offered "
                           "(offer it with --tools, or register it with --tool-module)"]


def test_mostly_malformed_calls_warn_but_one_in_twenty_does_not() -> None:
    bad = [{"tools": ["code_interpreter"], "errors": ["malformed_call"]}]
    good = [{"tools": ["code_interpreter"], "errors": [None]}]
    mostly = summarize([row("completed", errors={"malformed_call": 1}, turns=bad) for _ in range(3)]
                       + [row("completed", calls=1, turns=good)])
    assert warnings(mostly) == ["3 of 4 calls of code_interpreter failed with 'malformed_call'"]
    assert batch_failure(mostly) is None
    rare = summarize([row("completed", errors={"malformed_call": 1}, turns=bad)]
                     + [row("completed", calls=1, turns=good) for _ in range(19)])
    assert warnings(rare) == [] and batch_failure(rare) is None
