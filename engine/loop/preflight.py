"""Before rolling out: can every offered tool work? A dead tool must stop the job, not train it.

A sandbox that cannot start makes every call an error observation; a rollout then looks
healthy (every sample ends, rewards come back) while the model learns against a dead tool.
So `run`, `soak` and `bench` ask each tool first: a tool that defines `async check()`
(None when it can work, else the reason; the sandboxed tools run a probe program) is asked,
a tool without one is taken as able. Under slime, `log_tool_problems` logs one clear error.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Iterable

from engine import tools

log = logging.getLogger(__name__)

CHECK_TIMEOUT = 60.0  # seconds; a probe that hangs is a reason in itself


async def check_tool(name: str, timeout: float = CHECK_TIMEOUT) -> str | None:
    """None when the tool `name` can work, else a sentence saying why not."""
    tool = tools.get(name)
    if tool is None:
        return "not registered"
    check = getattr(tool, "check", None)
    if check is None:
        return None
    try:
        outcome = check()  # async by contract; a plain function's answer is taken as it is
        reason = await asyncio.wait_for(outcome, timeout) if inspect.isawaitable(outcome) else outcome
    except asyncio.TimeoutError:
        return f"its check did not answer within {timeout:g} s"
    except Exception as exc:  # a broken check is a broken tool: say what it raised
        return f"its check failed: {type(exc).__name__}: {exc}"
    return None if reason is None else str(reason) or "its check refused without a reason"


async def check_tools(names: Iterable[str], timeout: float = CHECK_TIMEOUT) -> dict[str, str]:
    """Tool name -> reason, for each of `names` that cannot work ({} when all can). Checks run together."""
    names = list(dict.fromkeys(names))
    reasons = await asyncio.gather(*(check_tool(n, timeout) for n in names))
    return {name: reason for name, reason in zip(names, reasons) if reason is not None}


def check_tools_sync(names: Iterable[str], timeout: float = CHECK_TIMEOUT) -> dict[str, str]:
    """`check_tools` from synchronous code (the commands), on a fresh event loop."""
    return asyncio.run(check_tools(names, timeout))


def describe(problems: dict[str, str]) -> str:
    """One line naming every tool that cannot work and why."""
    return "; ".join(f"tool {name} cannot work: {reason}" for name, reason in problems.items())


_logged: set[str] = set()


async def log_tool_problems(names: Iterable[str]) -> dict[str, str]:
    """Check the tools and log one error per problem, once per process (slime's start-up)."""
    problems = await check_tools(names)
    for name, reason in problems.items():
        line = f"tool {name} cannot work: {reason}; samples that call it end FAILED (tool_unavailable), none of them trained"
        if line not in _logged:
            _logged.add(line)
            log.error(line)
    return problems
