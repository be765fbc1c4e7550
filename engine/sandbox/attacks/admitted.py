"""Attacks through what the allowlist admits, with arguments its table did not think of, and
through what the kernel shares beneath every run: a host file's flags set by `ioctl`, a
descriptor's signal owner aimed at the engine, a futex woken across runs, page tables of a sparse
address space, a crash's core dump, real-time scheduling and a raised CPU or I/O priority, the
stdin the engine hands over, and a chain of processes that each fork and exit at once, which no
scan of the process table catches, and fork bombs that leave the forker no room for the next run.

Registered on import (see `engine.sandbox.attacks.suite`), last. Each verdict is read from outside
the run: the host file's flags, the signals the engine received, when a concurrent run's wait
ended by the host's clock, and what the host's /proc says of the live run (its page tables, its
limits, its scheduling, the size of its stdin). A run that is watched live names itself with
`prctl(PR_SET_NAME)` so the engine finds it in the process table.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import fcntl
import os
import resource
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.sandbox import client, runner
from engine.sandbox.attacks.lab import NAMED, SITE, Lab, Run, Verdict, attack, processes, site_file, status_field

_MIB = 1 << 20
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS = 0x80086601, 0x40086602
FS_NODUMP_FL, FS_NOATIME_FL = 0x40, 0x80


async def _watch(task: asyncio.Task[Run], tag: str, read: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
    """While `task` runs: what `read(pid)` says, every 20 ms, of the live process named `tag`."""
    seen = []
    while not task.done():
        for pid in processes(comm_prefix=tag):
            try:
                seen.append(read(pid))
            except (OSError, ValueError, StopIteration):
                pass  # gone meanwhile
        await asyncio.sleep(0.02)
    return seen


def _limit(pid: int, name: str) -> str:
    """The soft and hard value of one row of /proc/<pid>/limits ("Max core file size" ...)."""
    with open(f"/proc/{pid}/limits") as f:
        return " ".join(next(line[len(name):].split()[:2] for line in f if line.startswith(name)))


def _flags(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf)
        return int(buf[0])
    finally:
        os.close(fd)


@attack("file flags of a host file through ioctl (chattr)")
async def ioctl_flags(lab: Lab) -> Verdict:
    # A file of the engine's own user: FS_IOC_SETFLAGS needs ownership only, never a descriptor open for writing.
    try:
        path = site_file("attack-flags")
        before = _flags(path)
    except OSError as e:
        return Verdict(True, f"nothing to attack: the engine's user cannot write or query {SITE} ({e.strerror})", "")
    code = f"""
import ctypes, os
lib = ctypes.CDLL(None, use_errno=True)
def ioctl(fd, request, buf):
    return 'ok' if lib.ioctl(fd, ctypes.c_ulong(request), ctypes.byref(buf)) == 0 else err(OSError(ctypes.get_errno(), ''))
try:
    fd = os.open({path!r}, os.O_RDONLY)
    flags = ctypes.c_long(0)
    got = ioctl(fd, {FS_IOC_GETFLAGS}, flags)
    flags.value |= {FS_NODUMP_FL | FS_NOATIME_FL}
    fsx = ctypes.create_string_buffer(28)  # struct fsxattr: its project id, through FS_IOC_FSSETXATTR
    lib.ioctl(fd, ctypes.c_ulong(0x801C581F), fsx)
    fsx[12:16] = (4242).to_bytes(4, 'little')
    project = 'ok' if lib.ioctl(fd, ctypes.c_ulong(0x401C5820), fsx) == 0 else err(OSError(ctypes.get_errno(), ''))
    report(open='ok', getflags=got, fssetxattr=project, setflags=ioctl(fd, {FS_IOC_SETFLAGS}, flags))
except OSError as e:
    report(open=err(e))
"""
    try:
        run = await lab.run(code)
        after = _flags(path)
    finally:
        os.unlink(path)
    f = run.facts
    contained = "open" in f and after == before
    return Verdict(contained, f"open -> {f.get('open')}, FS_IOC_SETFLAGS -> {f.get('setflags', '-')}, "
                   f"FS_IOC_FSSETXATTR -> {f.get('fssetxattr', '-')}",
                   f"host file flags {before:#x} -> {after:#x}{' CHANGED' if after != before else ''}")


@attack("a descriptor's signal owner: SIGIO and SIGURG at the engine")
async def signal_owner(lab: Lab) -> Verdict:
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _: got.append(s)) for sig in (signal.SIGIO, signal.SIGURG)}
    # The engine's pid and its process group: F_SETOWN is refused, the ioctls that do the same are
    # FIOSETOWN and SIOCSPGRP; O_ASYNC sends SIGIO on data, out-of-band data SIGURG.
    code = f"""
import ctypes, fcntl, os, socket, time
lib = ctypes.CDLL(None, use_errno=True)
tries = {{}}
for target, request in (({os.getpid()}, 0x8901), (-{os.getpgrp()}, 0x8902)):
    a, b = socket.socketpair()
    owner = ctypes.c_int(target)
    tries['%x' % request] = 'ok' if lib.ioctl(a.fileno(), ctypes.c_ulong(request), ctypes.byref(owner)) == 0 \\
        else err(OSError(ctypes.get_errno(), ''))
    tries['O_ASYNC'] = attempt(fcntl.fcntl, a.fileno(), fcntl.F_SETFL, os.O_ASYNC)
    b.send(b'x')
    tries['MSG_OOB'] = attempt(b.send, b'!', socket.MSG_OOB)
    globals().setdefault('keep', []).append((a, b))
time.sleep(0.3)
report(tries=tries)
"""
    try:
        run = await lab.run(code)
        await asyncio.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    tries = run.facts.get("tries", {})
    contained = bool(tries) and not got
    return Verdict(contained, f"FIOSETOWN -> {tries.get('8901', '-')}, SIOCSPGRP -> {tries.get('8902', '-')}, "
                   f"O_ASYNC -> {tries.get('O_ASYNC', '-')}, MSG_OOB -> {tries.get('MSG_OOB', '-')}",
                   f"the engine received {[signal.Signals(s).name for s in got] or 'no signal'}")


# A word of the interpreter's own code: a page of a file every run maps, whose futex the kernel
# keys by the file (not by the process) when the operation is not FUTEX_PRIVATE.
FUTEX_WORD = """
import ctypes, time
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
addr = (ctypes.cast(ctypes.pythonapi.Py_Initialize, ctypes.c_void_p).value & ~0xFFF) + 0x40
"""
WAITER = FUTEX_WORD + """
class Timespec(ctypes.Structure):
    _fields_ = [('s', ctypes.c_long), ('ns', ctypes.c_long)]
value = ctypes.c_uint32.from_address(addr).value
r = lib.syscall(202, ctypes.c_void_p(addr), 0, ctypes.c_uint32(value), ctypes.byref(Timespec(4, 0)), None, 0)
report(wait='woken' if r == 0 else err(OSError(ctypes.get_errno(), '')))  # FUTEX_WAIT, shared
"""
WAKER = FUTEX_WORD + """
woken, deadline = 0, time.monotonic() + 1.5
while time.monotonic() < deadline and not woken:
    woken = lib.syscall(202, ctypes.c_void_p(addr), 1, 1, None, None, 0)  # FUTEX_WAKE, shared
    time.sleep(0.005)
report(woke=woken if woken >= 0 else err(OSError(ctypes.get_errno(), '')))
"""


@attack("a futex woken across runs through a shared file page")
async def futex_across_runs(lab: Lab) -> Verdict:
    waiter = asyncio.create_task(lab.run(WAITER, timeout_s=10.0))
    await asyncio.sleep(0.6)
    waker = await lab.run(WAKER)
    waker_done = time.monotonic()
    run = await waiter
    lag = time.monotonic() - waker_done  # woken: it ended with the waker; else its 4 s wait ran out
    woken = run.facts.get("wait") == "woken" and lag < 1.5
    return Verdict(not woken and "wait" in run.facts,
                   "not holdable: the kernel keys a futex on a file page by the file, and every run maps "
                   "the interpreter's" if woken else f"FUTEX_WAKE -> {waker.facts.get('woke')}",
                   f"the waiting run ended {lag:.2f} s after the waking one (its wait: {run.facts.get('wait')}; "
                   f"the waker woke {waker.facts.get('woke')})")


@attack("page tables of a sparse address space")
async def page_tables(lab: Lab) -> Verdict:
    budget = 64 * _MIB
    tag = "pt" + uuid.uuid4().hex[:6]
    # One page every GiB, each touched: the kernel holds a page of PTEs and one of PMDs for every 4 KiB
    # of address space, which RLIMIT_AS does not count (a memory cgroup does).
    code = NAMED.format(tag=tag) + """
import mmap, time
lib = ctypes.CDLL(None, use_errno=True)
lib.mmap.restype = ctypes.c_void_p
lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
mapped, stop = 0, 'none'
while mapped < 30000:
    want = (1 << 40) + mapped * (1 << 30)
    got = lib.mmap(want, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000, -1, 0)
    if got != want:  # MAP_FIXED_NOREPLACE refused, or the address space limit reached
        stop = err(OSError(ctypes.get_errno(), ''))
        break
    ctypes.c_char.from_address(got).value  # a read: the zero page, but page tables for it
    mapped += 1
report(mapped=mapped, stop=stop)
time.sleep(0.4)
"""
    task = asyncio.create_task(lab.run(code, memory_bytes=budget, timeout_s=10.0))
    seen = await _watch(task, tag, lambda pid: {"pte": int(status_field(pid, "VmPTE").split()[0]) * 1024,
                                                "oom": int(Path(f"/proc/{pid}/oom_score_adj").read_text())})
    run = task.result()
    peak = max((s["pte"] for s in seen), default=0)
    oom = sorted({s["oom"] for s in seen})
    contained = bool(seen) and peak <= budget
    how = ("a memory cgroup counts page tables: the run stopped at its limit" if contained else
           "not holdable by rlimits: RLIMIT_AS counts address space, not the page tables behind it")
    return Verdict(contained, how, f"{run.facts.get('mapped', '?')} pages mapped a GiB apart; the run's page tables "
                   f"{peak // _MIB} MiB at most, budget {budget // _MIB} MiB; exit {run.result.returncode}; "
                   f"oom_score_adj {oom or '?'} (the OOM killer's first choice at 1000)")


def _core_pattern() -> str:
    try:
        with open("/proc/sys/kernel/core_pattern") as f:
            return f.read().strip()
    except OSError:
        return "?"


@attack("a crash's core dump")
async def core_dump(lab: Lab) -> Verdict:
    tag = "cd" + uuid.uuid4().hex[:6]
    # Where core_pattern pipes a crash to a helper (`|...`, or a socket `@...`), the kernel runs that
    # helper as root on the host for any core limit but 1; 0 stops only a core file.
    code = NAMED.format(tag=tag) + """
import resource, time
def setrlimit(value):
    try:
        resource.setrlimit(resource.RLIMIT_CORE, value)
        return 'ok'
    except (OSError, ValueError) as e:  # ValueError: Python's word for EPERM here
        return err(e) if isinstance(e, OSError) else 'EPERM'
tries = {'lower': setrlimit((0, 0)), 'raise': setrlimit((-1, -1)), 'dumpable': libc('prctl', 4, 1, 0, 0, 0)}
report(tries=tries, limit=resource.getrlimit(resource.RLIMIT_CORE))
time.sleep(0.4)
os.abort()
"""
    task = asyncio.create_task(lab.run(code))
    seen = await _watch(task, tag, lambda pid: {"core": _limit(pid, "Max core file size")})
    run = task.result()
    limits = sorted({s["core"] for s in seen})
    pattern = _core_pattern()
    piped = pattern.startswith(("|", "@"))
    # 1 is "never dump" for every core_pattern; 0 only where the pattern names a file.
    contained = len(limits) == 1 and (limits[0] == "1 1" or (limits[0] == "0 0" and not piped))
    tries = run.facts.get("tries", {})
    return Verdict(contained, f"RLIMIT_CORE {limits[0] if len(limits) == 1 else limits} for the whole run, seen by the "
                   f"host (setting it to 0 -> {tries.get('lower', '-')}, to unlimited -> {tries.get('raise', '-')})",
                   f"core_pattern {pattern!r}; the run ended {run.result.returncode} (SIGABRT is -6)")


_LIBC = ctypes.CDLL(None, use_errno=True)
IOPRIO_CLASS_RT, IOPRIO_CLASS_BE, IOPRIO_BE_DEFAULT = 1, 2, 4


def _ioprio(pid: int) -> int:
    """ioprio_get(IOPRIO_WHO_PROCESS, pid): class << 13 | level."""
    got = _LIBC.syscall(252, 1, pid)
    if got < 0:
        raise OSError(ctypes.get_errno(), "ioprio_get")
    return int(got)


def _io_not_above_default(ioprio: int) -> bool:
    """Neither real-time nor best effort above a nice-0 process's level (4); none and idle are fine."""
    cls, level = ioprio >> 13, ioprio & 7
    return cls != IOPRIO_CLASS_RT and not (cls == IOPRIO_CLASS_BE and level < IOPRIO_BE_DEFAULT)


@attack("real-time scheduling and a raised priority")
async def scheduling(lab: Lab) -> Verdict:
    tag = "rt" + uuid.uuid4().hex[:6]
    code = NAMED.format(tag=tag) + """
import resource, time
lib = ctypes.CDLL(None, use_errno=True)
def ioprio(value):  # ioprio_set(IOPRIO_WHO_PROCESS, itself, value): no capability needed for best effort
    if lib.syscall(251, 1, 0, value) != 0:
        raise OSError(ctypes.get_errno(), 'ioprio_set')
tries = {'fifo': attempt(os.sched_setscheduler, 0, os.SCHED_FIFO, os.sched_param(1)),
         'nice': attempt(os.setpriority, os.PRIO_PROCESS, 0, -5), 'ioprio': attempt(ioprio, 2 << 13 | 0)}
try:
    resource.setrlimit(resource.RLIMIT_RTPRIO, (1, 1))
    tries['rlimit'] = 'ok'
except (OSError, ValueError) as e:  # ValueError: Python's word for EPERM here
    tries['rlimit'] = err(e) if isinstance(e, OSError) else 'EPERM'
report(tries=tries)
time.sleep(0.4)
"""
    task = asyncio.create_task(lab.run(code))
    seen = await _watch(task, tag, lambda pid: {"policy": os.sched_getscheduler(pid),
                                                "nice": os.getpriority(os.PRIO_PROCESS, pid),
                                                "ioprio": _ioprio(pid),
                                                "rtprio": _limit(pid, "Max realtime priority"),
                                                "nicelimit": _limit(pid, "Max nice priority")})
    run = task.result()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    policies = {s["policy"] for s in seen}
    nices = {s["nice"] for s in seen}
    ioprios = {s["ioprio"] for s in seen}
    contained = (bool(seen) and policies <= {os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE} and min(nices) >= mine
                 and all(_io_not_above_default(p) for p in ioprios))
    tries = run.facts.get("tries", {})
    return Verdict(contained, f"SCHED_FIFO -> {tries.get('fifo', '-')}, nice -5 -> {tries.get('nice', '-')}, "
                   f"raising RLIMIT_RTPRIO -> {tries.get('rlimit', '-')}, "
                   f"I/O best effort 0 -> {tries.get('ioprio', '-')}",
                   f"the live run: policies {sorted(policies)}, nice {sorted(nices)} (the engine's {mine}), "
                   f"I/O priorities {sorted(f'{p >> 13}/{p & 7}' for p in ioprios)} (class/level), "
                   f"limits rtprio {sorted({s['rtprio'] for s in seen})}, nice {sorted({s['nicelimit'] for s in seen})}")


@attack("writing into the stdin the engine hands over")
async def stdin_memfd(lab: Lab) -> Verdict:
    tag = "si" + uuid.uuid4().hex[:6]
    given = b"cells\n" * 10
    code = NAMED.format(tag=tag) + """
import time
tries = {'write': attempt(os.pwrite, 0, b'y' * 4096, 0), 'grow': attempt(os.ftruncate, 0, 16 << 20),
         'shrink': attempt(os.ftruncate, 0, 0)}
report(tries=tries)
time.sleep(0.4)
"""
    task = asyncio.create_task(lab.run(code, stdin=given))
    seen = await _watch(task, tag, lambda pid: {"size": os.stat(f"/proc/{pid}/fd/0").st_size})
    run = task.result()
    sizes = sorted({s["size"] for s in seen})
    tries = run.facts.get("tries", {})
    contained = sizes == [len(given)] and "write" in tries
    return Verdict(contained, f"sealed: write -> {tries.get('write', '-')}, grow -> {tries.get('grow', '-')}, "
                   f"shrink -> {tries.get('shrink', '-')}",
                   f"the run's stdin seen from the host: {sizes or '?'} bytes (handed {len(given)})")


@attack("a fork chain that outruns every scan of the process table")
async def fork_chain(lab: Lab) -> Verdict:
    tag = "fc" + uuid.uuid4().hex[:6]
    # Each process forks its successor and exits at once: the live one is a new pid at every instant,
    # never where a listing of /proc (or of a cgroup) looks. The run itself ends at once.
    code = NAMED.format(tag=tag) + """
if os.fork() == 0:
    os.setsid()  # out of the run's process group too, where the run has a uid of its own
    while True:
        try:
            if os.fork() != 0:
                os._exit(0)
        except OSError:
            pass
"""
    run = await lab.run(code)
    seen = []
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # a chain keeps showing new pids; a dead one shows none
        seen += [p for p in processes(comm_prefix=tag) if p not in seen]
        await asyncio.sleep(0.02)
    for _ in range(50):  # observed: now end what is left, by its process group (atomic with respect to fork)
        left = processes(comm_prefix=tag)
        if not left:
            break
        for pid in left:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except OSError:
                pass
        await asyncio.sleep(0.01)
    contained = not seen
    return Verdict(contained, "after the run, kill(-1) as its uid (atomic with respect to fork) whenever any "
                   "process of the uid is left, however a scan saw it; or the process group, kept whole",
                   f"{len(seen)} processes of the chain seen in the 0.5 s after the call returned (exit "
                   f"{run.result.returncode}, killed {run.result.killed})")


def _forker() -> int | None:
    """The pid of this engine's forker (the zygote's child that is a python process), if running."""
    z = client.current()
    if z is None:
        return None
    for task in os.listdir(f"/proc/{z.proc.pid}/task"):
        with open(f"/proc/{z.proc.pid}/task/{task}/children") as f:
            for pid in map(int, f.read().split()):
                if Path(f"/proc/{pid}/comm").read_text().strip().startswith("python"):
                    return pid
    return None


BOMB = """
import time
made = 0
while True:
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        made += 1
    except OSError:
        break
report(made=made)
time.sleep(1.5)
"""


@attack("fork bombs that leave the forker no room for the next run")
async def no_room_to_fork(lab: Lab) -> Verdict:
    # Where RLIMIT_NPROC counts all of a user's processes (an ordinary user's engine), concurrent fork
    # bombs hold what the limit allows: the forker's fork of the next run fails, and the engine's own
    # threads. Here the forker's soft limit is lowered to a little above what the user holds now, the
    # engine's to that and its room (a cluster's `ulimit -u` near them), and both restored after. As
    # root the limit does not apply to the forker or the engine: nothing to take away.
    await lab.run("report(ready=True)\n")  # the zygote and its forker are up
    forker = _forker()
    if forker is None:
        return Verdict(False, "not observed: no forker found", "")
    before = resource.prlimit(forker, resource.RLIMIT_NPROC)
    mine = resource.getrlimit(resource.RLIMIT_NPROC)
    room = runner._tasks_of(os.getuid()) + 8
    resource.prlimit(forker, resource.RLIMIT_NPROC, (room, before[1]))
    resource.setrlimit(resource.RLIMIT_NPROC, (room + runner.ENGINE_ROOM, mine[1]))  # the engine's own: runs stay below
    try:
        bombs = [asyncio.create_task(lab.run(NAMED.format(tag="nr") + BOMB)) for _ in range(2)]
        await asyncio.sleep(0.8)
        try:
            asked = time.monotonic()
            later = await lab.run("report(answer=6 * 7)\n", timeout_s=10.0)
            outcome = f"the next run answered {later.facts.get('answer')} after {time.monotonic() - asked:.1f} s"
            answered = later.facts.get("answer") == 42
        except runner.SandboxError as e:
            outcome, answered = f"the next run raised SandboxError: {str(e)[:80]}", False
        try:  # the engine itself: a thread of its own while the bombs hold their processes
            await asyncio.to_thread(threading.Thread(target=lambda: None).start)
            thread = "started"
        except RuntimeError as e:
            thread = f"NOT started ({e})"
        done = await asyncio.gather(*bombs, return_exceptions=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NPROC, mine)
        try:
            resource.prlimit(forker, resource.RLIMIT_NPROC, before)
        except OSError:
            pass  # the forker is gone
    made = [d.facts.get("made") if isinstance(d, Run) else type(d).__name__ for d in done]
    same = _forker() == forker
    contained = answered and same and all(isinstance(d, Run) for d in done) and thread == "started"
    how = ("runs stop short of the engine's own process limit; a fork the forker cannot make waits for room "
           "(within the run's timeout); the forker and every other run stay" if contained else
           "NOT contained: a fork without room took the forker (and every run in flight) or the engine's threads")
    return Verdict(contained, how,
                   f"bombs made {made} processes; {outcome}; the forker {'is the same' if same else 'DIED'}; "
                   f"a thread of the engine {thread}")
