"""Running a harness per sample: a Python coroutine in process, or a command line, under a time limit.

`engine_agent` names it. `module:function` is a coroutine called as
`await function(base_url, api_key, sample)`: `base_url` is the session's root (an OpenAI client
takes `base_url + "/v1"`, an Anthropic client `base_url` itself), `api_key` the session's key
(a request may also name its session by it at the door's own root). What it returns is kept
(a number or a dict is the sample's reward). Anything else is a command line, split as a shell
would (no shell runs it), with `{prompt}` in an argument replaced by the sample's prompt; it is
started in its own process group with the environment of this process plus
`OPENAI_BASE_URL` (`{base_url}/v1`), `OPENAI_API_KEY`, `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`,
`ANTHROPIC_AUTH_TOKEN`, `ENGINE_AGENT_PROMPT` (the prompt: its text, or JSON messages) and
`ENGINE_AGENT_SESSION` (the key); exit status 0 is a finished harness. The last 16 KiB of
what it prints is kept with the sample.

The outcome is the session's end: `harness_finished`, `harness_crashed` (an exception, a
non-zero exit) or `harness_timed_out` (past `engine_agent_timeout`: the coroutine is
cancelled, the process group killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import re
import shlex
import signal
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import attrs

OUTPUT_TAIL = 16 * 1024
_PYTHON_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for a command past its time


@attrs.frozen
class HarnessSpec:
    """What `engine_agent` names: a coroutine (`python`, "module:function") or a command line."""

    kind: Literal["python", "command"]
    target: str
    argv: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> HarnessSpec:
        """Read `engine_agent`; ValueError for an empty or unsplittable command line."""
        stripped = text.strip()
        if _PYTHON_TARGET.fullmatch(stripped):
            return cls("python", stripped)
        try:
            argv = tuple(shlex.split(stripped))
        except ValueError as exc:
            raise ValueError(f"engine_agent: the command line cannot be split: {exc}") from None
        if not argv:
            raise ValueError("engine_agent: empty")
        return cls("command", stripped, argv)

    def function(self) -> Callable[..., Awaitable[Any]]:
        """The coroutine function a `python` spec names (ImportError / AttributeError when absent)."""
        module, _, name = self.target.partition(":")
        fn = getattr(importlib.import_module(module), name)
        if not callable(fn):
            raise TypeError(f"engine_agent: {self.target} is not callable")
        return fn  # type: ignore[no-any-return]


@attrs.frozen
class HarnessOutcome:
    """How the harness ended (the session's end reason), what it returned, what it printed."""

    reason: Literal["harness_finished", "harness_crashed", "harness_timed_out"]
    detail: str = ""
    result: Any = None
    output: str = ""


def prompt_text(prompt: Any) -> str:
    """The sample's prompt as a harness is given it: its text, or its messages as JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


async def run_harness(spec: HarnessSpec, *, base_url: str, api_key: str, sample: Any, prompt: Any,
                      timeout: float) -> HarnessOutcome:
    """Run the harness of one sample to its end; never raises but CancelledError."""
    if spec.kind == "python":
        return await _run_coroutine(spec, base_url, api_key, sample, timeout)
    return await _run_command(spec, base_url, api_key, prompt, timeout)


async def _run_coroutine(spec: HarnessSpec, base_url: str, api_key: str, sample: Any, timeout: float) -> HarnessOutcome:
    try:
        fn = spec.function()
        result = await asyncio.wait_for(fn(base_url, api_key, sample), timeout)
    except asyncio.TimeoutError:
        return HarnessOutcome("harness_timed_out", f"{spec.target} ran past {timeout:g} seconds")
    except Exception as exc:  # the harness's own failure: recorded with the sample
        return HarnessOutcome("harness_crashed", f"{spec.target}: {type(exc).__name__}: {exc}")
    return HarnessOutcome("harness_finished", result=result)


def command_environment(base_url: str, api_key: str, prompt: Any) -> dict[str, str]:
    """This process's environment with the session's endpoints and keys for the SDKs a harness uses."""
    env = dict(os.environ)
    env.update({
        "OPENAI_BASE_URL": base_url + "/v1", "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": api_key, "ANTHROPIC_AUTH_TOKEN": api_key,
        "ENGINE_AGENT_PROMPT": prompt_text(prompt), "ENGINE_AGENT_SESSION": api_key,
    })
    return env


async def _run_command(spec: HarnessSpec, base_url: str, api_key: str, prompt: Any, timeout: float) -> HarnessOutcome:
    text = prompt_text(prompt)
    argv = [a.replace("{prompt}", text) for a in spec.argv]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env=command_environment(base_url, api_key, prompt), start_new_session=True)
    except OSError as exc:
        return HarnessOutcome("harness_crashed", f"{argv[0]}: cannot start: {exc.strerror or exc}")
    tail = bytearray()
    reading = asyncio.ensure_future(_read_tail(proc, tail))
    try:
        code = await asyncio.wait_for(proc.wait(), timeout)
    except asyncio.TimeoutError:
        await _stop(proc)
        return HarnessOutcome("harness_timed_out", f"{argv[0]} ran past {timeout:g} seconds", output=await _tail(reading, tail))
    except asyncio.CancelledError:
        await asyncio.shield(_stop(proc))
        raise
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # what it started and left running ends with it
    output = await _tail(reading, tail)
    if code != 0:
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        last = last_line(output)  # most harnesses say why on their last line (an exception, a usage error)
        return HarnessOutcome("harness_crashed", f"{argv[0]}: {how}" + (f": {last}" if last else ""), output=output)
    return HarnessOutcome("harness_finished", output=output)


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit):")


def last_line(output: str, limit: int = 200) -> str:
    """What a command's output says last: its last exception line (`RuntimeError: ...`), else its
    last non-blank line, cut to `limit` characters ("" when there is none).

    The exception line first: a harness that prints a rich traceback or wraps its message
    leaves a fragment of it on the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    line = next((x for x in reversed(lines) if _EXCEPTION_LINE.match(x)), lines[-1] if lines else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


async def _read_tail(proc: asyncio.subprocess.Process, tail: bytearray) -> None:
    assert proc.stdout is not None
    while chunk := await proc.stdout.read(65536):
        tail += chunk
        del tail[:-OUTPUT_TAIL]


async def _tail(reading: asyncio.Future[None], tail: bytearray) -> str:
    with contextlib.suppress(asyncio.TimeoutError, Exception):
        await asyncio.wait_for(asyncio.shield(reading), 1.0)  # what the pipe still holds; a grandchild may keep it open
    reading.cancel()
    return tail.decode("utf-8", "replace")


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """TERM the harness's process group, KILL it after a grace: nothing it started outlives it."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        if wait is None:
            break
        try:
            await asyncio.wait_for(proc.wait(), wait)
            break
        except asyncio.TimeoutError:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # what the group left behind after its leader exited
    await proc.wait()
