"""`code_interpreter`: run model-written Python in the sandbox, answer in slime's retool format.

slime's retool sandbox wraps the code in a try/except in the child and prints its own text.
We run the code as a plain file instead and build the same text from stdout, stderr and the
exit status, so no wrapper code sits between the model's code and the interpreter:

* exit 0: `"Output:\\n{stdout}"`, then `"\\nErrors:\\n{stderr}"` if stderr is non-empty, the
  whole stripped (retool prints it and strips the captured line); empty output gives "".
* an uncaught exception (exit 1, a Python traceback on stderr): `"Error: {e}\\nTraceback:\\n{tb}"`,
  `e` being the exception's message and `tb` the traceback. As in retool, stdout is dropped.
* any other nonzero exit (SyntaxError, sys.exit(n), a signal):
  `"Error: Process exited with code {rc}\\n{stderr}"`; a run the sandbox killed for flooding
  its output counts as exit -9; one the seccomp filter killed (a system call of another
  architecture's table) says so on the line after the code: `"killed by SIGSYS: ..."`.
* a timeout: `"Error: Code execution timed out after {timeout} seconds"`.

When output was cut, `"\\n...[output truncated: N bytes dropped]"` ends the text. The error
kind is "timeout", "crash" (nonzero exit), "output_truncated" (cut, but exit 0) or None.
When the sandbox cannot run code on this host (its probe failed) or breaks down, `execute`
raises `ToolUnavailable` instead of answering: that is not the model's error to learn from.
"""

from __future__ import annotations

import signal
from typing import Any, ClassVar

import attrs

from engine.tools.registry import Tool, ToolError, ToolResult, ToolUnavailable, call_timeout, count, register
from engine.sandbox import backend
from engine.sandbox.probing import probe
from engine.sandbox.runner import SandboxError, SandboxLimits, SandboxResult

_TRACEBACK = "Traceback (most recent call last):\n"
SIGSYS_NOTE = "killed by SIGSYS: a system call the sandbox does not allow (another architecture's table)\n"


def _exception_text(stderr: str) -> str | None:
    """`Error: {e}\\nTraceback:\\n{tb}` from an uncaught exception's stderr, else None."""
    start = stderr.find(_TRACEBACK)
    if start < 0:
        return None
    tb = stderr[start:]
    # The exception line is the first unindented line after the last traceback header.
    lines = tb[tb.rfind(_TRACEBACK) + len(_TRACEBACK):].splitlines()
    tail = next((i for i, line in enumerate(lines) if line and not line.startswith(" ")), None)
    if tail is None:
        return None
    exc = "\n".join(lines[tail:])
    message = exc.split(": ", 1)[1] if ": " in exc.split("\n", 1)[0] else ""
    return f"Error: {message}\nTraceback:\n{tb}"


def format_result(result: SandboxResult, timeout_s: float) -> ToolResult:
    """The retool-format observation text and error kind for one sandbox run."""
    rc = result.returncode if result.returncode is not None else -9
    kind: str | None
    if result.timed_out:
        text, kind = f"Error: Code execution timed out after {timeout_s:g} seconds", "timeout"
    elif rc == 0:
        text = f"Output:\n{result.stdout}" if result.stdout else ""
        text = (text + (f"\nErrors:\n{result.stderr}" if result.stderr else "")).strip()
        kind = "output_truncated" if result.truncated else None
    else:
        exception = _exception_text(result.stderr) if rc == 1 else None
        said = SIGSYS_NOTE if rc == -signal.SIGSYS else ""
        text = exception.strip() if exception else f"Error: Process exited with code {rc}\n{said}{result.stderr}"
        kind = "crash"
    if result.truncated:
        text += f"\n...[output truncated: {result.dropped} bytes dropped]"
    return ToolResult(text, error=kind)


class CodeInterpreter(Tool):
    """Stateless Python execution, one fresh sandbox per call (slime retool's tool spec)."""

    name: ClassVar[str] = "code_interpreter"
    description: ClassVar[str] = "A tool for executing Python code in a safe sandbox environment."
    parameters: ClassVar[dict[str, Any] | None] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python code to execute"}},
        "required": ["code"],
    }

    def __init__(self, **limits: Any) -> None:
        """`limits` are `SandboxLimits` fields: timeout_s, memory_bytes, max_processes, ..."""
        self.limits = SandboxLimits(**limits)

    def configure(self, **limits: Any) -> None:
        """Change some limits, keeping the others."""
        self.limits = attrs.evolve(self.limits, **limits)

    async def check(self) -> str | None:
        """None when the sandbox can run code here (probed once per process), else why not."""
        return await sandbox_check()

    async def execute(self, state: Any, **arguments: Any) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("bad_arguments", "Error: No code provided")
        await require_sandbox()
        limits = attrs.evolve(self.limits, timeout_s=call_timeout(self.limits.timeout_s))
        return format_result(await run_sandboxed(code, limits), limits.timeout_s)


async def run_sandboxed(code: str, limits: SandboxLimits, *, stdin: bytes | None = None,
                        session_key: str | None = None) -> SandboxResult:
    """Run `code` on the configured sandbox backend, in a tool's terms: a sandbox that breaks down
    is `ToolUnavailable` (not the model's error), a call the backend could not answer a `ToolError`."""
    try:
        return await backend.run(code, limits, stdin=stdin, session_key=session_key, count=count)
    except SandboxError as e:
        raise ToolUnavailable(f"the sandbox failed: {e}") from e
    except backend.CallFailed as e:
        raise ToolError(e.kind, e.message) from None


async def sandbox_check() -> str | None:
    """The sandbox probe's reason, None when it can run code (shared by the sandboxed tools)."""
    outcome = await probe()
    return None if outcome.ok else outcome.reason


async def require_sandbox() -> None:
    """Raise `ToolUnavailable` when the sandbox cannot run code here: not the model's fault,
    so no observation for it to learn from."""
    reason = await sandbox_check()
    if reason is not None:
        raise ToolUnavailable(reason)


interpreter = CodeInterpreter()
register(interpreter)


def configure(**limits: Any) -> None:
    """Change the registered interpreter's limits, e.g. `configure(timeout_s=cfg.tool_timeout)`."""
    interpreter.configure(**limits)


def current_limits() -> SandboxLimits:
    """The registered interpreter's limits (other sandboxed tools may follow them)."""
    return interpreter.limits
