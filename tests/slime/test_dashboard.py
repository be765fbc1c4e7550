"""The engine's figures on slime's dashboard: `engine.slime.log_rollout` through slime's
`log_rollout_data` (its contract in tests/slime/slime_rules.py; slime's own module when installed),
with the logger stubbed."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

import httpx
import pytest
import respx

from engine import slime
from engine.local.sample import Sample
from tests.conftest import run
from tests.slime.slime_rules import RecordingLogger, log_rollout_data
from tests.support.helpers import IM_END, SAMPLING, URL, FakeInterpreter, ScriptedServer, encode, make_args, reply_body

CODE = "<code>\nprint(1)\n</code>"
ANSWER = "Answer: \\boxed{42}"
UNKNOWN = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'


def reply(text: str) -> httpx.Response:
    return httpx.Response(200, json=reply_body(encode(text) + [IM_END]))


def rolled_out(fake: FakeInterpreter) -> list[Sample]:
    """Four samples the engine really rolled out: a tool call then an answer; a failing tool call;
    an answer at once; and a prompt it cannot use (FAILED, removed)."""
    ok = fake.output

    def boom(code: str) -> str:
        raise RuntimeError("boom")

    scripts = [[reply(CODE), reply(ANSWER)], [reply(CODE), reply(ANSWER)], [reply(ANSWER)]]
    samples = []
    for i, script in enumerate(scripts):
        sample = Sample(prompt="Q", label="42", index=i, group_index=0)
        fake.output = boom if i == 1 else ok
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=ScriptedServer(script))
            run(slime.generate(make_args(), sample, dict(SAMPLING)))
        samples.append(sample)
    bad = Sample(prompt=None, index=3, group_index=0)  # type: ignore[arg-type]
    run(slime.generate(make_args(), bad, dict(SAMPLING)))
    samples.append(bad)
    for s in samples:
        s.reward = run(slime.reward_func(make_args(), s))
    return samples


def args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(custom_rollout_log_function_path="engine.slime.log_rollout",
                              load_debug_rollout_data=None, **kw)


def test_slime_logs_its_own_figures_and_the_engine_s_in_one_call(fake_interpreter: FakeInterpreter) -> None:
    samples = rolled_out(fake_interpreter)
    logger = RecordingLogger()
    log_rollout_data(7, args(), samples, {"rollout/extra": 1.5}, 12.0, load_function=_load, logging_utils=logger)
    assert len(logger.calls) == 1
    logged, step_key = logger.calls[0]
    assert step_key == "rollout/step" and logged["rollout/step"] == 7
    assert logged["rollout/extra"] == 1.5 and logged["perf/rollout_time"] == 12.0  # slime's own, still there
    assert "rollout/response_len/mean" in logged
    engine = {k: v for k, v in logged.items() if k.startswith("engine/")}
    assert engine["engine/samples"] == 4
    assert engine["engine/status/COMPLETED"] == 3 and engine["engine/status/FAILED"] == 1
    assert engine["engine/termination_reason/answered"] == 3
    assert engine["engine/termination_reason/bad_sample_input"] == 1
    assert engine["engine/removed"] == 1 and engine["engine/trimmed"] == 0
    assert engine["engine/turns/max"] == 2 and engine["engine/attempts/mean"] == 1
    assert engine["engine/tool/code_interpreter/calls"] == 2
    assert engine["engine/tool/code_interpreter/error_rate"] == 0.5
    assert engine["engine/tool_calls/mean"] == pytest.approx(2 / 4)
    assert 0 < engine["engine/tool_time_share"] < 1


def test_a_call_to_a_tool_not_offered_counts_against_that_tool(fake_interpreter: FakeInterpreter) -> None:
    sample = Sample(prompt="Q", label="42")
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=ScriptedServer([reply(UNKNOWN), reply(ANSWER)]))
        run(slime.generate(make_args(engine_profile="chat"), sample, dict(SAMPLING)))
    figures = slime.dashboard.engine_metrics([sample])
    assert figures["engine/tool/calculator/calls"] == 1 and figures["engine/tool/calculator/error_rate"] == 1.0


def test_without_a_dict_to_add_to_the_figures_go_through_slime_s_logger(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        logging_utils = importlib.import_module("slime.observability.logging_utils")
        metric_utils = importlib.import_module("slime.observability.metric_utils")
    except ImportError:
        pytest.skip("slime is not installed: its logger is what this path calls")
    logger = RecordingLogger()
    monkeypatch.setattr(logging_utils, "log", logger.log)
    monkeypatch.setattr(metric_utils, "compute_rollout_step", lambda a, rid: rid)
    assert slime.log_rollout(3, args(), [Sample(prompt="Q")], None, 1.0) is False
    assert logger.calls and logger.calls[0][0]["rollout/step"] == 3


def test_with_slime_installed_its_own_log_rollout_data_carries_the_engine_s_figures(
        monkeypatch: pytest.MonkeyPatch, fake_interpreter: FakeInterpreter) -> None:
    try:
        rollout_metrics = importlib.import_module("slime.observability.rollout_metrics")
    except ImportError:
        pytest.skip("slime is not installed; its contract is followed in tests/slime/slime_rules.py")
    logger = RecordingLogger()
    monkeypatch.setattr(rollout_metrics.logging_utils, "log", logger.log)
    monkeypatch.setattr(rollout_metrics, "compute_metrics_from_samples", lambda a, s: {"own": 1.0})
    monkeypatch.setattr(rollout_metrics, "compute_perf_metrics_from_samples", lambda a, s, t: {"rollout_time": t})
    monkeypatch.setattr(rollout_metrics, "compute_rollout_step", lambda a, rid: rid)
    rollout_metrics.log_rollout_data(5, args(), rolled_out(fake_interpreter), {}, 2.0)
    logged = logger.calls[0][0]
    assert logged["rollout/own"] == 1.0 and logged["engine/samples"] == 4


def test_bad_samples_never_raise_into_slime() -> None:
    class Weird:
        metadata = {"fsm": {"turns": [{"tools": "not a list"}, 3], "attempts": "x", "tool_time": "slow"}}
        status = "odd"

    extra: dict[str, float] = {}
    assert slime.log_rollout(0, args(), [Weird(), object()], extra, 1.0) is False
    assert extra["engine/samples"] == 2 and extra["engine/termination_reason/unknown"] == 2


def _load(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)
