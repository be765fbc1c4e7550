"""Model code against the sandbox beyond the attack suite's own cases: what only the host may say,
cleanup that nothing the run leaves can stop, a uid that cannot be cleaned, a supervisor that dies,
and the ordinary scientific code that must keep working.

Real runs through the real sandbox (the engine's own zygote, supervisors and uids); the host-side
tricks (an immutable file, a killed supervisor) are what a broken disk or an OOM kill would do.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.sandbox import child, probing
from engine.sandbox import runner as sandbox
from engine.sandbox.runner import SandboxLimits, run_python
from engine.tools import registry

ROOT = os.geteuid() == 0
FAST = SandboxLimits(timeout_s=10)
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _immutable(path: str, on: bool) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, b"\0" * 4))[0]
        flags = flags | FS_IMMUTABLE_FL if on else flags & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("i", flags))
    finally:
        os.close(fd)


def test_a_forged_report_of_a_broken_sandbox_is_the_programs_own_result() -> None:
    # What a setup failure once looked like (a hex token, an OSError, exit 125), and the code's own
    # kill of itself: each is an ordinary observation, and the tool stays available.
    tool = registry.get("code_interpreter")
    assert tool is not None
    forged = "import os, sys\nsys.stderr.write('0' * 32 + ' OSError: [Errno 28] No space left\\n')\nos._exit(125)"
    result = asyncio.run(tool.execute(None, code=forged))
    assert result.error == "crash" and result.text.startswith("Error: Process exited with code 125"), result
    killed = asyncio.run(tool.execute(None, code="import os, signal\nos.killpg(0, signal.SIGKILL)"))
    assert killed.error == "crash" and "code -9" in killed.text
    assert asyncio.run(tool.check()) is None


def test_a_setup_failure_is_heard_from_the_supervisor_not_from_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    # A run whose sandbox cannot be built (its work dir cannot be made) is the host's to report.
    if not sandbox.filesystem_isolated():
        pytest.skip("needs the mount namespace (root)")
    monkeypatch.setattr(sandbox, "SANDBOX_DIR", "/tmp/missing/sandbox")
    with pytest.raises(sandbox.SandboxError, match="FileNotFoundError"):
        asyncio.run(run_python("print(1)", FAST))


def test_remove_tree_takes_anything_a_run_can_leave(tmp_path: Path) -> None:
    top = tmp_path / "work"
    (top / "a").mkdir(parents=True)
    outside = tmp_path / "keep.txt"
    outside.write_text("the host's")
    (top / "a" / "link").symlink_to(outside)  # removed, never followed
    (top / "a" / "dirlink").symlink_to(tmp_path)
    os.mkfifo(top / "a" / "fifo")
    deep = top / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(3000):  # deeper than the recursion limit and the descriptor limit together
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.fchmod(fd, 0o100)  # the deepest directory: not even listable by its owner
    os.close(fd)
    (top / "a").chmod(0)
    assert child.remove_tree(str(top)) == ""
    assert not top.exists() and outside.read_text() == "the host's"
    assert child.remove_tree(str(top)) == ""  # gone already: nothing to say


def test_remove_tree_says_what_it_could_not_remove(tmp_path: Path) -> None:
    top = tmp_path / "work"
    (top / "d").mkdir(parents=True)
    stuck = top / "d" / "stuck"
    stuck.write_text("x")
    try:
        _immutable(str(stuck), True)
    except OSError as e:
        pytest.skip(f"no immutable files here: {e}")
    try:
        left = child.remove_tree(str(top))
        assert left.startswith(f"{top} is left") and "PermissionError" in left, left
    finally:
        _immutable(str(stuck), False)
    assert child.remove_tree(str(top)) == "" and not top.exists()


def test_a_tree_too_big_for_the_clock_is_removed_whole_once_nothing_of_the_run_is_alive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A run on many cores makes entries faster than one process removes them. Here every reading of
    # the clock is a minute later: on a clock, removal stops at once; once the run's processes are
    # gone (a process group that is no more), the tree is finite and goes whole.
    top = tmp_path / "work"
    for i in range(20):
        (top / f"d{i}").mkdir(parents=True)
        (top / f"d{i}" / "f").write_text("x")
    now = [0.0]

    def minute_later() -> float:
        now[0] += 60.0
        return now[0]

    monkeypatch.setattr(child.time, "monotonic", minute_later)
    assert "TimeoutError" in child.remove_tree(str(top)) and top.exists()
    assert child.clean_group(None, str(top)) == (0, "")
    assert not top.exists()


def test_a_run_cgroup_is_busy_by_its_counter_not_by_a_listing(tmp_path: Path) -> None:
    # A fork chain is never in a listing of cgroup.procs for long; the pids controller's count and
    # v2's `populated` hold each task from its fork until it is reaped.
    v1 = tmp_path / "pids"
    v1.mkdir()
    (v1 / "cgroup.procs").write_text("")  # the listing missed it
    (v1 / "pids.current").write_text("1\n")
    assert child.cgroups_busy([[str(v1), []]])
    (v1 / "pids.current").write_text("0\n")
    assert not child.cgroups_busy([[str(v1), []]])
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.procs").write_text("")
    (v2 / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    assert child.cgroups_busy([[str(v2), []]])
    (v2 / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    assert not child.cgroups_busy([[str(v2), []]])
    memory = tmp_path / "memory"  # no counter: the listing it is
    memory.mkdir()
    (memory / "cgroup.procs").write_text("42\n")
    assert child.cgroups_busy([[str(v1), []], [str(memory), []]])
    assert child.cgroups_busy([[str(tmp_path / "gone"), []]])  # cannot tell: clean


def test_without_a_uid_per_run_runs_stop_short_of_the_engines_own_process_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # RLIMIT_NPROC counts all of the user's tasks, and each fork is checked against the forking
    # process's own limit: a run's stays ENGINE_ROOM below the engine's, so fork bombs in every run
    # together leave the engine room for its threads, its zygote's and its forker's forks.
    caps = sandbox._Capabilities(root=False)
    monkeypatch.setattr(sandbox, "_tasks_of", lambda uid: 90)
    monkeypatch.setattr(sandbox.resource, "getrlimit", lambda which: (100, 200))
    assert sandbox._rlimits(SandboxLimits(), caps, None)["NPROC"] == 100 - sandbox.ENGINE_ROOM
    monkeypatch.setattr(sandbox.resource, "getrlimit", lambda which: (sandbox.resource.RLIM_INFINITY,) * 2)
    assert sandbox._rlimits(SandboxLimits(), caps, None)["NPROC"] == 16 + 90 + 1  # 4 GiB: 16 processes
    monkeypatch.setattr(sandbox.resource, "getrlimit", lambda which: (20, 20))
    assert sandbox._rlimits(SandboxLimits(), caps, None)["NPROC"] == 1  # no room at all: the run alone


def test_a_host_that_forbids_core_dumps_still_runs_code() -> None:
    # A run's core limit is 1 (no helper of the host's for a crash), unless the engine's hard limit is
    # 0 already: raising it needs a capability, and the run keeps 0 rather than fail its setup.
    code = ("import asyncio, resource\nresource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
            "from engine.sandbox import SandboxLimits, run_python\n"
            "r = asyncio.run(run_python('import resource; print(resource.getrlimit(resource.RLIMIT_CORE))', "
            "SandboxLimits(timeout_s=10)))\nprint(r.returncode, r.stdout.strip())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "0 (0, 0)", done.stderr[-500:]
    assert asyncio.run(run_python("import resource; print(resource.getrlimit(resource.RLIMIT_CORE))",
                                  FAST)).stdout == "(1, 1)\n"


@pytest.fixture
def two_uids(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    """Runs without namespaces (the work dir on the host, as in a default container) on two uids."""
    if not ROOT:
        pytest.skip("a uid per run needs root")
    caps = sandbox._capabilities()
    pair = caps.uids[-4], caps.uids[-3]
    for uid in pair:
        lock = Path(sandbox.LOCK_DIR, str(uid))
        assert not (lock.exists() and lock.read_bytes().startswith(b"Q")), f"uid {uid} is quarantined on this host"
    bare = sandbox._Capabilities(root=True, uids=pair, cgroup=caps.cgroup, cgroup_parents=caps.cgroup_parents)
    monkeypatch.setattr(sandbox, "_caps", bare)
    monkeypatch.setattr(sandbox, "_reported", set())
    yield pair


def test_a_uid_that_cannot_be_cleaned_is_quarantined_and_reported_once(two_uids: tuple[int, int],
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    code = "import os, time\nopen('stuck', 'w').write('x')\nprint(os.getcwd(), os.getuid(), flush=True)\ntime.sleep(2)"

    async def main() -> tuple[sandbox.SandboxResult, str, int]:
        task = asyncio.create_task(run_python(code, FAST))
        for _ in range(200):  # the host makes the run's file immutable while it runs
            await asyncio.sleep(0.02)
            found = [p for p in Path("/tmp").glob("sandbox-*/stuck")]
            if found:
                break
        _immutable(str(found[0]), True)
        result = await task
        workdir, uid = result.stdout.split()
        return result, workdir, int(uid)

    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        result, workdir, uid = asyncio.run(main())
    lock = os.path.join(sandbox.LOCK_DIR, str(uid))
    try:
        assert result.returncode == 0 and not result.timed_out  # the run's answer stands
        with open(lock, "rb") as f:
            assert f.read(1) == b"Q"
        warnings = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
        assert len(warnings) == 1 and str(uid) in warnings[0] and "stuck" in warnings[0]
        other = set(two_uids) - {uid}
        for _ in range(3):  # never leased again, and reported once
            again = asyncio.run(run_python("import os\nprint(os.getuid())", FAST))
            assert int(again.stdout) in other
        assert sandbox.quarantined(two_uids) == 1
        probing.reset()
        assert probing.probe_sync().ok  # the probe is not poisoned
        assert len([r for r in caplog.records if "quarantined" in r.getMessage()]) == 1
    finally:
        probing.reset()
        _immutable(os.path.join(workdir, "stuck"), False)
        assert child.remove_tree(workdir) == ""
        os.truncate(lock, 0)


def test_a_crashed_engines_leftovers_that_cannot_be_removed_quarantine_the_uid_and_the_run_takes_another(
        two_uids: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = two_uids
    lock = os.path.join(sandbox.LOCK_DIR, str(first))
    left = Path("/tmp") / f"left-by-a-crash-{os.getpid()}"
    left.mkdir()
    stuck = left / "stuck"
    stuck.write_text("x")
    for path in (left, stuck):
        os.chown(path, first, first)
    try:
        _immutable(str(stuck), True)
    except OSError as e:
        left.joinpath("stuck").unlink()
        left.rmdir()
        pytest.skip(f"no immutable files here: {e}")
    try:
        with open(lock, "wb") as f:
            f.write(b"1")  # a crashed engine's run on that uid, never cleaned
        monkeypatch.setattr(sandbox, "_next_slot", 0)  # that uid is leased first
        result = asyncio.run(run_python("import os\nprint(os.getuid())", FAST))
        assert result.returncode == 0 and int(result.stdout) == second
        with open(lock, "rb") as f:
            said = f.read()
        assert said.startswith(b"Q ") and str(left).encode() in said
    finally:
        _immutable(str(stuck), False)
        assert child.remove_tree(str(left)) == ""
        os.truncate(lock, 0)


def test_every_uid_quarantined_is_a_clear_error(two_uids: tuple[int, int]) -> None:
    paths = [os.path.join(sandbox.LOCK_DIR, str(uid)) for uid in two_uids]
    try:
        for path in paths:
            with open(path, "wb") as f:
                f.write(b"Q left by a test")
        with pytest.raises(sandbox.SandboxError, match="quarantined"):
            asyncio.run(run_python("print(1)", FAST))
    finally:
        for path in paths:
            os.truncate(path, 0)


def test_a_killed_forker_leaves_nothing_and_the_next_call_runs() -> None:
    # The forker is every run's parent: killed (as an OOM kill would), its runs die with it, the
    # zygote cleans up after them and says so (a host failure, not the code's), then a new one serves.
    if not ROOT:
        pytest.skip("a uid per run needs root")
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
            "print(os.getppid(), os.getuid(), flush=True)\ntime.sleep(30)")

    async def run() -> tuple[BaseException | None, list[int], sandbox.SandboxResult]:
        task = asyncio.create_task(run_python(code, SandboxLimits(timeout_s=20)))
        uid = None
        while uid is None and not task.done():
            await asyncio.sleep(0.02)
            for pid in _pool_processes():
                parent = _ppid(pid)
                if parent and _uid(parent) == 0:
                    uid = _uid(pid)
                    os.kill(parent, signal.SIGKILL)
                    break
        try:
            await asyncio.wait_for(task, 30)
            error = None
        except sandbox.SandboxError as e:
            error = e
        return error, [p for p in _pool_processes() if _uid(p) == uid], await run_python("print(6 * 7)", FAST)

    error, left, after = asyncio.run(run())
    assert error is not None and "forker" in str(error)
    assert left == [] and after.stdout == "42\n"


def _pool_processes() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            uid = _uid(int(entry))
            if uid is not None and sandbox.UID_BASE <= uid < sandbox.UID_BASE + sandbox.UID_COUNT:
                found.append(int(entry))
    return found


def _uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return None if fields["State"].split()[0] == "Z" else int(fields["Uid"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


SCIENCE = """
import threading
import numpy, sympy
x = sympy.symbols('x')
box = []
worker = threading.Thread(target=lambda: box.append(float(numpy.linalg.solve([[2, 0], [0, 4]], [2, 8]).sum())))
worker.start()
worker.join()
print(box[0], sympy.integrate(x**2, (x, 0, 3)), sympy.factorint(2**32 + 1))
"""


@pytest.mark.skipif(importlib.util.find_spec("numpy") is None or importlib.util.find_spec("sympy") is None,
                    reason="numpy and sympy are in the dev extra; not installed here")
def test_numpy_sympy_and_threads_run_in_the_sandbox() -> None:
    t0 = time.monotonic()
    result = asyncio.run(run_python(SCIENCE, SandboxLimits(timeout_s=60)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "3.0 9 {641: 1, 6700417: 1}"
    assert time.monotonic() - t0 < 60
