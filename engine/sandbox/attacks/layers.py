"""Attacks on what only Landlock and seccomp hold where the sandbox has no privilege: a named
unix socket and a UDP port of the engine, io_uring, chmod/utime/xattr of a host file, the
engine's /proc entries.

Registered on import (see `engine.sandbox.attacks.suite`), after the others. Each target
is made reachable by file modes (a 0777 directory, a world-writable socket, a file the engine's
own user owns), so that what stops the attack is a layer of the sandbox, never a permission
bit. The verdict is read from outside: what the engine's sockets received, the file's stat.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid

from engine.sandbox.attacks.lab import Lab, Verdict, attack

DENIED = {"EPERM", "EACCES", "ENOENT", "ESRCH", "ENOSYS"}


@attack("named unix socket of the engine")
async def named_unix_socket(lab: Lab) -> Verdict:
    with tempfile.TemporaryDirectory(prefix="attack-unix-") as tmp:
        os.chmod(tmp, 0o777)  # reachable by any uid: only a sandbox layer may stop the connect
        path = os.path.join(tmp, "engine.sock")
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen()
        server.setblocking(False)
        code = f"""
import socket
try:
    s = socket.socket(socket.AF_UNIX)
    report(connect=attempt(s.connect, {path!r}))
except OSError as e:
    report(connect='socket ' + err(e))
"""
        try:
            run = await lab.run(code)
            try:
                server.accept()[0].close()
                accepted = True
            except BlockingIOError:
                accepted = False
        finally:
            server.close()
    got = run.facts.get("connect", "?")
    contained = not accepted and got != "?" and got.split()[-1] in DENIED
    return Verdict(contained, f"connect({path.rsplit('/', 1)[-1]}) -> {got}",
                   f"the engine {'ACCEPTED a connection' if accepted else 'accepted nothing'}")


@attack("UDP datagram to the engine")
async def udp_to_engine(lab: Lab) -> Verdict:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"""
import socket
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    report(send=attempt(s.sendto, b'pwned', ('127.0.0.1', {port})))
except OSError as e:
    report(send='socket ' + err(e))
"""
    try:
        run = await lab.run(code)
        try:
            received = server.recvfrom(64)[0]
        except BlockingIOError:
            received = b""
    finally:
        server.close()
    got = run.facts.get("send", "?")
    contained = not received and got != "?" and got.split()[-1] in DENIED | {"ENETUNREACH", "ECONNREFUSED"}
    return Verdict(contained, f"sendto 127.0.0.1:{port} -> {got}",
                   f"the engine received {len(received)} bytes")


@attack("io_uring (system calls past the filter)")
async def io_uring(lab: Lab) -> Verdict:
    code = """
import ctypes
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
fd = lib.syscall(425, 8, params)  # io_uring_setup (x86_64 and aarch64 share 425)
report(setup='ok' if fd >= 0 else err(OSError(ctypes.get_errno(), '')))
"""
    f = (await lab.run(code)).facts
    got = f.get("setup", "?")
    return Verdict(got in DENIED, f"io_uring_setup -> {got}",
                   "a ring would submit socket, connect and openat outside the filter's view" if got == "ok" else
                   "no ring: nothing submitted")


@attack("chmod, utime, xattr of a host file")
async def chmod_host_file(lab: Lab) -> Verdict:
    fd, path = tempfile.mkstemp(prefix="attack-chmod-")
    os.close(fd)
    os.chmod(path, 0o644)
    before = os.stat(path)
    name = uuid.uuid4().hex[:8]
    code = f"""
import os
report(chmod=attempt(os.chmod, {path!r}, 0o6777), utime=attempt(os.utime, {path!r}, (0, 0)),
       xattr=attempt(os.setxattr, {path!r}, 'user.{name}', b'x') if hasattr(os, 'setxattr') else 'none',
       chown=attempt(os.chown, {path!r}, os.getuid(), os.getgid()))
"""
    try:
        run = await lab.run(code)
        after = os.stat(path)
        try:
            xattrs = os.listxattr(path)
        except OSError:
            xattrs = []
    finally:
        os.unlink(path)
    f = run.facts
    tries = {k: f.get(k, "?") for k in ("chmod", "utime", "xattr", "chown")}
    changed = [what for what, a, b in (("mode", before.st_mode, after.st_mode), ("mtime", before.st_mtime_ns,
               after.st_mtime_ns), ("owner", before.st_uid, after.st_uid)) if a != b] + (["xattr"] if xattrs else [])
    contained = not changed and all(v in DENIED | {"none"} for v in tries.values())
    what = "CHANGED: " + ", ".join(changed) if changed else "unchanged"
    return Verdict(contained, ", ".join(f"{k} -> {v}" for k, v in tries.items()),
                   f"host file {what} (owned by uid {before.st_uid})")


@attack("/proc/<engine>: maps, status, cmdline")
async def engine_proc(lab: Lab) -> Verdict:
    pid = lab.engine_pid
    code = f"""
report(**{{name: attempt(lambda p: open(p, 'rb').read(), f'/proc/{pid}/' + name) for name in
           ('maps', 'status', 'cmdline', 'environ', 'fd/0')}})
"""
    f = (await lab.run(code)).facts
    tries = {k: f.get(k, "?") for k in ("maps", "status", "cmdline", "environ", "fd/0")}
    contained = all(v in DENIED for v in tries.values())
    return Verdict(contained, ", ".join(f"{k} -> {v}" for k, v in tries.items()),
                   "nothing of the engine read" if contained else "the engine's /proc entries are readable")


@attack("system calls outside the allowlist")
async def beyond_the_allowlist(lab: Lab) -> Verdict:
    # Calls an old denylist did not name, and numbers no kernel has given out yet.
    calls = {"mq_open": (240, b"attack-x", 0o102, 0o600, 0), "inotify_init1": (294, 0), "flock": (73, 1, 2),
             "pidfd_open": (434, lab.engine_pid, 0), "cachestat": (451, 0, 0, 0, 0), "statmount": (457, 0, 0, 0, 0),
             "mincore": (27, 0, 4096, 0), "sync": (162,), "file_setattr": (469, -100, b".", 0, 0, 0),
             "future 470": (470,), "future 511": (511,)}
    code = f"""
import ctypes
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
got = {{}}
for name, args in {calls!r}.items():
    got[name] = 'ok' if lib.syscall(*args) >= 0 else err(OSError(ctypes.get_errno(), ''))
report(got=got)
"""
    got = (await lab.run(code)).facts.get("got", {})
    through = [name for name, outcome in got.items() if outcome not in ("EPERM", "ENOSYS")]
    contained = len(got) == len(calls) and not through
    return Verdict(contained, f"seccomp default deny: {len(got) - len(through)} of {len(calls)} refused "
                   f"({sorted(set(got.values()))})", f"allowed: {through or 'none'}")


WORKS = """
import asyncio, concurrent.futures, sqlite3, subprocess, sys, threading
import numpy, sympy
x = sympy.symbols('x')
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    squares = sum(pool.map(lambda i: i * i, range(10)))
async def main():
    return await asyncio.gather(*(asyncio.sleep(0.001, i) for i in range(3)))
db = sqlite3.connect('t.db')
db.execute('create table t (x)')
db.execute('insert into t values (7)')
db.commit()
try:
    child = subprocess.run([sys.executable, '-c', 'print(5)'], capture_output=True, text=True).stdout.strip()
except OSError as e:
    child = err(e)
report(numpy=round(float(numpy.linalg.det(numpy.eye(3) * 2)), 6), sympy=str(sympy.solve(x**2 - 4, x)), threads=squares,
       asyncio=asyncio.run(main()), sqlite=db.execute('select x from t').fetchall()[0][0],
       subprocess=child)
"""


@attack("numpy, sympy, threads, asyncio and sqlite3 still work")
async def still_works(lab: Lab) -> Verdict:
    # Not an attack: the allowlist must leave ordinary scientific code alone (subprocess is shown,
    # not judged: where the run's uid cannot reach the interpreter, the probe says so).
    run = await lab.run(WORKS, timeout_s=60.0)
    f = run.facts
    want = {"numpy": 8.0, "sympy": "[-2, 2]", "threads": 285, "asyncio": [0, 1, 2], "sqlite": 7}
    wrong = {k: f.get(k) for k, v in want.items() if f.get(k) != v}
    error = (run.result.stderr.strip().splitlines() or [""])[-1][:120]
    return Verdict(not wrong, "the allowlist leaves them alone" if not wrong else f"broken: {error}",
                   f"{', '.join(want)} as expected{'' if not wrong else ' except ' + str(wrong)}; "
                   f"subprocess python -> {f.get('subprocess')!r}")
