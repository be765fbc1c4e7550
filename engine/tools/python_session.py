"""`python_session`: a stateful Python tool, and the example of how to write your own tool.

A tool is a `Tool` subclass with a `name`, a `description` and a JSON schema of its
`parameters` (all three shown to the model), and an async `execute`. Return a string or a
`ToolResult(text, error=kind)`; raise `ToolError(kind, message)` for a bad call. A tool that
keeps state per trajectory overrides `create` (called before the trajectory's first call
of the tool) and `release` (called once when the trajectory ends). `register` it at import
time and list the module in the engine's `tool_modules`.

Sandbox runs are one-shot, so this session replays: each call runs every earlier cell that
succeeded, with its output suppressed, then the new cell, in one fresh sandbox. Variables,
functions and imports carry over; side effects repeat and randomness is re-drawn (seed
it); a call costs the time of the whole history, and the timeout covers all of it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, ClassVar

import attrs

from engine.tools.code_interpreter import current_limits, format_result, require_sandbox, run_sandboxed, sandbox_check
from engine.tools.registry import Tool, ToolError, ToolResult, call_timeout, register
from engine.sandbox import backend
from engine.sandbox.runner import SandboxLimits

# Runs in the sandbox; reads the cells as JSON on stdin, so no code is pasted into code.
_REPLAY = r"""
import contextlib, io, json, linecache, sys, traceback

cells = json.load(sys.stdin)
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
for number, source in enumerate(cells, 1):
    name = f"<cell {number}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # lines in tracebacks
    replay = number < len(cells)
    quiet = contextlib.ExitStack()
    if replay:
        quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
        quiet.enter_context(contextlib.redirect_stderr(io.StringIO()))
    try:
        with quiet:
            exec(compile(source, name, "exec"), namespace)
    except Exception as e:
        tb = e.__traceback__
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell"):
            tb = tb.tb_next  # show the cell's frames, not this wrapper's
        if replay:
            print(f"(an earlier cell failed when replayed: {name})", file=sys.stderr)
        traceback.print_exception(type(e), e, tb)
        sys.exit(1)
"""


@attrs.define
class Session:
    """One trajectory's state: the cells that ran successfully, in order."""

    cells: list[str] = attrs.Factory(list)
    lock: asyncio.Lock = attrs.Factory(asyncio.Lock)  # calls of one trajectory take turns
    key: str = attrs.Factory(lambda: uuid.uuid4().hex)  # keeps its calls on one sandbox worker (Ray)


class PythonSession(Tool):
    """Python whose variables persist across the calls of one trajectory."""

    name: ClassVar[str] = "python_session"
    description: ClassVar[str] = (
        "Execute Python code in a persistent session: variables, functions and imports "
        "from earlier successful calls remain defined. Print what you want to see."
    )
    parameters: ClassVar[dict[str, Any] | None] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python code to execute"}},
        "required": ["code"],
    }

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits  # None: follow code_interpreter's limits (the engine configures those)

    async def create(self) -> Session:
        return Session()

    async def release(self, state: Session) -> None:
        state.cells.clear()  # nothing runs between calls, so there is no process to stop
        backend.forget(state.key)

    async def check(self) -> str | None:
        """None when the sandbox can run code here, else why not (its probe's reason)."""
        return await sandbox_check()

    async def execute(self, state: Session, **arguments: Any) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("bad_arguments", "Error: No code provided")
        await require_sandbox()
        base = self.limits or current_limits()
        limits = attrs.evolve(base, timeout_s=call_timeout(base.timeout_s))
        async with state.lock:
            cells = [*state.cells, code]
            result = await run_sandboxed(_REPLAY, limits, stdin=json.dumps(cells).encode(), session_key=state.key)
            if result.returncode == 0 and not result.timed_out:
                state.cells.append(code)
        return format_result(result, limits.timeout_s)


register(PythonSession())
