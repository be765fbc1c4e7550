"""The sandbox against real hostile code, and the two tools built on it.

Plain test functions that call `asyncio.run`, so pytest-asyncio is not needed. After every
test no process of a uid the test leased may be alive (checked when running as root, where
each run has a uid of its own; without root the uid layers do not apply). Only the test's
own uids count: another engine or test run on the same host leases others from the pool.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from engine.tools import code_interpreter, python_session, registry
from engine.tools.code_interpreter import format_result
from engine.tools.registry import ToolError
from engine.sandbox import runner as sandbox
from engine.sandbox.runner import (
    UID_BASE,
    UID_COUNT,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    filesystem_isolated,
    network_isolated,
    run_python,
)

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="uid separation needs root")
FAST = SandboxLimits(timeout_s=5)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


LEASED: set[int] = set()  # uids the current test's runs were given


def sandbox_pids() -> list[int]:
    """Live (non-zombie) processes owned by a uid this test leased."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        uid = int(fields["Uid"].split()[0])
        if uid in LEASED and fields["State"].split()[0] != "Z":
            found.append(int(name))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    lease = sandbox._try_lease

    def recording(uids: tuple[int, ...]) -> Any:
        got = lease(uids)
        if got is not None:
            assert UID_BASE <= got.uid < UID_BASE + UID_COUNT
            LEASED.add(got.uid)
        return got

    LEASED.clear()
    monkeypatch.setattr(sandbox, "_try_lease", recording)
    yield
    if ROOT:
        assert sandbox_pids() == []


def test_concurrent_runs_overlap() -> None:
    async def main() -> list[SandboxResult]:
        return await asyncio.gather(*(run_python("import time; time.sleep(1)", FAST) for _ in range(32)))

    t0 = time.monotonic()
    results = run(main())
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results if r.returncode]
    assert max(r.started for r in results) < min(r.ended for r in results)
    assert time.monotonic() - t0 < 10  # sequential would take 32 s


def test_infinite_loop_times_out_and_group_is_killed() -> None:
    code = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\nwhile True: pass"
    t0 = time.monotonic()
    r = run(run_python(code, SandboxLimits(timeout_s=2)))
    assert r.timed_out and r.killed and r.returncode is None
    assert time.monotonic() - t0 < 6


GREEDY = ["x = bytearray(8 * 1024**3)", "chunks = []\nwhile True: chunks.append(bytearray(10**7))"]


@pytest.mark.parametrize("code", GREEDY)
def test_memory_bomb_is_contained(code: str) -> None:
    r = run(run_python(code, SandboxLimits(timeout_s=10, memory_bytes=256 << 20)))
    assert r.returncode == 1 and "MemoryError" in r.stderr and not r.timed_out


@needs_root
def test_fork_bomb_is_contained() -> None:
    code = """
import os, time
count = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        count += 1
except OSError as e:
    print(count, type(e).__name__)
"""
    r = run(run_python(code, SandboxLimits(timeout_s=10, max_processes=16)))
    count, error = r.stdout.split()
    assert int(count) < 16 and error == "BlockingIOError"
    assert r.killed  # the sleeping children were left behind and killed after the run
    r = run(run_python("import os\nwhile True: os.fork()", SandboxLimits(timeout_s=2, max_processes=16)))
    assert r.returncode != 0 or r.timed_out


def test_huge_output_is_truncated_and_drained() -> None:
    t0 = time.monotonic()
    r = run(run_python("import sys; sys.stdout.write('x' * 100_000_000)", FAST))
    assert r.returncode == 0 and r.truncated and not r.timed_out
    assert r.stdout == "x" * 65536 and r.dropped == 100_000_000 - 65536
    assert time.monotonic() - t0 < 5
    text = format_result(r, FAST.timeout_s)
    assert text.error == "output_truncated"
    assert text.text.endswith(f"\n...[output truncated: {r.dropped} bytes dropped]")


def test_endless_output_is_killed_as_a_flood() -> None:
    limits = SandboxLimits(timeout_s=20, drain_bytes=8 << 20)
    r = run(run_python("import sys\nwhile True: sys.stdout.write('y' * 65536)", limits))
    assert r.killed and r.truncated and r.returncode is None and not r.timed_out
    assert r.ended - r.started < 10


def test_parent_secrets_are_not_visible() -> None:
    secret = uuid.uuid4().hex
    os.environ["ENGINE_TEST_SECRET"] = secret
    code = f"""
import os
print(dict(os.environ))
print(open('/proc/self/environ', 'rb').read())
try:
    print(open('/proc/{os.getpid()}/environ', 'rb').read())
except OSError as e:
    print('parent environ:', type(e).__name__)
"""
    try:
        r = run(run_python(code, FAST))
    finally:
        del os.environ["ENGINE_TEST_SECRET"]
    assert r.returncode == 0 and secret not in r.stdout and "ENGINE_TEST_SECRET" not in r.stdout
    if ROOT:  # as the same user, a child could read its parent's /proc/<pid>/environ
        assert "parent environ:" in r.stdout


def test_writes_outside_the_work_dir_fail() -> None:
    if not filesystem_isolated():
        pytest.skip("no mount namespace here (needs root and unshare(CLONE_NEWNS)): /tmp stays writable")
    name = f"sandbox-test-{uuid.uuid4().hex}"
    project = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    targets = [f"/tmp/{name}", os.path.join(project, name), f"/var/tmp/{name}", f"/dev/shm/{name}"]
    code = f"""
for path in {targets!r} + ['here.txt']:
    try:
        with open(path, 'w') as f:
            f.write('pwned')
        print('wrote', path)
    except OSError as e:
        print('denied', path, type(e).__name__)
"""
    r = run(run_python(code, FAST))
    assert r.returncode == 0, r.stderr
    assert "wrote here.txt" in r.stdout
    assert all(f"denied {t}" in r.stdout for t in targets), r.stdout
    for target in targets:
        assert not os.path.exists(target)


@needs_root
def test_daemons_and_sigterm_ignorers_do_not_survive() -> None:
    code = """
import os, signal, subprocess, sys, time
stubborn = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'
sleeper = subprocess.Popen([sys.executable, '-c', stubborn], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # the daemon: own session, ignores SIGTERM, keeps our stdout open
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(w, str(os.getpid()).encode())
        time.sleep(600)
    os._exit(0)
os.close(w)
print(sleeper.pid, int(os.read(r, 32)))
"""
    t0 = time.monotonic()
    r = run(run_python(code, FAST))
    assert r.returncode == 0 and r.killed, r.stderr
    assert time.monotonic() - t0 < 5
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2 and not any(alive(p) for p in pids)


def test_network_is_blocked() -> None:
    if not network_isolated():
        pytest.skip("no network namespace here (needs root and unshare(CLONE_NEWNET))")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    code = f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=3)
    print('connected')
except OSError as e:
    print('blocked', e)
"""
    try:
        r = run(run_python(code, FAST))
        assert r.stdout.startswith("blocked"), r.stdout
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


@needs_root
def test_cancellation_kills_the_child() -> None:
    async def main() -> None:
        task = asyncio.create_task(run_python("import time; time.sleep(60)", SandboxLimits(timeout_s=60)))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if sandbox_pids():
                break
        assert sandbox_pids(), "the sandboxed process never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sandbox_pids() == []

    run(main())


def test_stdin_and_isolation_report() -> None:
    r = run(run_python("print(input()[::-1])", FAST, stdin=b"olleh\n"))
    assert r.stdout == "hello\n"
    # The stdin handed over is the engine's memory: sealed, the run reads it and nothing more.
    tries = "import os\nfor f in (lambda: os.pwrite(0, b'x', 0), lambda: os.ftruncate(0, 1 << 20)):\n" \
            "    try:\n        f()\n        print('ok')\n    except OSError as e:\n        print(e.errno)\n"
    r = run(run_python(tries, FAST, stdin=b"olleh\n"))
    assert r.stdout.split() == ["1", "1"], r.stdout + r.stderr  # EPERM, EPERM
    assert isinstance(network_isolated(), bool) and isinstance(filesystem_isolated(), bool)


def test_fallback_without_root_keeps_limits_and_the_group_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a non-root engine gets: no uid, no namespaces (here the child runs as root, so the
    # code stays harmless); the process group is still killed and the limits still apply.
    monkeypatch.setattr(sandbox, "_caps", sandbox._Capabilities(root=False))
    code = (
        "import subprocess, sys\n"
        "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']).pid, flush=True)\n"
        "while True: pass"
    )
    r = run(run_python(code, SandboxLimits(timeout_s=1.5)))
    assert r.timed_out and r.killed and r.returncode is None
    assert not alive(int(r.stdout))
    r = run(run_python("x = bytearray(1 << 30)", SandboxLimits(timeout_s=5, memory_bytes=256 << 20)))
    assert r.returncode == 1 and "MemoryError" in r.stderr


@needs_root
def test_unsafe_lock_dir_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "LOCK_DIR", "/tmp")  # world-writable: anyone could hold or fake a lease
    with pytest.raises(SandboxError, match="root-owned"):
        run(run_python("print(1)", FAST))


def test_cpu_seconds_follow_the_timeout() -> None:
    assert SandboxLimits(timeout_s=2.5).cpu_seconds() == 4
    assert SandboxLimits(timeout_s=2.5, cpu_s=10).cpu_seconds() == 10


def _result(stdout: str = "", stderr: str = "", rc: int | None = 0, **kw: Any) -> SandboxResult:
    fields: dict[str, Any] = {"timed_out": False, "truncated": False, "started": 0.0, "ended": 1.0, "killed": False}
    return SandboxResult(stdout=stdout, stderr=stderr, returncode=rc, **{**fields, **kw})


def test_code_interpreter_text_formats() -> None:
    assert format_result(_result("2\n"), 120) == registry.ToolResult("Output:\n2")
    assert format_result(_result("a\n", "warn\n"), 120).text == "Output:\na\n\nErrors:\nwarn"
    assert format_result(_result(), 120).text == ""
    tb = 'Traceback (most recent call last):\n  File "main.py", line 1, in <module>\nValueError: bad value\n'
    exception = registry.ToolResult(f"Error: bad value\nTraceback:\n{tb.strip()}", "crash")
    assert format_result(_result("lost\n", tb, 1), 120) == exception  # as in retool, stdout is dropped
    syntax = '  File "main.py", line 1\n    1 +\nSyntaxError: invalid syntax\n'
    assert format_result(_result("", syntax, 1), 120).text == f"Error: Process exited with code 1\n{syntax}"
    assert format_result(_result(rc=3), 120) == registry.ToolResult("Error: Process exited with code 3\n", "crash")
    timeout = format_result(_result(rc=None, timed_out=True, killed=True), 120.0)
    assert timeout == registry.ToolResult("Error: Code execution timed out after 120 seconds", "timeout")
    cut = format_result(_result("x" * 10, truncated=True, dropped=90), 120)
    assert cut == registry.ToolResult(
        "Output:\nxxxxxxxxxx\n...[output truncated: 90 bytes dropped]", "output_truncated"
    )


def test_code_interpreter_tool() -> None:
    tool = registry.get("code_interpreter")
    assert tool is code_interpreter.interpreter
    assert tool.schema()["function"] == {
        "name": "code_interpreter",
        "description": "A tool for executing Python code in a safe sandbox environment.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to execute"}},
            "required": ["code"],
        },
    }
    with pytest.raises(ToolError) as err:
        run(tool.execute(None, code="  \n"))
    assert err.value.kind == "bad_arguments" and err.value.message == "Error: No code provided"
    before = code_interpreter.current_limits()
    try:
        code_interpreter.configure(timeout_s=1.5)
        assert code_interpreter.current_limits().timeout_s == 1.5
        assert code_interpreter.current_limits().memory_bytes == before.memory_bytes
        result = run(tool.execute(None, code="import time; time.sleep(5)"))
        assert result == registry.ToolResult("Error: Code execution timed out after 1.5 seconds", "timeout")
        assert run(tool.execute(None, code="print(6 * 7)")) == registry.ToolResult("Output:\n42")
    finally:
        code_interpreter.configure(timeout_s=before.timeout_s)


def test_python_session_keeps_state_per_trajectory() -> None:
    tool = registry.get("python_session")
    assert isinstance(tool, python_session.PythonSession)

    async def main() -> None:
        first, second = await tool.create(), await tool.create()
        assert (await tool.execute(first, code="x = 1")).text == ""
        assert (await tool.execute(first, code="print(x + 1)")).text == "Output:\n2"
        failed = await tool.execute(first, code="y = x / 0")
        assert failed.error == "crash" and "ZeroDivisionError" in failed.text and "<cell 3>" in failed.text
        assert "NameError" in (await tool.execute(first, code="print(y)")).text  # failed cells are not kept
        assert (await tool.execute(first, code="print('x is', x)")).text == "Output:\nx is 1"
        assert "NameError" in (await tool.execute(second, code="print(x)")).text
        await tool.release(first)
        assert first.cells == []

    run(main())
