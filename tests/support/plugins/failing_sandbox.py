"""A code interpreter that fails every call and has no check: the failure shows only in the results.

That is what a broken sandbox looked like before tools had checks; the summary of such a run
must name the error and the run must exit non-zero.
"""

from __future__ import annotations

from typing import Any

import tools

TEXT = "Error: Failed to execute code: [Errno 13] Permission denied: '/tmp/venv/bin/python'"


class FailingSandbox(tools.Tool):
    """Replaces `code_interpreter`; every call answers the same sandbox error."""

    name = "code_interpreter"
    description = "A tool for executing Python code in a safe sandbox environment."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    async def execute(self, state: Any, **arguments: Any) -> tools.ToolResult:
        return tools.ToolResult(TEXT, error="sandbox")


tools.register(FailingSandbox(), replace=True)
