"""A third round from outside the suite: what the host keeps for itself that no cgroup or uid
divides, and what a run could reach of a concurrent one.

The host's hugetlb pool (mmap's MAP_HUGETLB: pages no memory cgroup v1 counts), the count of
queued signals the kernel keeps per user (RLIMIT_SIGPENDING: without a uid per run, the engine's
user's), the memory of a concurrent run (process_vm_readv, /proc/<pid>/mem, pidfd_getfd), the
run's own /proc entries (leaving the OOM killer's first place) and a work dir left full of
entries that stall a naive cleanup (a FIFO, a sparse file, tens of thousands of files).

Registered on import (see `engine.sandbox.attacks.suite`), last. Each verdict is read from the
host: its free hugetlb pages, whether the engine's own process can still create a POSIX timer,
what the host's /proc says of the live run, whether the work dir is gone once the call returns
and the uid is still leased.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import time
import uuid

from engine.sandbox import runner
from engine.sandbox.attacks.lab import NAMED, Lab, Run, Verdict, attack, processes, status_field

DENIED = {"EPERM", "EACCES", "EROFS", "ENOENT", "ESRCH"}


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


async def _live(tag: str, task: asyncio.Task[Run], wait_s: float = 10.0) -> int | None:
    """The pid of the live run named `tag`, once it is there (None if the run ended first)."""
    deadline = time.monotonic() + wait_s
    while not task.done() and time.monotonic() < deadline:
        found = processes(comm_prefix=tag)
        if found:
            return found[0]
        await asyncio.sleep(0.02)
    return None


@attack("hugetlb pages outside the memory budget")
async def hugetlb(lab: Lab) -> Verdict:
    # The run and four children each ask for two huge pages: the host's pool is counted by no memory
    # cgroup v1 (nor v2 without memory_hugetlb_accounting), so what a host reserved for a trainer
    # would be the runs', beside their budget. A host without a pool answers ENOMEM: the call still
    # reached the pool, which is what is judged.
    tag = "hp" + uuid.uuid4().hex[:6]
    code = NAMED.format(tag=tag) + """
import mmap, time
def huge():
    held.append(mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000))  # MAP_HUGETLB
    held[-1][0] = 1
held = []
report(hugetlb=attempt(huge))
for i in range(4):
    if os.fork() == 0:
        attempt(huge)
        time.sleep(0.6)
        os._exit(0)
time.sleep(0.8)
"""
    free_before = _meminfo("HugePages_Free")
    task = asyncio.create_task(lab.run(code))
    lowest = free_before
    while not task.done():
        lowest = min(lowest, _meminfo("HugePages_Free"))
        await asyncio.sleep(0.02)
    outcome = (await task).facts.get("hugetlb", "?")
    taken = free_before - lowest
    contained = outcome == "EPERM" and taken == 0
    return Verdict(contained, f"mmap(MAP_HUGETLB) -> {outcome}" + (": seccomp refuses the host's pool" if contained else
                   ": the call reached the host's hugetlb pool, which no memory cgroup counts"),
                   f"host HugePages_Free {free_before} -> lowest {lowest} while it ran ({taken} taken; "
                   f"pool of {_meminfo('HugePages_Total')})")


_TIMER = ctypes.CDLL(None, use_errno=True)


def _engine_timer() -> str:
    """Whether this (the engine's) process can create a POSIX timer: it needs a queued signal."""
    timer = ctypes.c_void_p()
    if _TIMER.timer_create(1, None, ctypes.byref(timer)) != 0:  # CLOCK_MONOTONIC, SIGALRM on expiry
        return os.strerror(ctypes.get_errno())
    _TIMER.timer_delete(timer)
    return "ok"


@attack("queued signals that leave the engine's user none (RLIMIT_SIGPENDING)")
async def queued_signals(lab: Lab) -> Verdict:
    # The kernel counts queued signals per user, against the receiver's RLIMIT_SIGPENDING. Without
    # a uid per run the run's user is the engine's: a run that queues all it may leaves the engine
    # (and a trainer of the same user) no POSIX timer and no queued signal.
    tag = "sq" + uuid.uuid4().hex[:6]
    code = NAMED.format(tag=tag) + """
import signal, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})
queued = 0
try:
    while queued < 200000:
        os.kill(os.getpid(), signal.SIGRTMIN)
        queued += 1
except OSError as e:
    report(stopped=err(e))
report(queued=queued, sigq=[line.split()[1] for line in open('/proc/self/status') if line.startswith('SigQ')][0])
time.sleep(1.0)
"""
    task = asyncio.create_task(lab.run(code))
    pid, seen, engine = await _live(tag, task), "?", "not tried: the run was not seen"
    while pid is not None and not task.done():
        try:
            seen = status_field(pid, "SigQ")
            queued, limit = (int(n) for n in seen.split("/"))
        except (OSError, ValueError, StopIteration):
            break  # gone meanwhile
        if queued >= limit:  # the run holds all its limit lets it: now the engine's turn
            engine = _engine_timer()
            break
        await asyncio.sleep(0.02)
    run = await task
    contained = engine == "ok"
    return Verdict(contained, f"the engine's timer_create while the run held its queue -> {engine}",
                   f"the live run's SigQ {seen} (queued/its limit), the engine's RLIMIT_SIGPENDING "
                   f"{resource.getrlimit(resource.RLIMIT_SIGPENDING)[0]}; the run queued "
                   f"{run.facts.get('queued', '?')}")


@attack("memory of a concurrent run: process_vm_readv, /proc/<pid>/mem, pidfd_getfd")
async def concurrent_memory(lab: Lab) -> Verdict:
    # Without a uid per run, a concurrent run is the same user as the attacker (and the engine):
    # only the filter and Landlock stand between them.
    tag, secret = "cm" + uuid.uuid4().hex[:6], "cm-secret-" + uuid.uuid4().hex
    holder = NAMED.format(tag=tag) + f"""
import time
secret = {secret!r}.encode() * 64
time.sleep(1.5)
"""
    held = asyncio.create_task(lab.run(holder))
    pid = await _live(tag, held)
    address = 0x400000
    if pid is not None:
        try:
            with open(f"/proc/{pid}/maps") as f:  # the heap, where the secret lives
                address = next((int(line.split("-")[0], 16) for line in f if "[heap]" in line), address)
        except OSError:
            pass
    target = pid or lab.engine_pid
    code = f"""
import ctypes
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(1 << 20)
local = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 1 << 20)
remote = (ctypes.c_void_p * 2)({address}, 1 << 20)
def call(*args):
    return 'ok' if lib.syscall(*args) >= 0 else err(OSError(ctypes.get_errno(), ''))
def mem(pid):
    with open(f'/proc/{{pid}}/mem', 'rb') as f:
        f.seek({address})
        return f.read(1 << 20)
got = {{'process_vm_readv': call(310, {target}, local, 1, remote, 1, 0),
        'mem': attempt(mem, {target}), 'engine mem': attempt(mem, {lab.engine_pid}),
        'pidfd_open': call(434, {target}, 0), 'pidfd_getfd': call(438, 0, 0, 0),
        'kcmp': call(312, {target}, {lab.engine_pid}, 0, 0, 0)}}
report(got=got)
print(bytes(buf.raw).rstrip(b'\\0')[:4096].decode('latin-1'))
"""
    run = await lab.run(code)
    await held
    got = run.facts.get("got", {})
    leaked = secret in run.result.stdout
    through = [k for k, v in got.items() if v not in DENIED]
    contained = pid is not None and not leaked and not through and len(got) == 6
    return Verdict(contained, ", ".join(f"{k} -> {v}" for k, v in got.items()) or "the attack did not run",
                   f"the concurrent run's secret {'READ' if leaked else 'not read'} (pid {pid}, heap {address:#x})")


@attack("the run's own /proc: oom_score_adj, comm, attr, clear_refs")
async def own_proc(lab: Lab) -> Verdict:
    # A run is the OOM killer's first choice (oom_score_adj 1000). Without a uid per run it wrote
    # 1000 itself, unprivileged, so the kernel would let it write the engine's value back.
    tag = "op" + uuid.uuid4().hex[:6]
    code = NAMED.format(tag=tag) + """
import time
def write(name, value):
    with open('/proc/self/' + name, 'w') as f:
        f.write(value)
got = {name: attempt(write, name, value) for name, value in
       (('oom_score_adj', '0'), ('comm', 'python-engine'), ('attr/current', 'unconfined'), ('clear_refs', '5'),
        ('timerslack_ns', '1'), ('coredump_filter', '0x7f'))}
report(got=got)
time.sleep(0.4)
"""
    task = asyncio.create_task(lab.run(code))
    seen: set[tuple[str, str]] = set()
    while not task.done():
        for pid in processes(comm_prefix=tag) + processes(comm_prefix="python-engine"):
            try:
                with open(f"/proc/{pid}/oom_score_adj") as f:
                    seen.add((f.read().strip(), status_field(pid, "Name")))
            except (OSError, StopIteration):
                pass  # gone meanwhile
        await asyncio.sleep(0.02)
    got = (await task).facts.get("got", {})
    through = [k for k, v in got.items() if v not in DENIED]
    adjs, names = {a for a, _ in seen}, {n for _, n in seen}
    contained = bool(seen) and adjs == {"1000"} and not through and all(n.startswith(tag) for n in names)
    return Verdict(contained, ", ".join(f"{k} -> {v}" for k, v in got.items()) or "the attack did not run",
                   f"the live run seen by the host: oom_score_adj {sorted(adjs)}, name {sorted(names)}")


@attack("a FIFO, a sparse file and tens of thousands of files left in the work dir")
async def cleanup_litter(lab: Lab) -> Verdict:
    # A cleanup that opened what it removes would block on the FIFO; one on a clock would leave
    # entries behind (and quarantine the uid); one that followed the links would remove the host's.
    code = """
import os, time
os.mkfifo('fifo')
with open('sparse', 'wb') as f:
    f.truncate((16 << 20) - 1)  # RLIMIT_FSIZE allows it; no block is written
os.symlink('/', 'root')
os.symlink('loop', 'loop')
made, start = 0, time.monotonic()
try:
    for d in range(64):
        os.mkdir(f'd{d}')
        for i in range(2000):
            open(f'd{d}/{i}', 'w').close()
            made += 1
        if time.monotonic() - start > 1.5:
            break
except OSError as e:
    report(stopped=err(e))
report(made=made, cwd=os.getcwd())
"""
    before = runner.quarantined(tuple(sorted(lab.uids))) if lab.uids else 0
    t0 = time.monotonic()
    run = await lab.run(code, timeout_s=10.0)
    took = time.monotonic() - t0
    cwd = run.facts.get("cwd", "")
    # With a mount namespace the work dir lived on the run's own tmpfs: no host path to look at.
    left = bool(cwd) and cwd != runner.SANDBOX_DIR and os.path.lexists(cwd)
    after = runner.quarantined(tuple(sorted(lab.uids))) if lab.uids else 0
    again = await lab.run("report(again=True)")
    contained = bool(cwd) and not left and after == before and again.facts.get("again") is True
    return Verdict(contained, "removed without opening, following or timing out" if contained else
                   f"work dir {'LEFT' if left else 'gone'}, quarantined uids {before} -> {after}",
                   f"{run.facts.get('made', '?')} files ({run.facts.get('stopped', 'no error')}), a FIFO, a 16 MiB "
                   f"sparse file, links to / and to themselves; the call returned after {took:.1f} s; "
                   f"next run {'ok' if again.facts.get('again') else 'FAILED'}")
