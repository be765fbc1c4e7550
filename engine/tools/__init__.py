"""Tools the model can call: the tool author's API. Importing this package registers the built-ins.

Write a tool in one file: subclass `Tool` (or decorate an async function with `@tool`),
`register` it at import, and name the module in `engine_tool_modules`. It gets a state of its
own in the rollout machine, the diagrams and the edge-coverage test. A tool with settings of its
own declares them with `engine.settings` and names the class as its `Settings`: the engine reads
them with its own and hands them to the tool's `setup`. `engine.tools.registry` holds
the rest (argument checking, test helpers); `engine.sandbox` is the isolation the built-ins
run model-written code in, and no tool author needs to open it.

Built-ins: `code_interpreter` (Python in an isolated subprocess, as slime's retool example
names it) and `python_session` (a stateful Python session per trajectory: the worked example
of writing your own tool).
"""

from engine.tools.registry import Tool, ToolError, ToolResult, ToolUnavailable, call_timeout, count, get, names, register, tool

from engine.tools import code_interpreter, python_session  # noqa: E402,F401,I001  (registers the built-ins)

__all__ = ["Tool", "ToolError", "ToolResult", "ToolUnavailable", "call_timeout", "count", "get", "names", "register", "tool"]
