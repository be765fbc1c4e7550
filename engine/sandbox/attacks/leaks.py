"""Attacks on what a run could learn of the host or signal to another run: metadata of hidden
files, the host's listening ports in /proc, other runs' records in memory it forked from,
inotify on the directory that holds the work dirs, locks on files every run can open, and a
zygote killed under a running call.

Registered on import (see `engine.sandbox.attacks.suite`). Where two runs are involved they run
at once, and the host decides from what it knows of the first (its uid, its work dir, a name it
chose) whether the second saw it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

from engine.sandbox import runner as sandbox
from engine.sandbox.attacks.lab import PRELUDE, PROJECT, Lab, Verdict, alive, attack, processes

DENIED = {"EPERM", "EACCES", "ENOENT"}


@attack("size and owner of a hidden file (stat)")
async def stat_hidden(lab: Lab) -> Verdict:
    # A file of the engine's user in a directory only it may enter, and a file of the checkout.
    private = tempfile.mkdtemp(prefix="attack-stat-")  # 0700
    secret = os.path.join(private, "secret")
    with open(secret, "wb") as f:  # noqa: ASYNC230 - a few KiB
        f.write(os.urandom(1000 + int.from_bytes(os.urandom(2), "little") % 4000))
    project = str(PROJECT / "pyproject.toml") if (PROJECT / "pyproject.toml").is_file() else sandbox.__file__
    code = f"""
import os
def size(path):
    try:
        return os.stat(path).st_size
    except OSError as e:
        return err(e)
report(secret=size({secret!r}), project=size({project!r}))
"""
    try:
        run = await lab.run(code)
        truth = {"secret": os.stat(secret).st_size, "project": os.stat(project).st_size}
    finally:
        os.unlink(secret)
        os.rmdir(private)
    f = run.facts
    seen = [k for k in truth if f.get(k) == truth[k]]
    contained = "secret" in f and not seen
    how = (f"stat -> {f.get('secret')} (a 0700 directory of the engine's), {f.get('project')} (the checkout)"
           if contained else "NOT contained: Landlock does not mediate stat, seccomp cannot read a path; only a "
           "mount namespace hides a path")
    return Verdict(contained, how, f"sizes learnt: {seen or 'none'}")


@attack("/proc/<own>/net: the host's listening ports")
async def proc_net(lab: Lab) -> Verdict:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = f"""
import os
seen = {{}}
for path in ('/proc/self/net/tcp', '/proc/net/tcp', '/proc/%d/net/tcp' % os.getpid(),
             '/proc/self/task/%d/net/tcp' % os.getpid(), '/proc/self/net/unix'):
    try:
        with open(path) as f:
            seen[path] = 'PORT' if ':%04X' % {port} in f.read() else 'read'
    except OSError as e:
        seen[path] = err(e)
report(seen=seen)
"""
    try:
        run = await lab.run(code)
    finally:
        server.close()
    seen = run.facts.get("seen", {})
    found = [p for p, v in seen.items() if v == "PORT"]
    contained = bool(seen) and not found
    return Verdict(contained, ", ".join(f"{p.replace('/proc/', '')} -> {v}" for p, v in list(seen.items())[:3]),
                   f"the engine's port {port} {'SEEN in ' + ', '.join(found) if found else 'not seen'}")


RECORDS = r"""
import ctypes, gc, re
uids, dirs = set(), set()
for obj in gc.get_objects():
    if isinstance(obj, dict) and 'uid' in obj and isinstance(obj.get('uid'), int):
        uids.add(obj['uid'])
    if isinstance(obj, (str, dict)):
        dirs.update(re.findall(r'sandbox-[0-9a-f]{32}', repr(obj)[:100000]))
scanned = 0
try:
    with open('/proc/self/maps') as f:
        regions = [line.split() for line in f]
    for fields in regions:
        if fields[1].startswith('rw') and (len(fields) < 6 or fields[5] == '[heap]'):
            start, end = (int(x, 16) for x in fields[0].split('-'))
            data = ctypes.string_at(start, min(end - start, 64 << 20))
            scanned += len(data)
            uids.update(int(u) for u in re.findall(rb'"uid": (\d+)', data))
            dirs.update(d.decode() for d in re.findall(rb'sandbox-[0-9a-f]{32}', data))
except OSError as e:
    scanned = err(e)
report(uids=sorted(uids), dirs=sorted(dirs)[:50], scanned=scanned)
"""


@attack("other runs' records in the memory it forked from")
async def records(lab: Lab) -> Verdict:
    first = asyncio.create_task(lab.run("import os, time\nreport(cwd=os.getcwd())\ntime.sleep(2.5)\n"))
    await asyncio.sleep(0.8)
    second = await lab.run(RECORDS)
    other = await first
    a, b = other.facts, second.facts
    own_uid = b.get("uid")
    leaked = []
    if a.get("uid") not in (None, own_uid) and a["uid"] in b.get("uids", []):
        leaked.append(f"uid {a['uid']}")
    name = os.path.basename(a.get("cwd", ""))
    if name.startswith("sandbox-") and name != os.path.basename(b.get("cwd", "") or "") and name in b.get("dirs", []):
        leaked.append(f"work dir {name}")
    # Records of runs that ended before this one (earlier attacks) are just as much another run's.
    earlier = [u for u in b.get("uids", []) if u != own_uid and sandbox.UID_BASE <= u < sandbox.UID_BASE + sandbox.UID_COUNT]
    contained = "uids" in b and not leaked and not earlier
    return Verdict(contained, "runs fork from a forker that never held a run's settings (it knows their pids only)",
                   f"concurrent run's uid {a.get('uid')} and work dir {name or '-'}: "
                   f"{'FOUND ' + ', '.join(leaked) if leaked else 'not found'}; other sandbox uids in memory: "
                   f"{earlier or 'none'}; {b.get('scanned')} bytes of its heap scanned")


INOTIFY = """
import ctypes, os, select, struct, time
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
fd = lib.syscall(294, 0)  # inotify_init1
names, watches = [], {}
if fd < 0:
    report(init=err(OSError(ctypes.get_errno(), '')))
else:
    for path in ('/tmp', os.path.dirname(os.getcwd()), os.getcwd()):
        watches[path] = 'ok' if lib.syscall(254, fd, path.encode(), 0x100 | 0x80) >= 0 else \\
            err(OSError(ctypes.get_errno(), ''))  # inotify_add_watch: IN_CREATE | IN_MOVED_TO
    report(init='ok', watches=watches)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            data = os.read(fd, 65536)
            while data:
                length = struct.unpack_from('iIII', data)[3]
                names.append(data[16:16 + length].rstrip(b'\\0').decode(errors='replace'))
                data = data[16 + length:]
report(names=names[:200])
"""


@attack("inotify on the directory holding the work dirs")
async def inotify_watch(lab: Lab) -> Verdict:
    name = f"attack-inotify-{uuid.uuid4().hex[:8]}"
    watcher = asyncio.create_task(lab.run(INOTIFY, timeout_s=10.0))
    await asyncio.sleep(0.7)
    other = await lab.run(f"import os, time\nreport(cwd=os.getcwd())\ntime.sleep(0.3)\nopen({name!r}, 'w').close()\n")
    run = await watcher
    f = run.facts
    dirname = os.path.basename(other.facts.get("cwd", ""))
    seen = [n for n in f.get("names", []) if n == name or (n.startswith("sandbox-") and n == dirname)]
    contained = "names" in f and not seen
    return Verdict(contained, f"inotify_init1 -> {f.get('init')}" + (f", watches {f.get('watches')}" if f.get("watches")
                   else ""), f"the concurrent run's names {'SEEN: ' + ', '.join(seen) if seen else 'not seen'}")


# /dev/null is open read-write to every run, the loader's cache read-only: a lock on either would be seen by all.
LOCKER = """
import fcntl, os, time
held = {}
for path, mode in (('/dev/null', 'r+b'), ('/etc/ld.so.cache', 'rb')):
    f = open(path, mode)
    held[path] = [attempt(fcntl.flock, f, fcntl.LOCK_EX),
                  attempt(fcntl.lockf, f, fcntl.LOCK_EX if 'r+' in mode else fcntl.LOCK_SH)]
    globals().setdefault('keep', []).append(f)
report(held=held)
time.sleep(2.5)
"""
PROBER = """
import fcntl, os, struct
seen = {}
for path, mode in (('/dev/null', 'r+b'), ('/etc/ld.so.cache', 'rb')):
    f = open(path, mode)
    flock = attempt(fcntl.flock, f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:  # F_GETLK: would a write lock conflict? l_type comes back F_UNLCK (2) when nothing holds one
        got = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 0, 0))
        getlk = 'free' if struct.unpack('hhqqi', got)[0] == fcntl.F_UNLCK else 'HELD'
    except OSError as e:
        getlk = err(e)
    seen[path] = [flock, getlk]
report(seen=seen)
"""


@attack("a lock on a file every run can open, as a signal")
async def shared_lock(lab: Lab) -> Verdict:
    holder = asyncio.create_task(lab.run(LOCKER))
    await asyncio.sleep(0.8)
    probe = await lab.run(PROBER)
    held = (await holder).facts.get("held", {})
    seen = probe.facts.get("seen", {})
    signalled = [f"{os.path.basename(p)}: {v}" for p, v in seen.items() if "EAGAIN" in v or "EWOULDBLOCK" in v
                 or "HELD" in v]
    contained = bool(seen) and not signalled
    return Verdict(contained, f"flock and fcntl locks refused: holder {held.get('/dev/null')}, "
                   f"prober {seen.get('/dev/null')}", f"the second run saw {'the lock: ' + '; '.join(signalled) if signalled else 'nothing'}")


KILLED_ENGINE = """
import asyncio, json, sys
from engine.sandbox import client, runner
async def main():
    task = asyncio.create_task(runner.run_python(sys.stdin.read(), runner.SandboxLimits(timeout_s=60)))
    while client.current() is None:
        await asyncio.sleep(0.05)
    print(json.dumps({"zygote": client.current().proc.pid}), flush=True)
    try:
        print(json.dumps({"stdout": (await task).stdout}), flush=True)
    except Exception as e:
        print(json.dumps({"error": str(e)}), flush=True)
asyncio.run(main())
"""


@attack("a killed zygote: its run and its work dir")
async def zygote_killed(lab: Lab) -> Verdict:
    tag = "zk" + uuid.uuid4().hex[:5]
    code = PRELUDE + f"""
import os, time
if os.fork() == 0:
    libc('prctl', 15, b'{tag}', 0, 0, 0)  # PR_SET_NAME: how the engine finds it
    time.sleep(30)
    os._exit(0)
libc('prctl', 15, b'{tag}', 0, 0, 0)
open('state', 'w').write('x')
report(cwd=os.getcwd())
time.sleep(30)
"""
    engine = subprocess.Popen(  # noqa: ASYNC220 - started here, waited for in a thread
        [sys.executable, "-c", KILLED_ENGINE], cwd=PROJECT, text=True, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    assert engine.stdin is not None and engine.stdout is not None
    engine.stdin.write(code)
    engine.stdin.close()
    try:
        zygote = json.loads(await asyncio.to_thread(engine.stdout.readline))["zygote"]
        tagged: list[int] = []
        for _ in range(200):  # until the run and its child show up in the host's process table
            tagged = processes(comm_prefix=tag)
            if len(tagged) >= 2:
                break
            await asyncio.sleep(0.05)
        uids = {os.stat(f"/proc/{p}").st_uid for p in tagged if os.path.exists(f"/proc/{p}")}
        cwds = {os.readlink(f"/proc/{p}/cwd") for p in tagged if os.path.exists(f"/proc/{p}/cwd")}
        os.kill(zygote, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (processes(comm_prefix=tag) or any(
                os.path.lexists(c) for c in cwds if c.startswith("/tmp/sandbox-"))):
            await asyncio.sleep(0.05)
        left = processes(comm_prefix=tag)
        dirs = [c for c in cwds if c.startswith("/tmp/sandbox-") and os.path.lexists(c)]
    finally:
        engine.kill()
        await asyncio.to_thread(engine.wait)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)  # observed; now end them rather than leave them 30 s
        except OSError:
            pass
    contained = len(tagged) >= 2 and not left and not dirs and not any(alive(p) for p in tagged)
    return Verdict(contained, "the forker sees the zygote's end close: kills every run beneath it, removes their work dirs",
                   f"{len(tagged)} processes of the run (uid {sorted(uids)}) before the zygote was killed, "
                   f"{len(left)} after; work dir {'LEFT: ' + dirs[0] if dirs else 'gone'}")
