"""Attacks on the sandbox's limits and on its cleanup: CPU, memory, processes, output, disk,
stdin, processes meant to outlive the call, and a neighbouring run.

Registered on import (see `engine.sandbox.attacks.suite`). Every bound in the attack programs (forks,
bytes, heartbeats) is there so that a sandbox weaker than expected hurts the host little.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import tempfile
import time
import uuid

from engine.sandbox.attacks.lab import PROJECT, Lab, Verdict, alive, attack, processes

_MIB = 1 << 20


@attack("infinite loop (+ busy child)")
async def infinite_loop(lab: Lab) -> Verdict:
    code = """
import os
# A forked child, not a new interpreter: the attack is the busy process, wherever python lives.
child = os.fork()
if child == 0:
    while True:
        pass
report(child=child)
while True:
    pass
"""
    t0 = time.monotonic()
    run = await lab.run(code, timeout_s=2.0)
    took, r, child = time.monotonic() - t0, run.result, run.facts.get("child")
    child_gone = isinstance(child, int) and not alive(child)
    if r.timed_out:
        how = f"wall-clock timeout {run.limits.timeout_s:g} s: process group SIGKILLed"
    elif r.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        how = f"RLIMIT_CPU {run.limits.cpu_seconds()} s: killed by signal {-r.returncode}"
    else:
        how = f"not stopped: exit code {r.returncode}"
    contained = (r.timed_out or r.returncode in (-signal.SIGXCPU, -signal.SIGKILL)) and child_gone
    return Verdict(contained, how, f"ended after {took:.1f} s; busy child {child} {'gone' if child_gone else 'ALIVE'}")


@attack("memory bomb")
async def memory_bomb(lab: Lab) -> Verdict:
    limit = 256 * _MIB
    code = f"""
try:
    big = bytearray(8 * 1024**3)
    report(big='allocated')
except MemoryError:
    report(big='MemoryError')
chunks = []
try:
    while len(chunks) < {4 * limit // 10**7}:  # 4x the limit: a bound in case no limit applies
        chunks.append(bytearray(10**7))
    report(chunks=len(chunks), stop='bound reached')
except MemoryError:
    report(chunks=len(chunks), stop='MemoryError')
"""
    run = await lab.run(code, memory_bytes=limit, timeout_s=10.0)
    f = run.facts
    got = f.get("chunks", 0) * 10**7
    contained = f.get("big") == "MemoryError" and f.get("stop") == "MemoryError" and got <= limit
    return Verdict(
        contained, f"RLIMIT_AS {limit // _MIB} MiB: allocation -> {f.get('stop', '?')}",
        f"8 GiB at once -> {f.get('big', '?')}; 10 MB chunks stopped at {got // 10**6} MB",
    )


@attack("fork bomb")
async def fork_bomb(lab: Lab) -> Verdict:
    limit = lab.base.max_processes
    code = f"""
import os, time
count, error = 0, 'bound reached'
try:
    while count < {4 * limit}:  # a bound in case RLIMIT_NPROC does not apply
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        count += 1
except OSError as e:
    error = err(e)
report(forks=count, error=error)
"""
    run = await lab.run(code)
    count, error = run.facts.get("forks", -1), run.facts.get("error", "?")
    contained = error == "EAGAIN" and 0 <= count < limit
    how = f"RLIMIT_NPROC {limit}: fork -> EAGAIN after {count} processes" if contained else (
        f"not stopped at {limit}: {count} forks ({error})")
    left = "SIGKILLed after the run" if run.result.killed else "none killed"
    return Verdict(contained, how, f"{count} sleeping children: {left}")


@attack("100 MB print")
async def huge_print(lab: Lab) -> Verdict:
    size = 100_000_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, a high-water mark
    t0 = time.monotonic()
    run = await lab.run(f"import sys\nsys.stdout.write('x' * {size})\n")
    took, r = time.monotonic() - t0, run.result
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
    kept = len(r.stdout.encode()) + len(r.stderr.encode())
    contained = r.returncode == 0 and r.truncated and kept <= 2 * run.limits.output_bytes and growth < 50
    return Verdict(
        contained, f"output cap: first {run.limits.output_bytes // 1024} KiB kept, the rest read and dropped",
        f"{r.dropped / 1e6:.1f} MB dropped in {took:.1f} s; engine peak RSS +{growth} MB",
    )


@attack("endless output")
async def output_flood(lab: Lab) -> Verdict:
    t0 = time.monotonic()
    run = await lab.run("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n", timeout_s=20.0)
    took, r = time.monotonic() - t0, run.result
    contained = r.killed and r.returncode is None and not r.timed_out
    read = (len(r.stdout) + r.dropped) // _MIB
    return Verdict(contained, f"output flood: SIGKILLed past {run.limits.drain_bytes // _MIB} MiB",
                   f"{read} MiB read in {took:.1f} s, {'before' if not r.timed_out else 'only at'} the timeout")


def _free_bytes(paths: list[str]) -> dict[int, int]:
    """Free bytes of each distinct filesystem among `paths`, by device."""
    return {os.stat(p).st_dev: shutil.disk_usage(p).free for p in paths if os.path.exists(p)}


@attack("fill the disk")
async def fill_disk(lab: Lab) -> Verdict:
    bound = 4 * lab.base.disk_bytes  # a bound in case no disk limit applies
    code = f"""
import errno, os, time
total, errors, block = 0, [], b'\\0' * (1 << 20)
for n in range(64):
    fd = os.open(f'fill{{n}}', os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while total < {bound}:
            total += os.write(fd, block)
    except OSError as e:
        errors.append(err(e))
    finally:
        os.close(fd)
    if total >= {bound} or not errors or errors[-1] != 'EFBIG':
        break  # anything but 'this file is full' ends the fill
report(total=total, errors=errors)
time.sleep(0.5)  # hold the data while the engine looks at the host's disks
"""
    watched = [tempfile.gettempdir(), "/", str(PROJECT)]
    before = _free_bytes(watched)
    task = asyncio.create_task(lab.run(code))
    low = dict(before)
    while not task.done():  # the lowest free space of each host filesystem during the run
        for dev, free in _free_bytes(watched).items():
            low[dev] = min(low.get(dev, free), free)
        await asyncio.sleep(0.05)
    run = task.result()
    total, errors = run.facts.get("total", 0), run.facts.get("errors", [])
    drop = max(before[d] - low.get(d, before[d]) for d in before)
    contained = bool(errors) and errors[-1] == "ENOSPC" and total < bound and drop < max(total // 2, 8 * _MIB)
    fsize = run.limits.max_file_bytes // _MIB
    how = (f"private tmpfs /tmp ({run.limits.disk_bytes // _MIB} MiB): write -> ENOSPC; RLIMIT_FSIZE {fsize} MiB: "
           "write -> EFBIG per file") if contained else f"not stopped: writes ended with {errors[-1:] or 'no error'}"
    return Verdict(contained, how, f"wrote {total // _MIB} MiB in {len(errors)} files; host free space "
                   f"-{drop // _MIB} MiB at worst during the run")


@attack("read stdin")
async def read_stdin(lab: Lab) -> Verdict:
    code = f"""
import os, select
ready = select.select([0], [], [], 1.0)[0]
data = os.read(0, 65536) if ready else None
report(fd0=os.readlink('/proc/self/fd/0'), got=None if data is None else len(data))
report(engine_stdin=attempt(open, '/proc/{lab.engine_pid}/fd/0', 'rb'))
"""
    run = await lab.run(code)
    f = run.facts
    contained = f.get("got") == 0 and f.get("fd0") == "/dev/null" and f.get("engine_stdin") != "ok"
    got = "EOF (0 bytes)" if f.get("got") == 0 else f"{f.get('got')} bytes" if f.get("got") else "nothing within 1 s"
    how = f"stdin is {f.get('fd0', '?')}: read -> {got}"
    if f.get("engine_stdin") == "ok":
        how = "the engine's own stdin is reachable through /proc/<engine>/fd/0"
    return Verdict(contained, how, f"fd 0 -> {f.get('fd0', '?')}; /proc/<engine>/fd/0 -> {f.get('engine_stdin', '?')}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass  # gone meanwhile


def _cleaner(lab: Lab) -> str:
    """The mechanism that kills processes which left the run's process group."""
    if lab.recent:  # the runs reported a uid of their own
        return "after the run, kill(-1, SIGKILL) as the run's uid"
    return "process group SIGKILL (no uid of its own; seccomp makes setsid a no-op, so none leaves the group)"


@attack("child ignoring SIGTERM")
async def sigterm_ignorer(lab: Lab) -> Verdict:
    code = """
import os, signal, time
child = os.fork()
if child == 0:  # its own session, SIGTERM ignored, bounded to 30 s
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(30)
    os._exit(0)
report(child=child)
"""
    run = await lab.run(code)
    child = run.facts.get("child")
    gone = isinstance(child, int) and not alive(child)
    if isinstance(child, int) and not gone:
        _kill(child)  # observed; now end it rather than leave it to its own timer
    return Verdict(gone and run.result.returncode == 0, _cleaner(lab),
                   f"pid {child} (own session, SIGTERM ignored) {'gone' if gone else 'ALIVE (killed by the harness)'} "
                   "after the call")


@attack("background daemon (double fork + setsid)")
async def daemon(lab: Lab) -> Verdict:
    tag = "hb" + uuid.uuid4().hex[:5]  # its heartbeat: the daemon renames itself tag<beat>
    code = f"""
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        for beat in range(300):  # 30 s of heartbeats unless something stops it
            libc('prctl', 15, ('{tag}' + str(beat)).encode(), 0, 0, 0)  # PR_SET_NAME
            with open('heartbeat', 'w') as f:
                f.write(str(beat))
            time.sleep(0.1)
    os._exit(0)
os.close(w)
report(daemon=int(os.read(r, 32)))
time.sleep(0.5)
"""
    task = asyncio.create_task(lab.run(code))
    seen: set[int] = set()
    while not task.done():  # the engine sees the heartbeat in the host's process table
        seen.update(processes(comm_prefix=tag))
        await asyncio.sleep(0.05)
    run = task.result()
    pid = run.facts.get("daemon")
    after = processes(comm_prefix=tag)
    await asyncio.sleep(0.5)
    after += processes(comm_prefix=tag)  # still none half a second later: the heartbeat stopped
    gone = isinstance(pid, int) and not alive(pid) and not after
    for stray in set(after):
        _kill(stray)  # observed; now end it rather than leave it beating for 30 s
    beat = "heartbeat seen during the call" if pid in seen else "heartbeat not seen during the call"
    return Verdict(gone, _cleaner(lab), f"daemon {pid}: {beat}, {'none' if gone else 'STILL BEATING'} after it")


@attack("kill a neighbouring run")
async def neighbour(lab: Lab) -> Verdict:
    tag = "nb" + uuid.uuid4().hex[:5]
    victim_code = f"""
import time
libc('prctl', 15, b'{tag}', 0, 0, 0)  # PR_SET_NAME: how the engine finds its pid
time.sleep(2.5)
report(survived=True)
"""
    victim = asyncio.create_task(lab.run(victim_code))
    found: list[int] = []
    for _ in range(100):  # wait for the victim's program to start
        if victim.done() or (found := processes(comm_prefix=tag)):
            break
        await asyncio.sleep(0.03)
    if not found:
        await victim
        return Verdict(False, "not observed: the neighbouring run was never seen", "")
    target = found[0]
    attacker = f"""
import os, signal
report(kill=attempt(os.kill, {target}, signal.SIGKILL), stop=attempt(os.kill, {target}, signal.SIGSTOP),
       ptrace=libc('ptrace', 0x4206, {target}, None, None),  # PTRACE_SEIZE: never leaves it stopped
       proc=attempt(open, '/proc/{target}/environ', 'rb'))
"""
    run = await lab.run(attacker)
    done = await victim
    f = run.facts
    tries = {k: f.get(k, "?") for k in ("kill", "stop", "ptrace", "proc")}
    survived = done.result.returncode == 0 and done.facts.get("survived") is True
    contained = survived and all(v not in ("ok", "?") for v in tries.values())
    where = "a uid per run" if contained else "not stopped"
    how = f"{where}: kill(neighbour) -> {tries['kill']}, ptrace -> {tries['ptrace']}"
    return Verdict(contained, how, f"neighbour {target} (uid {done.facts.get('uid')}) "
                   f"{'finished normally' if survived else 'DID NOT FINISH'}; /proc/<it> -> {tries['proc']}")
