"""Can the sandbox run code here? One probe program through the real sandbox, once per process.

`probe()` runs `PROBE_CODE` with `run_python` exactly as a tool call would (same zygote,
uids, namespaces, cgroups, limits), so a host where the sandbox cannot run code (an
interpreter it cannot see, a missing kernel feature, a broken install) is found before
the first rollout, with the reason, instead of answering every tool call with an error
text the model would learn from. Concurrent first callers, from any event loop or
thread, share one run; the outcome is cached for the life of the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
from typing import Any

import attrs

from engine.sandbox.runner import SandboxError, SandboxLimits, capabilities, run_python

# A module never preloaded by the zygote (so the standard library must be reachable from
# the sandbox), a write in the working directory, and a known answer.
# The last line: whether code in the sandbox could start the interpreter again (subprocess,
# multiprocessing); a parent directory the run's uid cannot enter (a venv in a 0700 dir) says no.
PROBE_CODE = ("import colorsys, os, sys\nopen('probe.txt', 'w').write('ok')\nprint(6 * 7)\n"
              "print(int(os.access(sys.executable, os.X_OK)))\n")
PROBE_LIMITS = SandboxLimits(timeout_s=30.0)


@attrs.frozen
class SandboxProbe:
    """Whether the sandbox can run code on this host (`reason` empty when it can), and what
    isolation the host gave: root, netns, mntns, ipcns, cgroup ("v2" | "v1" | "rlimits"),
    uid_per_run, zygote, preloaded modules, the interpreter."""

    ok: bool
    reason: str
    isolation: dict[str, Any] = attrs.field(factory=dict)


class _Abandoned(Exception):
    """The caller running the shared probe was cancelled: the others start their own."""


log = logging.getLogger(__name__)
_lock = threading.Lock()
_result: concurrent.futures.Future[SandboxProbe] | None = None


async def _run_probe() -> SandboxProbe:
    try:
        result = await run_python(PROBE_CODE, PROBE_LIMITS)
    except SandboxError as e:
        return SandboxProbe(False, f"the sandbox cannot be set up: {e}", _isolation())
    except OSError as e:
        return SandboxProbe(False, f"the sandbox cannot be set up: {type(e).__name__}: {e}", _isolation())
    if result.returncode == 0 and result.stdout.startswith("42\n"):
        isolation = _isolation()
        _say_missing_layers(isolation)
        isolation["interpreter_reexecutable"] = result.stdout.endswith("\n1\n")
        if not isolation["interpreter_reexecutable"]:
            log.warning("sandboxed code runs, but code that starts the interpreter again (subprocess, multiprocessing) "
                        "will fail: the sandbox's uid cannot execute %s (a parent directory it cannot enter, e.g. a "
                        "venv in a mode-0700 directory: make it 0755)", sys.executable)
        return SandboxProbe(True, "", isolation)
    said = (result.stderr.strip().splitlines() or [""])[-1][:300]
    how = "timed out" if result.timed_out else f"exited {result.returncode}"
    return SandboxProbe(False, f"the sandbox cannot run code: the probe program {how}, printed "
                               f"{result.stdout[:80]!r}; {said}", _isolation())


def _say_missing_layers(isolation: dict[str, Any]) -> None:
    """Once per process (the probe runs once): a loud warning naming each no-privilege layer
    this kernel lacks, and what is then held by the uid and namespaces only."""
    missing = [name for name in ("landlock", "seccomp") if not isolation.get(name)]
    if missing:
        log.warning("SANDBOX LAYER MISSING: %s not available on this kernel; model code is held by what the "
                    "mode '%s' gives only. Not held here: %s", " and ".join(missing), isolation.get("mode"),
                    "; ".join(isolation.get("cannot_hold", [])))


def _isolation() -> dict[str, Any]:
    try:
        return capabilities()
    except Exception as e:  # noqa: BLE001 - the report must not fail where the probe did
        return {"error": f"{type(e).__name__}: {e}"}


async def probe() -> SandboxProbe:
    """Run the probe program through the real sandbox, once per process (cached)."""
    global _result
    with _lock:
        first = _result is None
        if first:
            _result = concurrent.futures.Future()
        shared = _result
    assert shared is not None
    if first:
        try:
            outcome = await _run_probe()
        except BaseException:  # cancelled or worse: the waiting callers try again themselves
            with _lock:
                _result = None
            shared.set_exception(_Abandoned())
            raise
        shared.set_result(outcome)
        return outcome
    try:
        return await asyncio.wrap_future(shared)
    except _Abandoned:
        return await probe()


def probe_sync() -> SandboxProbe:
    """`probe()` for synchronous callers (CLIs): runs on a private event loop in a thread."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandbox-probe") as pool:
        return pool.submit(asyncio.run, probe()).result()


def reset() -> None:
    """Forget the cached outcome (tests)."""
    global _result
    with _lock:
        _result = None
