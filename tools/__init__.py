"""Tools the model can call, registered by name. Importing this package registers the built-ins.

Built-ins: `code_interpreter` (Python in an isolated subprocess, as slime's retool
example names it) and `python_session` (a stateful Python session per trajectory, the
example of writing your own tool). See tools/registry.py for the protocol.
"""

from tools.registry import (
    Tool, ToolError, ToolResult, call_stats, check_arguments, count, get, names, register, registered, tool, unregister,
)
from tools import code_interpreter, python_session  # noqa: E402,F401  (registers the built-ins)

__all__ = [
    "Tool", "ToolError", "ToolResult", "call_stats", "check_arguments", "count", "get", "names", "register", "registered",
    "tool", "unregister",
]
