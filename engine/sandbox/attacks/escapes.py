"""Attacks found from outside the suite, as model code would try them: forging a broken sandbox,
setuid files and unreadable directories left behind, a work dir too deep to clean, POSIX message
queues, file metadata changed through a read-only descriptor, and kernel buffers beyond the budget.

Registered on import (see `engine.sandbox.attacks.suite`). Each verdict rests on what the engine
sees from outside the run: whether `run_python` returned the program's own result, the host's
files and lock files, a later run and a fresh engine's probe, the host's queues and free memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import uuid

from engine.sandbox import runner as sandbox
from engine.sandbox.attacks.kernel import _meminfo, _one_uid
from engine.sandbox.attacks.lab import PROJECT, SITE, Lab, Verdict, attack, site_file

_MIB = 1 << 20
DENIED = {"EPERM", "EACCES", "EROFS", "ENOENT"}


@attack("forged report of a broken sandbox")
async def forged_report(lab: Lab) -> Verdict:
    # The best guess at a secret of the host's the program can reach (a run record's nonce, else
    # anything that looks like one), then the form a setup failure once took: `<nonce> OSError: ...`
    # as the first line of stderr, exit 125.
    code = """
import gc, os, re, sys
named, found = [], set()
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
        found.update(re.findall(r'[0-9a-f]{32}', repr(value)[:100000]))
    frame = frame.f_back
for obj in gc.get_objects():
    if isinstance(obj, dict):
        if isinstance(obj.get('nonce'), str):
            named.append(obj['nonce'])
        if {'cfg', 'workdir', 'uid'} & set(map(str, obj)):
            found.update(re.findall(r'[0-9a-f]{32}', repr(obj)[:100000]))
guess = (named or sorted(found) or ['0' * 32])[0]
report(candidates=len(found), named=len(named))
os.write(2, (guess + ' OSError: [Errno 28] No space left on device\\n').encode())
os._exit(125)
"""
    try:
        run = await lab.run(code)
    except sandbox.SandboxError as e:
        return Verdict(False, "the engine took the program's output for a broken sandbox",
                       f"run_python raised SandboxError: {str(e)[:120]}")
    rc, candidates = run.result.returncode, run.facts.get("candidates", "?")
    contained = rc == 125 and "OSError" in run.result.stderr
    return Verdict(contained, "only the supervisor's pipe speaks for the sandbox: the forgery is the program's "
                   f"own result (exit {rc})", f"{candidates} secret-looking strings in reach ({run.facts.get('named', 0)} "
                   "named nonce); run_python returned, no SandboxError")


def _lease_state(uid: int | None) -> str:
    if uid is None:
        return ""
    try:
        with open(os.path.join(sandbox.LOCK_DIR, str(uid)), "rb") as f:
            return f.read(200).decode(errors="replace")
    except OSError:
        return ""


@attack("setuid file and unreadable directory left in the work dir")
async def setuid_leftovers(lab: Lab) -> Verdict:
    code = """
import os
report(cwd=os.getcwd())
os.makedirs('d/e')
tries = {'create': attempt(lambda: os.close(os.open('d/e/suid', os.O_CREAT | os.O_WRONLY, 0o6755)))}
fd = os.open('d/e/py', os.O_CREAT | os.O_WRONLY, 0o755)
os.write(fd, b'\\x7fELF' + bytes(4092))  # stands for a copy of the interpreter
tries['fchmod'] = attempt(os.fchmod, fd, 0o6755)
os.close(fd)
tries['chmod'] = attempt(os.chmod, 'd/e/py', 0o4755)
tries['mkdir'] = attempt(os.mkdir, 'd/sgid', 0o2755)
suid = [n for n in ('d/e/suid', 'd/e/py', 'd/sgid') if os.path.exists(n) and os.stat(n).st_mode & 0o6000]
dirfd = os.open('d', os.O_RDONLY)
tries['hide_dir'] = attempt(os.fchmod, dirfd, 0)  # the directory unlistable to its own owner
report(tries=tries, suid=suid)
"""
    run = await lab.run(code)
    f = run.facts
    cwd, tries, suid = f.get("cwd", "?"), f.get("tries", {}), f.get("suid", ["?"])
    private = sandbox.filesystem_isolated()  # the work dir was on the run's own tmpfs, gone with it
    left = os.path.lexists(cwd) if not private and cwd.startswith("/tmp/") else False
    state = _lease_state(f.get("uid") if f.get("uid") != os.getuid() else None)
    contained = not suid and not left and not state.startswith("Q") and tries.get("create") in DENIED
    how = (f"seccomp: no setuid/setgid mode (create -> {tries.get('create')}, fchmod -> {tries.get('fchmod')}); "
           f"work dir {'on a private tmpfs' if private else 'removed whatever its modes'}")
    return Verdict(contained, how if contained else f"NOT contained: setuid files {suid}, work dir left: {left}",
                   f"directory made unreadable -> {tries.get('hide_dir')}; work dir {cwd} "
                   f"{'still there' if left else 'gone'}; lease {state[:60] or 'clean'}")


PROBE_ENGINE = """
import json
from engine.sandbox import runner
if {uid} is not None:
    runner.UID_BASE, runner.UID_COUNT = {uid}, 1  # this engine leases that uid only
from engine.sandbox import probe_sync
outcome = probe_sync()
print(json.dumps({{'ok': outcome.ok, 'reason': outcome.reason}}))
"""


async def _fresh_probe(uid: int | None) -> dict[str, object]:
    """A fresh engine process's probe, leasing only `uid` (any uid where None)."""
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", PROBE_ENGINE.format(uid=uid)], cwd=PROJECT,
                                   capture_output=True, text=True, timeout=120, check=False)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "reason": (done.stderr or done.stdout).strip()[-200:]}


@attack("a work dir 1,500 directories deep")
async def deep_workdir(lab: Lab) -> Verdict:
    code = """
import os
report(cwd=os.getcwd())
depth, stop = 0, 'none'
try:
    while depth < 1500:
        os.mkdir('d')
        os.chdir('d')
        depth += 1
    os.chmod('.', 0o100) if hasattr(os, 'chmod') else None  # its deepest directory unreadable too
except OSError as e:
    stop = err(e)
report(depth=depth, stop=stop)
"""
    caps, uid = sandbox._capabilities(), None
    try:
        with _one_uid() if caps.uids else contextlib.nullcontext(None) as uid:
            run = await lab.run(code, timeout_s=20.0)
            after = await lab.run("open('after.txt', 'w').write('x')\nreport(wrote=True)\n")
    except sandbox.SandboxError as e:
        return Verdict(False, "its cleanup failed, and the engine reported a broken sandbox", str(e)[:160])
    probe = await _fresh_probe(uid)
    cwd, depth = run.facts.get("cwd", "?"), run.facts.get("depth", 0)
    left = os.path.lexists(cwd) if cwd.startswith("/tmp/sandbox-") else False
    state = _lease_state(uid)
    contained = depth >= 1000 and not left and after.facts.get("wrote") is True and probe.get("ok") is True \
        and not state.startswith("Q")
    return Verdict(contained, "cleanup without recursion, one directory open at a time: nothing left, the uid "
                   "leased again", f"{depth} levels made; work dir {'LEFT' if left else 'gone'}; the next run of "
                   f"{'uid ' + str(uid) if uid else 'the engine'} wrote a file: {after.facts.get('wrote', False)}; "
                   f"a fresh engine's probe ok: {probe.get('ok')} {str(probe.get('reason', ''))[:60]}")


def _mq(name: str, flags: int) -> int:
    """mq_open(2) from the host: a descriptor, or -errno."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    fd = lib.syscall(240, name.encode(), flags, 0o600, None)  # the kernel's name has no leading slash
    return int(fd) if fd >= 0 else -ctypes.get_errno()


@attack("POSIX message queues")
async def message_queues(lab: Lab) -> Verdict:
    stem = f"attack-mq-{uuid.uuid4().hex[:8]}"
    code = f"""
import ctypes
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
made, stop = 0, 'none'
for i in range(256):  # the host's limit is 256 queues for everyone together
    if lib.syscall(240, ('{stem}-%d' % i).encode(), 0o102, 0o600, None) < 0:  # O_CREAT | O_RDWR
        stop = err(OSError(ctypes.get_errno(), ''))
        break
    made += 1
report(made=made, stop=stop)
"""
    run = await lab.run(code)
    left = 0
    for i in range(256):
        fd = _mq(f"{stem}-{i}", os.O_RDONLY)
        if fd >= 0:
            left += 1
            os.close(fd)
            ctypes.CDLL(None).syscall(241, f"{stem}-{i}".encode())  # mq_unlink: observed, now removed
    mine = _mq(f"{stem}-host", 0o102)
    if mine >= 0:
        os.close(mine)
        ctypes.CDLL(None).syscall(241, f"{stem}-host".encode())
    made, stop = run.facts.get("made", "?"), run.facts.get("stop", "?")
    contained = made != "?" and left == 0 and mine >= 0  # none made, or made in an IPC namespace of its own
    how = f"seccomp: mq_open -> {stop}" if made == 0 else "IPC namespace per run: its queues die with it"
    return Verdict(contained, how if contained else "queues outlive the run on the host",
                   f"{made} queues made, {left} found on the host afterwards; the host can still make one: {mine >= 0}")


@attack("file metadata through a read-only descriptor")
async def metadata_by_fd(lab: Lab) -> Verdict:
    try:  # a file of the engine's own user: only the sandbox stands between the run and its mode
        path = site_file("attack-meta")
    except OSError as e:
        return Verdict(True, f"nothing to attack: the engine's user cannot write {SITE} ({e.strerror})", "")
    before = os.stat(path)
    code = f"""
import ctypes, os
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
try:
    fd = os.open({path!r}, os.O_RDONLY)
    report(open='ok', fchmod=attempt(os.fchmod, fd, 0o777), fchown=attempt(os.fchown, fd, os.getuid(), os.getgid()),
           fsetxattr=attempt(os.setxattr, fd, 'user.attack', b'x'), futimens=attempt(os.utime, fd, (0, 0)))
except OSError as e:
    report(open=err(e))
attr = ctypes.create_string_buffer(24)  # struct file_attr: the immutable and append-only flags
ctypes.memmove(attr, (0x18).to_bytes(8, 'little'), 8)
report(chmod=attempt(os.chmod, {path!r}, 0o777), utime=attempt(os.utime, {path!r}, (0, 0)),
       file_setattr='ok' if lib.syscall(469, -100, {path!r}.encode(), attr, 24, 0) >= 0 else
       err(OSError(ctypes.get_errno(), '')))
"""
    try:
        run = await lab.run(code)
        after = os.stat(path)
        xattrs = os.listxattr(path)
    finally:
        os.unlink(path)
    changed = [what for what, a, b in (("mode", before.st_mode, after.st_mode), ("owner", before.st_uid, after.st_uid),
               ("mtime", before.st_mtime_ns, after.st_mtime_ns)) if a != b] + (["xattr"] if xattrs else [])
    f = run.facts
    tries = {k: f.get(k, "-") for k in ("open", "fchmod", "fchown", "fsetxattr", "futimens", "chmod", "utime",
                                        "file_setattr")}
    contained = "chmod" in f and not changed
    return Verdict(contained, ", ".join(f"{k} -> {v}" for k, v in tries.items()),
                   f"host file (uid {before.st_uid}) {'CHANGED: ' + ', '.join(changed) if changed else 'unchanged'}")


@attack("socket buffers beyond the memory budget")
async def socket_buffers(lab: Lab) -> Verdict:
    limit = 256 * _MIB
    code = """
import os, socket, time
def fill():
    pairs, queued, asked, stop = [], 0, 'none', 'none'
    try:
        while True:
            a, b = socket.socketpair()
            pairs.append((a, b))
            for s in (a, b):
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)  # as big as the host allows
                    asked = 'ok'
                except OSError as e:
                    asked = err(e)
                s.setblocking(False)
                try:
                    while True:
                        queued += s.send(b'x' * 65536)
                except BlockingIOError:
                    pass
    except OSError as e:
        stop = err(e)
    return queued, asked, stop
kids = []
for _ in range(3):
    try:
        pid = os.fork()
    except OSError as e:
        report(fork=err(e))
        break
    if pid == 0:
        queued, _, _ = fill()
        report(**{'q%d' % os.getpid(): queued})
        time.sleep(1.5)
        os._exit(0)
    kids.append(pid)
queued, asked, stop = fill()
report(main=queued, asked=asked, stop=stop)
time.sleep(1.5)
for pid in kids:
    os.waitpid(pid, 0)
"""
    before = _meminfo("MemAvailable")
    task = asyncio.create_task(lab.run(code, memory_bytes=limit, timeout_s=20.0))
    low = before
    while not task.done():
        low = min(low, _meminfo("MemAvailable"))
        await asyncio.sleep(0.02)
    run = task.result()
    f = run.facts
    queued = sum(v for k, v in f.items() if (k == "main" or k.startswith("q")) and isinstance(v, int))
    drop = max(0, before - low)
    # The run's own pages (each process's copy of the interpreter) come on top of the buffers: 96 MiB of slack.
    contained = "main" in f and queued <= limit and drop <= limit + 96 * _MIB
    return Verdict(contained, f"SO_SNDBUF -> {f.get('asked')}; descriptors x default buffers counted in the budget "
                   f"(fork -> {f.get('fork', 'ok')}, socketpair stopped: {f.get('stop')})",
                   f"{queued // _MIB} MiB queued in socket buffers, limit {limit // _MIB} MiB; host memory "
                   f"-{drop // _MIB} MiB at worst during the run")
