"""Running tool calls: one concurrency limit, a time limit, errors as observations."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import tools
from engine.config import EngineConfig
from engine.profiles.base import CallResult, ToolCall

TRUNCATION_MARKER = "\n...[tool output truncated: {n} characters dropped]"
GRACE_SECONDS = 5.0  # tools enforce their own timeout; this is the engine's backstop


class ToolRunner:
    """Runs calls of every sample of one event loop under one shared concurrency limit."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.slots = asyncio.Semaphore(cfg.tool_concurrency)
        self.timeout = cfg.tool_timeout
        self.max_chars = cfg.tool_output_chars

    async def call(self, tool: tools.Tool, state: Any, call: ToolCall) -> CallResult:
        """One call; never raises except on cancellation. The slot is taken once per call."""
        started = time.perf_counter()
        with tools.call_stats() as stats:
            text, error = await self._execute(tool, state, call)
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + TRUNCATION_MARKER.format(n=len(text) - self.max_chars)
            error = error or "output_truncated"
        return CallResult(call, text, error, time.perf_counter() - started, stats)

    async def _execute(self, tool: tools.Tool, state: Any, call: ToolCall) -> tuple[str, str | None]:
        try:
            schema = tool.schema()["function"]["parameters"]
            arguments = tools.check_arguments(schema, call.arguments)
            async with self.slots:
                out = await asyncio.wait_for(tool.execute(state, **arguments), self.timeout + GRACE_SECONDS)
        except tools.ToolError as exc:
            return f"Error: {exc.message}", exc.kind
        except asyncio.TimeoutError:
            return f"Error: {call.name} timed out after {self.timeout:g} seconds", "timeout"
        except Exception as exc:  # a tool's bug is the model's error observation, not our crash
            return f"Error: {call.name} failed: {type(exc).__name__}: {exc}", "crash"
        if isinstance(out, tools.ToolResult):
            return out.text, out.error
        return str(out), None
