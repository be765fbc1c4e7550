"""Running a harness: what `engine_agent` names, how each way of ending is told apart, and that a
command past its time is stopped with everything it started."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import pytest

from engine.agent.harness import HarnessSpec, run_harness

BASE = "http://127.0.0.1:9/s/key"


def run_spec(text: str, timeout: float = 30.0, prompt: Any = "the task") -> Any:
    return asyncio.run(run_harness(HarnessSpec.parse(text), base_url=BASE, api_key="key", sample=None, prompt=prompt,
                                   timeout=timeout))


def test_a_module_function_is_a_coroutine_and_anything_else_a_command_line():
    assert HarnessSpec.parse("my.agents:run") == HarnessSpec("python", "my.agents:run")
    assert HarnessSpec.parse("claude -p '{prompt}'").argv == ("claude", "-p", "{prompt}")
    assert HarnessSpec.parse("/usr/bin/env").kind == "command"
    for bad in ("", "  ", "say 'unclosed"):
        with pytest.raises(ValueError, match="engine_agent"):
            HarnessSpec.parse(bad)


def test_a_command_gets_its_session_in_the_environment_and_the_prompt_in_its_arguments():
    code = ("import os; print(os.environ['OPENAI_BASE_URL'], os.environ['ANTHROPIC_BASE_URL'], os.environ['OPENAI_API_KEY'],"
            " os.environ['ANTHROPIC_API_KEY'], os.environ['ENGINE_AGENT_PROMPT'])")
    outcome = run_spec(f"{sys.executable} -c \"{code}\" {{prompt}}", prompt=[{"role": "user", "content": "hi"}])
    assert outcome.reason == "harness_finished"
    assert outcome.output.split() == [BASE + "/v1", BASE, "key", "key", '[{"role":', '"user",', '"content":', '"hi"}]']


def test_a_command_that_fails_or_cannot_start_is_a_crash():
    failed = run_spec(f"{sys.executable} -c \"print('oops'); raise SystemExit(4)\"")
    assert (failed.reason, failed.output.strip()) == ("harness_crashed", "oops") and failed.detail.endswith("exit status 4: oops")
    raised = run_spec(f"{sys.executable} -c \"import no_such_sdk_here\"")
    assert raised.reason == "harness_crashed"
    assert raised.detail.endswith("exit status 1: ModuleNotFoundError: No module named 'no_such_sdk_here'")
    wrapped = run_spec(f"{sys.executable} -c \"print('RuntimeError: no price for the model'); print('see'); print('the docs');"
                       f" raise SystemExit(1)\"")
    assert wrapped.detail.endswith("exit status 1: RuntimeError: no price for the model")
    missing = run_spec("/no/such/harness --flag")
    assert missing.reason == "harness_crashed" and "cannot start" in missing.detail


def test_a_command_past_its_time_is_stopped_with_what_it_started(tmp_path: Any):
    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(600)")
    started = time.monotonic()
    outcome = run_spec(f"{sys.executable} -c \"{code}\"", timeout=1.5)
    assert outcome.reason == "harness_timed_out" and "started" in outcome.output
    assert time.monotonic() - started < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the harness's own child outlived it"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone
        return f.read().split(")")[-1].split()[0] != "Z"


async def returns(base_url: str, api_key: str, sample: Any) -> dict[str, Any]:
    return {"reward": 0.5, "seen": [base_url, api_key]}


async def raises(base_url: str, api_key: str, sample: Any) -> None:
    raise KeyError("missing")


async def sleeps(base_url: str, api_key: str, sample: Any) -> None:
    await asyncio.sleep(600)


def test_a_coroutine_s_result_failure_and_time_are_told_apart():
    done = run_spec(f"{__name__}:returns")
    assert (done.reason, done.result) == ("harness_finished", {"reward": 0.5, "seen": [BASE, "key"]})
    failed = run_spec(f"{__name__}:raises")
    assert failed.reason == "harness_crashed" and "KeyError: 'missing'" in failed.detail
    late = run_spec(f"{__name__}:sleeps", timeout=0.2)
    assert late.reason == "harness_timed_out"
    absent = run_spec(f"{__name__}:no_such_function")
    assert absent.reason == "harness_crashed" and "AttributeError" in absent.detail
