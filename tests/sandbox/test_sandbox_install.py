"""The sandbox in installs and hosts other than the developer's: a venv under /tmp, a host
that refuses namespaces (as a container's seccomp profile does), and the probe that finds
out before any rollout whether code can run at all.

Engine processes with another interpreter or another kernel policy are real subprocesses
(`python -c` in the checkout), so nothing here is simulated by patching the sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from engine.tools import ToolUnavailable, code_interpreter, python_session, registry
from engine.sandbox import SandboxProbe, client, probe, probe_sync, runner
from engine.sandbox import probing as probe_module

PROJECT = Path(__file__).resolve().parents[2]
ROOT = os.geteuid() == 0
# What the engine process prints: the probe, then one code call through the registered tool.
ENGINE = """
import asyncio, json, os
from engine.sandbox import probe_sync
from engine import tools
outcome = probe_sync()
call = asyncio.run(tools.get('code_interpreter').execute(None, code=CODE)) if outcome.ok else None
print(json.dumps({'ok': outcome.ok, 'reason': outcome.reason, 'isolation': outcome.isolation,
                  'text': getattr(call, 'text', None)}))
"""
CALL = "import colorsys, os, sys\nprint(6 * 7, os.getuid(), sys.prefix)"


def engine_process(python: str, prelude: str = "", timeout: float = 120) -> dict[str, Any]:
    """Run the engine snippet under `python` from the checkout; its JSON line."""
    code = prelude + f"\nCODE = {CALL!r}\n" + ENGINE
    # The engine's own dependencies (httpx, attrs) from this interpreter's site-packages: a venv made
    # with --system-site-packages sees its base interpreter's only. The sandbox sees the venv alone.
    deps = os.pathsep.join(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    proc = subprocess.run([python, "-c", code], cwd=PROJECT, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": deps}, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_probe_runs_code_through_the_sandbox_once() -> None:
    probe_module.reset()
    calls = []
    real = probe_module.run_python

    async def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return await real(*args, **kwargs)

    async def main() -> list[SandboxProbe]:
        return await asyncio.gather(*(probe() for _ in range(5)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe_module, "run_python", counting)
        outcomes = asyncio.run(main())
        again = probe_sync()  # another loop, another thread: still the cached outcome
    assert calls == [probe_module.PROBE_CODE]  # concurrent first callers shared one run
    assert all(o is outcomes[0] for o in outcomes) and again is outcomes[0]
    assert outcomes[0].ok and outcomes[0].reason == ""
    iso = outcomes[0].isolation
    assert iso["zygote"] is True and iso["cgroup"] in ("v2", "v1", "rlimits")
    assert {"root", "netns", "mntns", "ipcns", "uid_per_run"} <= iso.keys()
    assert iso["root"] == ROOT and iso["uid_per_run"] == ROOT


@pytest.mark.skipif(not ROOT, reason="hiding the interpreter needs the mount namespace (root)")
def test_a_sandbox_that_cannot_run_code_makes_the_tools_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    caps = runner._capabilities()
    if not caps.mntns or not any(runner._under(p, h) for p in runner.interpreter_paths() for h in caps.hide):
        pytest.skip("needs a mount namespace and an interpreter under a hidden path (as /root here)")
    # The bug this guards against: the interpreter's directories hidden from the sandbox.
    monkeypatch.setattr(runner, "_caps", attrs.evolve(caps, expose=()))
    probe_module.reset()
    try:
        outcome = probe_sync()
        assert not outcome.ok and "cannot run code" in outcome.reason and "colorsys" in outcome.reason
        interpreter, session = registry.get("code_interpreter"), registry.get("python_session")
        assert isinstance(interpreter, code_interpreter.CodeInterpreter)
        assert isinstance(session, python_session.PythonSession)
        assert asyncio.run(interpreter.check()) == outcome.reason == asyncio.run(session.check())
        with pytest.raises(ToolUnavailable, match="cannot run code"):
            asyncio.run(interpreter.execute(None, code="print(1)"))
        with pytest.raises(ToolUnavailable, match="cannot run code"):
            asyncio.run(session.execute(asyncio.run(session.create()), code="print(1)"))
    finally:
        probe_module.reset()


def test_tools_without_infrastructure_report_none() -> None:
    @registry.tool(name="always_there_tool")
    async def always_there_tool() -> str:
        """A tool with nothing to check."""
        return "x"

    try:
        assert asyncio.run(registry.get("always_there_tool").check()) is None  # type: ignore[union-attr]
    finally:
        registry.unregister("always_there_tool")


def test_a_venv_under_tmp_runs_a_code_call(tmp_path: Path) -> None:
    # --system-site-packages: the venv reuses this install's packages (attrs, numpy) instead of
    # downloading them; the interpreter, its prefix and site-packages live under /tmp all the same.
    venv = tmp_path / "venv"
    assert str(venv.resolve()).startswith("/tmp/")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    got = engine_process(str(venv / "bin" / "python"))
    assert got["ok"], got["reason"]
    assert got["text"].startswith("Output:\n"), got["text"]
    answer, uid, prefix = got["text"].removeprefix("Output:\n").split()
    assert answer == "42" and prefix == str(venv)
    assert (int(uid) >= runner.UID_BASE) == ROOT
    if got["isolation"]["mntns"]:
        assert str(venv.resolve()) in got["isolation"]["exposed"]
    assert got["isolation"]["interpreter_reexecutable"] is True  # a venv as `python -m venv` makes it (0755)
    # A venv in a directory only its owner may enter (mktemp -d makes 0700): the code still runs
    # (the zygote never execs), but as a uid of its own it could not start the interpreter again,
    # and the probe says so.
    venv.chmod(0o700)
    got = engine_process(str(venv / "bin" / "python"))
    assert got["ok"] and got["text"].startswith("Output:\n42"), got
    assert got["isolation"]["interpreter_reexecutable"] is (not ROOT)


SECCOMP = """
import ctypes, errno
# A container's seccomp profile: unshare(2) fails with EPERM, for this process and its children.
NR = {NR}
prog = [(0x20, 0, 0, 0), (0x15, 0, 1, NR), (0x06, 0, 0, 0x00050000 | errno.EPERM), (0x06, 0, 0, 0x7fff0000)]
class Filter(ctypes.Structure):
    _fields_ = [('code', ctypes.c_ushort), ('jt', ctypes.c_ubyte), ('jf', ctypes.c_ubyte), ('k', ctypes.c_uint)]
class Prog(ctypes.Structure):
    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.POINTER(Filter))]
filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(22, 2, ctypes.byref(Prog(len(prog), filters)), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
assert libc.unshare(0x40000000) != 0
"""
UNSHARE_NR = {"x86_64": 272, "aarch64": 97}.get(platform.machine())


@pytest.mark.skipif(not ROOT or UNSHARE_NR is None, reason="needs root (a uid per run) and a known unshare(2) number")
def test_namespaces_refused_still_runs_code() -> None:
    got = engine_process(sys.executable, SECCOMP.replace("{NR}", str(UNSHARE_NR)))
    assert got["ok"], got["reason"]
    iso = got["isolation"]
    assert not (iso["netns"] or iso["mntns"] or iso["ipcns"])
    assert iso["uid_per_run"] and iso["zygote"]
    answer, uid, _ = got["text"].removeprefix("Output:\n").split()
    # Here the interpreter lives under /root (pyenv), which the dropped uid cannot search:
    # the run still imports a module no one preloaded (colorsys).
    assert answer == "42" and runner.UID_BASE <= int(uid) < runner.UID_BASE + runner.UID_COUNT


@pytest.mark.parametrize("memory_mib, processes", [(256, 64), (4096, 64), (100, 8), (8192, 4), (1024, 64)])
def test_pages_and_kernel_buffers_together_stay_within_the_budget(memory_mib: int, processes: int) -> None:
    limits = runner.SandboxLimits(memory_bytes=memory_mib << 20, max_processes=processes)
    per_fd = runner.kernel_bytes_per_fd()
    assert per_fd >= 212992  # at least a unix socket's default send buffer
    got = runner._rlimits(limits, runner._Capabilities(root=True, cgroup="rlimits"), uid=runner.UID_BASE)
    assert 1 <= got["NPROC"] <= processes
    # Without a cgroup: every process's address space and the buffers its descriptors can hold.
    assert got["NPROC"] * (got["AS"] + got["NOFILE"] * per_fd) <= limits.memory_bytes
    assert got["AS"] >= min(limits.memory_bytes, runner.MIN_PROCESS_BYTES) * 3 // 4  # each process can still work
    assert got["NOFILE"] >= runner.MIN_FILES
    # With a cgroup for the whole run: its pages under the cgroup's limit, the buffers beside it.
    budget = runner._budget(limits, runner._Capabilities(root=True, cgroup="v1"), uid=runner.UID_BASE)
    assert budget.kernel == budget.processes * budget.files * per_fd
    assert budget.memory + budget.kernel <= limits.memory_bytes and budget.kernel <= limits.memory_bytes // 4
    assert budget.address_space == budget.memory and budget.files >= runner.MIN_FILES
    whole = runner._rlimits(limits, runner._Capabilities(root=True, cgroup="v1"), uid=runner.UID_BASE)
    assert whole["NPROC"] == budget.processes <= processes and whole["NOFILE"] == budget.files


def test_a_dead_zygote_fails_its_runs_loudly_and_the_next_call_starts_a_new_one() -> None:
    async def main() -> tuple[BaseException | None, Any]:
        await runner.run_python("print(1)")  # a zygote is running
        zygote = client.current()
        assert zygote is not None
        task = asyncio.create_task(runner.run_python("import time\ntime.sleep(30)", runner.SandboxLimits(timeout_s=60)))
        await asyncio.sleep(0.5)
        os.kill(zygote.proc.pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(task, 20)
            error = None
        except runner.SandboxError as e:
            error = e
        return error, await runner.run_python("print(6 * 7)")

    error, after = asyncio.run(main())
    assert error is not None and "zygote" in str(error)
    assert after.stdout == "42\n" and client.current() is not None


def test_the_checkout_the_sandbox_hides_is_the_whole_checkout() -> None:
    # Run from a checkout, the hidden project root is the folder holding pyproject.toml, not a package
    # inside it: a depth off by one would leave the rest of the checkout readable to model code.
    from engine.sandbox import runner

    assert Path(runner.PROJECT_ROOT) == PROJECT
    assert (Path(runner.PROJECT_ROOT) / "pyproject.toml").is_file()
