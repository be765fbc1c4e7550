"""Attacks on what the kernel keeps beyond one process: memory spread over many processes,
shared memory (SysV, POSIX shm, memfd), SysV objects seen by a concurrent run, keyrings
left for the next run of a uid, a uid leased again by another engine process after a
crash, and an interpreter installed where the sandbox hides things (a venv under /tmp).

Registered on import (see `engine.sandbox.attacks.suite`). Every verdict rests on what the
engine sees from outside: the host's process table and memory counters, /proc/sysvipc,
/proc/key-users, and what a second, separate run could find.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs

from engine.sandbox import child
from engine.sandbox import runner as sandbox
from engine.sandbox.attacks.lab import PRELUDE, PROJECT, Lab, Verdict, alive, attack, processes

_MIB = 1 << 20
SYS = {"x86_64": {"add_key": 248, "keyctl": 250}, "aarch64": {"add_key": 217, "keyctl": 219}}.get(platform.machine(), {})


def _pss(pids: list[int]) -> int:
    """Proportional set size of `pids` together (shared pages counted once), in bytes."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration, ValueError):
            pass  # gone meanwhile
    return total


def _settled_pss(comm_prefix: str) -> int:
    """PSS of the processes named `comm_prefix...` together, or 0 when one of them exited while
    they were read: a scan is not one instant, and memory a child killed after its reading
    frees can be taken by one read later, counting it twice (292 MiB seen under load, limit 256)."""
    pids = processes(comm_prefix=comm_prefix)
    total = _pss(pids)
    return total if set(pids) <= set(processes(comm_prefix=comm_prefix)) else 0


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


async def _watch(task: asyncio.Task[object], sample: object) -> int:
    """Poll `sample()` every 20 ms while `task` runs; the highest value seen."""
    peak = 0
    while not task.done():
        peak = max(peak, sample())  # type: ignore[operator]
        await asyncio.sleep(0.02)
    return peak


@attack("memory spread over 6 processes")
async def memory_across_processes(lab: Lab) -> Verdict:
    limit, each, tag = 256 * _MIB, 200 * _MIB, "mem" + uuid.uuid4().hex[:5]
    code = f"""
import os, time
kids, refused = [], None
for i in range(6):  # each child stays under the per-process limit; together 4.7x the run's
    try:
        pid = os.fork()
    except OSError as e:
        refused = err(e)
        break
    if pid == 0:
        libc('prctl', 15, b'{tag}', 0, 0, 0)  # PR_SET_NAME: how the engine finds them
        try:
            block = bytearray({each})
            for j in range(0, len(block), 4096):
                block[j] = 1  # touched: resident, not just reserved
            time.sleep(1.0)
            os._exit(0)
        except MemoryError:
            os._exit(3)
    kids.append(pid)
report(codes=[os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids], refused=refused)
"""
    task = asyncio.create_task(lab.run(code, memory_bytes=limit, timeout_s=20.0))
    peak = await _watch(task, lambda: _settled_pss(tag))
    run = task.result()
    codes, refused = run.facts.get("codes", []), run.facts.get("refused")
    held = sum(1 for c in codes if c == 0)
    stopped = [c for c in codes if c != 0]
    # PSS also carries a share of the pages each child shares with the zygote (preloaded
    # modules, charged to the zygote, not the run): 32 MiB of slack for them.
    contained = peak <= limit + 32 * _MIB and held * each <= limit and (stopped or refused)
    kind = sandbox._capabilities().cgroup
    how = (f"cgroup {kind} memory {limit // _MIB} MiB for the whole run: "
           f"{len(stopped)} of {len(codes)} children stopped ({sorted(set(stopped))})") if kind != "rlimits" else (
        f"per-process limits sized to the budget: fork -> {refused}")
    return Verdict(bool(contained), how if contained else f"not bounded: {held} children held {each // _MIB} MiB",
                   f"peak {peak // _MIB} MiB resident across the run's processes (PSS), limit {limit // _MIB} MiB")


_FILLS = {
    # A SysV segment per 16 MiB, attached and written (resident), never removed: it would
    # outlive the run in the host's IPC namespace.
    "sysv": """
seg = lib.shmget(0, 16 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
if seg < 0:
    raise OSError(ctypes.get_errno(), 'shmget')
addr = lib.shmat(seg, None, 0)
if addr in (None, ctypes.c_void_p(-1).value):
    raise OSError(ctypes.get_errno(), 'shmat')
ctypes.memset(addr, 1, 16 << 20)
""",
    "memfd": """
keep.append(os.memfd_create('x'))
for _ in range(16):
    os.write(keep[-1], b'1' * (1 << 20))
""",
    "/dev/shm": """
with open(f'/dev/shm/TAG-{len(keep)}', 'wb') as f:
    keep.append(f.name)
    for _ in range(16):
        f.write(b'1' * (1 << 20))
""",
}


@attack("shared memory: SysV, memfd, /dev/shm")
async def shared_memory(lab: Lab) -> Verdict:
    limit, target = 256 * _MIB, 1024 * _MIB
    before = _meminfo("Shmem")
    peak, taken, stops, pids = 0, {}, {}, set()
    tag = f"attack-{uuid.uuid4().hex[:8]}"
    for kind, step in _FILLS.items():  # one run each: a kill in one must not hide the others
        step = step.replace("TAG", tag)
        code = f"""
import ctypes, os
lib = ctypes.CDLL(None, use_errno=True)
lib.shmat.restype = ctypes.c_void_p
keep, total = [], 0
def step():
{textwrap.indent(step, '    ')}
try:
    while total < {target}:
        step()
        total += 16 << 20
        report(mib=total >> 20)
    report(stop='bound reached')
except OSError as e:
    report(stop=err(e))
"""
        task = asyncio.create_task(lab.run(code, memory_bytes=limit, timeout_s=20.0))
        peak = max(peak, await _watch(task, lambda: _meminfo("Shmem") - before))
        run = task.result()
        pids.add(run.facts.get("pid"))
        taken[kind] = run.facts.get("mib", 0)
        stops[kind] = run.facts.get("stop") or ("SIGKILL" if run.result.returncode == -signal.SIGKILL else
                                                 f"exit {run.result.returncode}")
    await asyncio.sleep(0.2)  # a freed namespace's segments go a moment after its last process
    left = _meminfo("Shmem") - before
    _remove_litter(tag, pids)  # observed; now free what a weaker sandbox left on the host
    contained = all(mib * _MIB <= limit for mib in taken.values()) and peak <= limit + 32 * _MIB \
        and left <= 32 * _MIB
    refused = all(mib == 0 for mib in taken.values())
    how = ("refused: SysV and memfd by seccomp, /dev/shm by Landlock or the read-only host" if contained and refused
           else "cgroup memory counts SysV, memfd and tmpfs pages; namespaces free them with the run" if contained
           else "shared memory outside the run's budget")
    got = ", ".join(f"{k} {taken[k]} MiB ({stops[k]})" for k in taken)
    return Verdict(contained, how, f"{got} of {target // _MIB} MiB tried, limit {limit // _MIB} MiB; host Shmem "
                   f"+{peak // _MIB} MiB at peak, +{left // _MIB} MiB after")


def _remove_litter(tag: str | None, pids: set[object]) -> None:
    """Remove the attack's /dev/shm files and the SysV segments its runs created on the host."""
    for name in os.listdir("/dev/shm") if tag else []:
        if name.startswith(tag):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))
    for kind, fields in child.sysv_objects():
        if kind == "shm" and int(fields["cpid"]) in pids:
            ctypes.CDLL(None).shmctl(int(fields["shmid"]), 0, None)  # IPC_RMID


def _host_sysv(uids: range) -> list[str]:
    """The host's SysV objects owned by a sandbox uid (the host's IPC namespace)."""
    return [f"{kind} {fields[child.SYSV_ID[kind]]}" for kind, fields in child.sysv_objects() if int(fields["uid"]) in uids]


@attack("SysV segment read by a concurrent run")
async def sysv_between_runs(lab: Lab) -> Verdict:
    key, secret = 0x5EED0000 | os.getpid() & 0xFFFF, uuid.uuid4().hex
    owner = f"""
import ctypes, time
lib = ctypes.CDLL(None, use_errno=True)
lib.shmat.restype = ctypes.c_void_p
seg = lib.shmget({key}, 4096, 0o1666)  # IPC_CREAT, readable and writable by everyone
if seg < 0:
    report(seg=err(OSError(ctypes.get_errno(), '')))  # refused: nothing to share
else:
    addr = lib.shmat(seg, None, 0)
    ctypes.memmove(addr, b'{secret}', 32)
    report(seg=seg)
time.sleep(2.0)
"""
    reader = f"""
import ctypes
lib = ctypes.CDLL(None, use_errno=True)
lib.shmat.restype = ctypes.c_void_p
by_key = lib.shmget({key}, 0, 0)
report(by_key=err(OSError(ctypes.get_errno(), '')) if by_key < 0 else by_key)
found = ''
for seg in range(0, 65536):  # ids of a namespace start low: try them all
    addr = lib.shmat(seg, None, 0o10000)  # SHM_RDONLY
    if addr not in (None, ctypes.c_void_p(-1).value):
        found += ctypes.string_at(addr, 32).decode(errors='replace')
try:
    with open('/proc/sysvipc/shm') as f:
        listed = len(f.read().splitlines()) - 1
except OSError as e:
    listed = err(e)
report(found=found, listed=listed)
"""
    first = asyncio.create_task(lab.run(owner))
    await asyncio.sleep(0.8)
    second = await lab.run(reader)
    own = await first
    uids = range(sandbox.UID_BASE, sandbox.UID_BASE + sandbox.UID_COUNT)
    on_host = _host_sysv(uids)
    f = second.facts
    _remove_litter(None, {own.facts.get("pid")})
    refused = f.get("by_key") == "EPERM" and own.facts.get("seg") == "EPERM"  # seccomp: no SysV at all
    contained = "seg" in own.facts and "found" in f and secret not in f.get("found", "") \
        and (f.get("by_key") == "ENOENT" or refused) and not on_host
    where = ("seccomp: SysV IPC refused" if refused else "IPC namespace per run") if contained else "not isolated"
    return Verdict(contained, f"{where}: shmget(its key) -> {f.get('by_key')}, {f.get('listed')} segments listed",
                   f"secret {'READ' if secret in f.get('found', '') else 'not found'} by the concurrent run; "
                   f"sandbox SysV objects left on the host: {on_host or 'none'}")


@contextlib.contextmanager
def _one_uid() -> Iterator[int]:
    """Every run in the block gets the same uid (the last of the pool), as a reused lease would."""
    caps = sandbox._capabilities()
    uid = caps.uids[-1]
    sandbox._caps = attrs.evolve(caps, uids=(uid,))
    try:
        yield uid
    finally:
        sandbox._caps = caps


def _key_users(uid: int) -> str:
    with open("/proc/key-users") as f:
        return next((line.strip() for line in f if line.split(":", 1)[0].strip() == str(uid)), "")


_KEYS = """
import ctypes
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
def add(desc, payload, ring):
    r = lib.syscall({add_key}, b'user', desc, payload, len(payload), ctypes.c_long(ring))
    return 'ok' if r >= 0 else err(OSError(ctypes.get_errno(), ''))
def search(desc, ring):
    r = lib.syscall({keyctl}, 10, ctypes.c_long(ring), b'user', desc, 0)  # KEYCTL_SEARCH
    return 'FOUND' if r >= 0 else err(OSError(ctypes.get_errno(), ''))
persistent = lib.syscall({keyctl}, 22, -1, 0)  # KEYCTL_GET_PERSISTENT: kept for days
"""


@attack("keyrings left for the next run of the uid")
async def keyrings(lab: Lab) -> Verdict:
    if not SYS or not sandbox._capabilities().uids:
        return Verdict(True, "nothing to attack: no keyctl numbers for this machine, or no uid per run", "")
    desc = f"attack-{uuid.uuid4().hex[:8]}".encode()
    prelude = _KEYS.format(**SYS)
    plant = prelude + f"report(user=add({desc!r}, b'secret', -4), session=add({desc!r}, b'secret', -3),\n" \
                      f"       persistent=add({desc!r}, b'secret', persistent) if persistent > 0 else 'none')\n"
    look = prelude + f"report(user=search({desc!r}, -4), session=search({desc!r}, -3),\n" \
                     f"       persistent=search({desc!r}, persistent) if persistent > 0 else 'none')\n"
    with _one_uid() as uid:
        planted = await lab.run(plant)
        between = _key_users(uid)
        for _ in range(50):  # invalidated keys are freed by the kernel's key gc, soon after
            if not between:
                break
            await asyncio.sleep(0.02)
            between = _key_users(uid)
        found = await lab.run(look)
    p, f = planted.facts, found.facts
    seen = [k for k in ("user", "session", "persistent") if f.get(k) == "FOUND"]
    contained = "user" in f and not seen and not between
    return Verdict(contained, "keyrings of the uid cleared and invalidated after the run; the session keyring sealed",
                   f"planted {p.get('user')}/{p.get('session')}/{p.get('persistent')} (user/session/persistent); "
                   f"next run of uid {uid} found {seen or 'nothing'}; /proc/key-users between: {between or 'no keys'}")


ENGINE = """
import asyncio, json, sys
from engine.sandbox import runner
runner.UID_BASE, runner.UID_COUNT = {uid}, 1  # this engine leases one uid only
from engine.sandbox import run_python
result = asyncio.run(run_python(sys.stdin.read(), runner.SandboxLimits(timeout_s=20)))
print(json.dumps({{'stdout': result.stdout, 'stderr': result.stderr[-500:]}}), flush=True)
"""


def _engine(uid: int, code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", ENGINE.format(uid=uid)], cwd=PROJECT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(PRELUDE + code)
    proc.stdin.close()
    proc.stdin = None  # written and closed: communicate() must not touch it again
    return proc


@attack("uid leased again by another engine after a crash")
async def uid_reuse(lab: Lab) -> Verdict:
    if not SYS or not sandbox._capabilities().uids:
        return Verdict(True, "nothing to attack: no uid per run here", "")
    uid = sandbox._capabilities().uids[-2]
    tag, desc = "ru" + uuid.uuid4().hex[:5], f"attack-{uuid.uuid4().hex[:8]}".encode()
    prelude = _KEYS.format(**SYS)
    crash = prelude + f"""
import os, time
add({desc!r}, b'secret', -4)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        libc('prctl', 15, b'{tag}', 0, 0, 0)
        time.sleep(30)
    os._exit(0)
time.sleep(30)
"""
    first = await asyncio.to_thread(_engine, uid, crash)
    for _ in range(300):  # until its daemon shows up in the host's process table
        if processes(comm_prefix=tag):
            break
        await asyncio.sleep(0.05)
    daemon = processes(comm_prefix=tag)
    os.kill(first.pid, signal.SIGKILL)  # the engine crashes mid-run, its lease still taken
    await asyncio.to_thread(first.wait)
    look = prelude + f"""
import os
def live(p):
    try:
        with open(f'/proc/{{p}}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False
try:
    others = len([p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid() and live(p)])
except OSError as e:
    others = err(e)  # /proc not listable: the engine counts the daemon from outside
report(key=search({desc!r}, -4), others=others, uid=os.getuid())
"""
    second = await asyncio.to_thread(_engine, uid, look)
    out, _ = await asyncio.to_thread(second.communicate, timeout=60)
    f = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    facts = {k: v for line in f.get("stdout", "").splitlines() if line.startswith("@@")
             for k, v in json.loads(line[2:]).items()}
    left = [p for p in daemon if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    contained = bool(daemon) and not left and facts.get("key") not in ("FOUND", None) \
        and facts.get("others") in (0, "EACCES")
    return Verdict(contained, "the zygote kills and cleans a crashed engine's runs before their lease is free",
                   f"daemon {daemon[:1]} of the crashed engine {'ALIVE' if left else 'gone'}; the next engine's run "
                   f"(uid {facts.get('uid')}) found key -> {facts.get('key')}, {facts.get('others')} processes of its uid")


@attack("interpreter in a venv under /tmp")
async def venv_under_tmp(lab: Lab) -> Verdict:
    with tempfile.TemporaryDirectory(prefix="attack-venv-") as tmp:
        venv = Path(tmp) / "venv"
        await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "venv", "--system-site-packages",
                                                 "--without-pip", str(venv)], check=True, timeout=120)
        code = "import colorsys, sys\nreport(prefix=sys.prefix, write=attempt(lambda: open(sys.prefix + '/pwned', 'w')))\n"
        engine = (
            "import asyncio, sys\nfrom engine.sandbox import run_python\n"
            "r = asyncio.run(run_python(sys.stdin.read()))\nprint(r.stdout, r.stderr[-300:])"
        )
        # The engine's own dependencies from this interpreter's site-packages; the sandbox sees the venv only.
        deps = os.pathsep.join(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT), deps])))
        done = await asyncio.to_thread(subprocess.run, [str(venv / "bin" / "python"), "-c", engine], cwd=PROJECT,
                                       input=PRELUDE + code, capture_output=True, text=True, timeout=120, check=False,
                                       env=env)
        out, err = done.stdout, done.stderr
        facts = {k: v for line in out.splitlines() if line.startswith("@@") for k, v in json.loads(line[2:]).items()}
        planted = (venv / "pwned").exists()
    ran = facts.get("prefix") == str(venv)
    contained = ran and facts.get("write") not in ("ok", None) and not planted
    how = (f"the venv is bound read-only into the sandbox: write -> {facts.get('write')}" if contained
           else f"the code ran, but the venv is writable: write -> {facts.get('write')}" if ran
           else f"the code did not run: {(err or out).strip()[-120:]}")
    return Verdict(contained, how, f"sys.prefix {facts.get('prefix', '?')}; host file {'WRITTEN' if planted else 'absent'}")

