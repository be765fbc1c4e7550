"""A code interpreter whose sandbox cannot start: its check says so, as the real one's probe will."""

from __future__ import annotations

from typing import Any

import tools

REASON = "the sandbox probe program did not run: cannot create a user namespace (test stand-in)"


class DeadSandbox(tools.Tool):
    """Replaces `code_interpreter`; every call would fail, and `check()` says why before any does."""

    name = "code_interpreter"
    description = "A tool for executing Python code in a safe sandbox environment."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    async def check(self) -> str | None:
        return REASON

    async def execute(self, state: Any, **arguments: Any) -> tools.ToolResult:
        return tools.ToolResult(f"Error: Failed to execute code: {REASON}", error="sandbox")


tools.register(DeadSandbox(), replace=True)
