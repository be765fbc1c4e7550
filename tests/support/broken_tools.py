"""Code interpreters that cannot work, for the tests of failing loudly. Importing this registers nothing.

`DeadSandbox` says so in its `check()`, as the real sandbox's probe will; `FailingSandbox` has no
check and fails every call, which is how a broken sandbox looked before tools had checks.
The modules in tests/support/plugins register them in a subprocess (`run --tool-module ...`).
"""

from __future__ import annotations

from typing import Any

from engine import tools

REASON = "the sandbox probe program did not run: cannot create a user namespace (test stand-in)"
TEXT = "Error: Failed to execute code: [Errno 13] Permission denied: '/tmp/venv/bin/python'"
_SCHEMA = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}


class DeadSandbox(tools.Tool):
    """Stands in for `code_interpreter`; every call would fail, and `check()` says why before any does."""

    name = "code_interpreter"
    description = "A tool for executing Python code in a safe sandbox environment."
    parameters = _SCHEMA

    async def check(self) -> str | None:
        return REASON

    async def execute(self, state: Any, **arguments: Any) -> tools.ToolResult:
        return tools.ToolResult(f"Error: Failed to execute code: {REASON}", error="sandbox")


class FailingSandbox(tools.Tool):
    """Stands in for `code_interpreter`; every call answers the same sandbox error."""

    name = "code_interpreter"
    description = "A tool for executing Python code in a safe sandbox environment."
    parameters = _SCHEMA

    async def execute(self, state: Any, **arguments: Any) -> tools.ToolResult:
        return tools.ToolResult(TEXT, error="sandbox")
