"""Running tool calls: one concurrency limit, a time limit per call, every tool error built here.

Whatever goes wrong with a call (it could not be parsed, names an unknown tool, exceeds the
turn's or the trajectory's budget, has bad arguments, times out, crashes the tool, or its
output is too long) becomes an error observation for the model, written by this module and
counted by its kind. The call's time limit travels with the call (`tools.call_timeout()`
inside the tool), so runtimes with different settings never overwrite each other's.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from engine import tools
from engine.aio import Deadlines, Gate
from engine.settings import EngineConfig
from engine.profiles.base import CallResult, ToolCall

TRUNCATION_MARKER = "\n...[tool output truncated: {n} characters dropped]"
GRACE_SECONDS = 5.0  # tools enforce their own timeout; this is the engine's backstop
REFUSALS = {  # calls answered without running, by kind
    "unknown_tool": "Error: unknown tool {name!r}",
    "surplus_call": "Error: too many tool calls in this turn; this one was not run",
}


def _reward(value: object) -> float | None:
    """A tool's reward if it is a finite number; anything else is dropped (a tool bug is not a crash)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


class ToolRunner:
    """Runs calls of every sample of one event loop under one shared concurrency limit."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.slots = Gate(cfg.tool_concurrency)
        self.timeout = cfg.tool_timeout
        self.max_chars = cfg.tool_output_chars
        self.backstops = Deadlines()  # the engine's limit per call: reached only when a tool ignores its own

    def refuse(self, call: ToolCall, kind: str) -> CallResult:
        """The answer to a call the turn's plan did not run: unparsable, unknown, or over budget."""
        template = REFUSALS.get(kind)
        text = template.format(name=call.name) if template else f"Error: {call.detail or kind}"
        return CallResult(call, text, kind)

    async def call(self, tool: tools.Tool, session: Any, call: ToolCall) -> CallResult:
        """One call; never raises except on cancellation. The slot is taken once per call."""
        with tools.registry.call_stats() as stats:  # what the tool counts (`tools.count`): retries, waiting
            text, error, reward = await self._execute(tool, session, call)
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + TRUNCATION_MARKER.format(n=len(text) - self.max_chars)
            error = error or "output_truncated"
        return CallResult(call, text, error, stats, reward)

    async def _execute(self, tool: tools.Tool, session: Any, call: ToolCall) -> tuple[str, str | None, float | None]:
        try:
            schema = tool.schema()["function"]["parameters"]
            arguments = tools.registry.check_arguments(schema, call.arguments)
            await self.slots.acquire()
            try:
                with tools.registry.call_timeout_set(self.timeout):
                    out = await self.backstops.within(self.timeout + GRACE_SECONDS, tool.execute(session, **arguments))
            finally:
                self.slots.release()
        except tools.ToolError as exc:
            return f"Error: {exc.message}", exc.kind, None
        except tools.ToolUnavailable:
            raise  # not the model's error: the driver ends the sample
        except asyncio.TimeoutError:
            return f"Error: {call.name} timed out after {self.timeout:g} seconds", "timeout", None
        except Exception as exc:  # a tool's bug is the model's error observation, not our crash
            return f"Error: {call.name} failed: {type(exc).__name__}: {exc}", "crash", None
        if isinstance(out, tools.ToolResult):
            return out.text, out.error, _reward(out.reward)
        return str(out), None, None
