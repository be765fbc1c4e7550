"""A tool that cannot work ends the sample FAILED, untrained, with one clear error logged.

When the sandbox cannot run code, answering the model with "Error: Failed to execute code"
would teach it that its code is wrong. Instead the sample takes `TOOL_<NAME> --tool_unavailable-->
FAILED`: slime computes its reward but trains none of its tokens (`remove_sample`), the
attempt is not re-run (the tool will not come back by itself), and the error is logged once.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import respx

from engine import tools
from engine import slime
from engine.local.sample import Sample
from tests.conftest import run
from tests.slime.slime_rules import generate_and_rm, train_view
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, turn

REASON = "the sandbox cannot run code: planted by the test"  # + the tool's name, so each case logs anew


class DeadInterpreter(tools.Tool):
    """A built-in Python tool on a host whose sandbox cannot run code."""

    description = "A tool for executing Python code in a safe sandbox environment."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]
        self.calls = 0

    async def execute(self, session: Any, **arguments: Any) -> str:
        self.calls += 1
        raise tools.ToolUnavailable(f"{REASON} ({self.name})")


@pytest.mark.parametrize("name", ["code_interpreter", "python_session"])
def test_a_tool_that_cannot_work_ends_the_sample_failed_and_untrained(name: str, caplog: pytest.LogCaptureFixture) -> None:
    dead = DeadInterpreter(name)
    call = f"<tool_call>{json.dumps({'name': name, 'arguments': {'code': 'print(6 * 7)'}})}</tool_call>"
    samples = [Sample(prompt="What is 6*7?", label="42") for _ in range(2)]
    server = ScriptedServer([turn(call), turn(call)])
    args = make_args(engine_tools="code_interpreter,python_session")
    with tools.registry.registered(dead), respx.mock(assert_all_called=False) as mock, caplog.at_level(logging.ERROR):
        mock.post(URL + "/generate").mock(side_effect=server)
        for sample in samples:
            run(slime.generate(args, sample, dict(SAMPLING)))
    for sample in samples:
        fsm = sample.metadata["fsm"]
        assert (sample.status.name, fsm["termination_reason"]) == ("FAILED", "tool_unavailable")
        assert fsm["trace"][-1] == (f"TOOL_{name.upper()}", "tool_unavailable", "FAILED")
        assert REASON in fsm["engine_error"] and "attempts" not in fsm  # not re-run
        assert sample.remove_sample and sample.response_length > 0  # the model's turn is there, not trained
        view = train_view(generate_and_rm(args, sample))
        assert not any(view["loss_mask"])
    assert dead.calls == 2 and len(server.requests) == 2  # one request per sample, nothing after the dead call
    errors = [rec.getMessage() for rec in caplog.records if REASON in rec.getMessage()]
    assert len(errors) == 1, errors  # one clear error, not one per sample
