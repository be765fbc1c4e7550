"""The tool runner's backstops: a tool that ignores its time limit, one that crashes, one that is cancelled."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from engine import tools
from engine.settings import EngineConfig
from engine.loop import tool_calls
from engine.loop.tool_calls import ToolRunner
from engine.profiles.base import ToolCall
from tests.conftest import run


class Hangs(tools.Tool):
    """Sleeps far past any limit and ignores `tools.call_timeout()`."""

    name = "hangs"
    description = "never answers"

    def __init__(self) -> None:
        self.cancelled = False
        self.started = asyncio.Event()

    async def execute(self, state: Any, seconds: float = 5.0) -> str:
        self.started.set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "done"


class Crashes(tools.Tool):
    name = "crashes"
    description = "raises"

    async def execute(self, state: Any) -> str:
        raise KeyError("boom")


def test_a_tool_past_its_limit_is_cut_by_the_engine_and_answered_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tool_calls, "GRACE_SECONDS", 0.1)
    runner = ToolRunner(EngineConfig(tool_timeout=0.1))
    tool = Hangs()
    started = time.perf_counter()
    result = run(runner.call(tool, None, ToolCall("hangs", {})))
    elapsed = time.perf_counter() - started
    # (without the engine's limit the tool would answer "done" after its 5 s sleep)
    assert (result.text, result.error) == ("Error: hangs timed out after 0.1 seconds", "timeout")
    assert tool.cancelled and 0.15 <= elapsed < 2.0  # the tool's own await was cancelled, at limit + grace


def test_a_tool_that_raises_is_the_models_error_not_ours() -> None:
    result = run(ToolRunner(EngineConfig()).call(Crashes(), None, ToolCall("crashes", {})))
    assert (result.text, result.error) == ("Error: crashes failed: KeyError: 'boom'", "crash")


def test_a_cancelled_call_is_cancelled_not_answered() -> None:
    tool = Hangs()

    async def cancel_soon() -> None:
        task = asyncio.ensure_future(ToolRunner(EngineConfig()).call(tool, None, ToolCall("hangs", {})))
        await tool.started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_soon())
    assert tool.cancelled
