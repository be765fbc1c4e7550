"""Attacks on the sandbox's isolation: secrets, files, the engine process, the network,
privileges (libc through ctypes, user namespaces, setuid binaries) and /proc.

Registered on import (see `engine.sandbox.attacks.suite`). Attacks that signal the engine first probe
with `kill(pid, 0)` and stop if it succeeds: that already proves the gap, harmlessly.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

from engine.sandbox import runner as sandbox
from engine.sandbox.attacks.lab import PROJECT, Lab, Verdict, alive, attack

# What an errno seen by the sandboxed program says about the layer that stopped it.
WHY = {
    "EROFS": "read-only mount",
    "EACCES": "own uid, root-owned",
    "ENOENT": "hidden (tmpfs over it, or own /proc)",
    "EPERM": "no privilege (own uid, NO_NEW_PRIVS)",
    "ESRCH": "not visible",
    "EXDEV": "other filesystem",
    "ENETUNREACH": "network namespace",
    "ECONNREFUSED": "network namespace",
}
DENIED = {"EPERM", "EACCES", "ESRCH", "ENOENT", "EROFS", "EINVAL", "EXDEV"}


def _why(outcome: str) -> str:
    return WHY.get(outcome, "not stopped" if outcome == "ok" else outcome)


def _tally(results: dict[str, str], verb: str) -> str:
    """'read-only mount: write -> EROFS (4); ...' for the errno names in `results`."""
    return "; ".join(f"{_why(e)}: {verb} -> {e} ({n})" for e, n in Counter(results.values()).items())


def _sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


_READ = """
import hashlib
seen = {{}}
for path in {paths!r}:
    try:
        with open(path, 'rb') as f:
            seen[path] = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        seen[path] = err(e)
report(seen=seen)
"""


async def _read(lab: Lab, paths: list[str]) -> dict[str, str]:
    """What the sandbox got opening `paths`: a sha256 of the content, or an errno name.
    (A hash, so the content itself never reaches the report.)"""
    run = await lab.run(_READ.format(paths=paths))
    return {p: run.facts.get("seen", {}).get(p, "?") for p in paths}


@attack("environment secret of the engine")
async def env_secret(lab: Lab) -> Verdict:
    name, secret = "ENGINE_ATTACK_SECRET", uuid.uuid4().hex
    engine = f"/proc/{lab.engine_pid}/environ"
    code = f"""
import os
reads = {{}}
for path in [f'/proc/{{os.getppid()}}/environ', '{engine}', '/proc/1/environ']:
    try:
        with open(path, 'rb') as f:
            f.read()  # not reported: being able to read it is the finding
        reads[path] = 'ok'
    except OSError as e:
        reads[path] = err(e)
with open('/proc/self/environ', 'rb') as f:
    own = f.read().decode(errors='replace')
report(env=dict(os.environ), own=own, reads=reads)
"""
    old = os.environ.get(name)
    os.environ[name] = secret  # what a careless parent holds: an API key in its environment
    try:
        run = await lab.run(code)
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
    r, f = run.result, run.facts
    leaked = secret in r.stdout + r.stderr or name in r.stdout
    got = f.get("reads", {}).get(engine, "?")
    init = f.get("reads", {}).get("/proc/1/environ", "?")
    # The engine's /proc/<pid>/environ shows the environment it started with, where a real API
    # key would be (not this secret, set at run time): being able to open it is the leak.
    contained = "env" in f and not leaked and not r.truncated and got in DENIED and init in DENIED
    how = f"fresh environment ({len(f.get('env', {}))} variables); /proc/<engine>/environ -> {got}"
    if got == "ok":
        how = "the engine's start-up environment is readable: /proc/<engine>/environ -> ok"
    return Verdict(contained, how, f"secret {'LEAKED' if leaked else 'absent'} from its env and "
                   f"/proc/self/environ; /proc/1/environ -> {init}")


@attack("write outside the work dir")
async def write_outside(lab: Lab) -> Verdict:
    name = f"attack-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", str(PROJECT / name), f"/var/tmp/{name}", f"/dev/shm/{name}",
               f"/etc/{name}", f"/root/{name}", f"/{name}"]
    code = f"""
done = {{}}
for path in {targets!r} + ['here.txt']:
    try:
        with open(path, 'w') as f:
            f.write('pwned')
        done[path] = 'ok'
    except OSError as e:
        done[path] = err(e)
report(done=done)
"""
    run = await lab.run(code)
    on_host = [t for t in targets if os.path.lexists(t)]
    for t in on_host:  # the attack's own litter, if it got through
        os.unlink(t)
    done = run.facts.get("done", {})
    outside = {t: done.get(t, "?") for t in targets}
    contained = bool(done) and not on_host
    own = done.get("here.txt", "?")
    return Verdict(contained, _tally(outside, "write"),
                   f"{len(targets)} paths, {len(on_host)} reached the host; own dir: write -> {own}")


@attack("read the project's files")
async def read_project(lab: Lab) -> Verdict:
    candidates = (PROJECT / "README.md", PROJECT / "pyproject.toml", Path(sandbox.__file__).resolve())
    paths = [str(p) for p in candidates if p.is_file()]
    seen = await _read(lab, paths)
    read = [p for p in paths if len(seen[p]) == 64]  # a hash came back, not an errno name
    if not read:
        return Verdict(True, _tally(seen, "open"), f"{len(paths)} files under {PROJECT}, none read")
    same = sum(seen[p] == _sha(p) for p in read)
    return Verdict(False, f"not hidden: {PROJECT} is not covered by the sandbox's hidden paths",
                   f"read {', '.join(Path(p).name for p in read)} ({same} equal to the host's by sha256)")


@attack("read /etc/passwd and /etc/shadow")
async def read_etc(lab: Lab) -> Verdict:
    seen = await _read(lab, ["/etc/passwd", "/etc/shadow"])
    passwd, shadow = ("READ" if len(v) == 64 else v for v in (seen["/etc/passwd"], seen["/etc/shadow"]))
    same = passwd == "READ" and os.path.isfile("/etc/passwd") and seen["/etc/passwd"] == _sha("/etc/passwd")
    # Contained when the host's accounts stay unseen: denied outright, or a stand-in is shown.
    contained = (passwd in DENIED or (passwd == "READ" and not same)) and shadow in DENIED
    how = _tally({"/etc/passwd": passwd, "/etc/shadow": shadow}, "open")
    if passwd == "READ":
        how = ("stand-in /etc/passwd (root and the run's uid only)" if not same else "not hidden: the host's /etc is visible")
        how += "" if shadow in DENIED else ", even /etc/shadow"
    return Verdict(contained, how, f"passwd: {passwd}{' (the host copy)' if same else ''}; shadow: {shadow}")


@attack("read /root (the engine's home)")
async def read_root(lab: Lab) -> Verdict:
    home = "/root"
    try:
        host = sorted(os.listdir(home))
    except OSError:
        host = []  # the engine's own user cannot list it either (an ordinary user)
    files = [n for n in host if os.path.isfile(os.path.join(home, n))]
    # The interpreter may live under /root (pyenv): the sandbox binds exactly its dirs back in.
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))}
    needed = {os.path.relpath(p, home).split(os.sep)[0] for p in prefixes if p.startswith(home + "/")}
    code = f"""
import os
opened = {{name: attempt(lambda p: open(p, 'rb').close(), os.path.join('{home}', name)) for name in {files!r}}}
try:
    listing = sorted(os.listdir('{home}'))
except OSError as e:
    listing = err(e)  # refused outright: nothing listed
report(listing=listing, opened=opened)
"""
    run = await lab.run(code)
    listing, opened = run.facts.get("listing"), run.facts.get("opened", {})
    if isinstance(listing, str):
        listing = [] if listing in DENIED else None
    extra = sorted(set(listing or []) - needed)
    readable = [n for n, e in opened.items() if e == "ok"]
    contained = listing is not None and not extra and not readable and all(e in DENIED for e in opened.values())
    how = (f"{home} lists {listing}; open -> {sorted(set(opened.values()))}" if contained
           else f"not hidden: {len(extra)} entries visible, {len(readable)} files readable")
    return Verdict(contained, how, f"host {home} has {len(host)} entries ({len(files)} files); "
                   f"sandbox sees {len(listing or [])} (the interpreter's)")


@attack("signal the engine process")
async def signal_engine(lab: Lab) -> Verdict:
    received = Counter[int]()
    watched = (signal.SIGUSR1, signal.SIGTERM)
    try:  # count what arrives, so a delivered SIGTERM is seen instead of killing the engine
        old = {s: signal.signal(s, lambda sig, _frame: received.update([sig])) for s in watched}
    except ValueError:  # not the main thread: the kill(pid, 0) probe below still guards the engine
        old = {}
    pid, group = lab.engine_pid, os.getpgid(lab.engine_pid)
    code = f"""
import os, signal
probe = attempt(os.kill, {pid}, 0)
report(probe=probe)
if probe != 'ok':  # only when even probing is denied are real signals harmless to try
    report(usr1=attempt(os.kill, {pid}, signal.SIGUSR1), term=attempt(os.kill, {pid}, signal.SIGTERM),
           group=attempt(os.killpg, {group}, signal.SIGTERM), kill=attempt(os.kill, {pid}, signal.SIGKILL))
"""
    try:
        run = await lab.run(code)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    f = run.facts
    tries = {k: f.get(k, "?") for k in ("probe", "usr1", "term", "group", "kill")}
    contained = all(v in DENIED for v in tries.values()) and not received and alive(pid)
    counted = f"{sum(received.values())} signals received" if old else "signals not counted (not main thread)"
    how = f"own uid: kill(engine) -> {tries['probe']}"
    if tries["probe"] == "ok":
        how = "same uid as the engine: kill(engine, 0) -> ok (real signals not sent)"
    return Verdict(contained, how,
                   f"USR1/TERM/KILL/killpg -> {sorted(set(tries.values()))}; engine alive, {counted}")


def _listener(family: socket.AddressFamily, address: str | tuple[str, int]) -> socket.socket:
    server = socket.socket(family)
    server.bind(address)
    server.listen()
    server.setblocking(False)  # accept() then tells at once whether anything connected
    return server


@attack("network: 127.0.0.1, abstract socket, internet")
async def network(lab: Lab) -> Verdict:
    tcp = _listener(socket.AF_INET, ("127.0.0.1", 0))
    abstract = f"\0engine-attack-{uuid.uuid4().hex}"  # abstract unix sockets belong to the net namespace
    unix = _listener(socket.AF_UNIX, abstract)
    code = f"""
import socket
def connect(family, address):
    try:
        s = socket.socket(family)
    except OSError as e:
        return 'socket ' + err(e)  # refused before any address was tried
    s.settimeout(3)
    return attempt(s.connect, address)
report(tcp=connect(socket.AF_INET, ('127.0.0.1', {tcp.getsockname()[1]})),
       unix=connect(socket.AF_UNIX, {abstract!r}), internet=connect(socket.AF_INET, ('1.1.1.1', 53)))
"""
    try:
        run = await lab.run(code)
        accepted = []
        for name, server in (("tcp", tcp), ("unix", unix)):
            try:
                server.accept()[0].close()
                accepted.append(name)
            except BlockingIOError:
                pass
    finally:
        tcp.close()
        unix.close()
    tries = {k: run.facts.get(k, "?") for k in ("tcp", "unix", "internet")}
    contained = not accepted and all(v not in ("ok", "?") for v in tries.values())
    where = ("seccomp: no sockets" if all(v.startswith("socket ") for v in tries.values())
             else "network namespace") if contained else "not isolated"
    return Verdict(contained, f"{where}: connect 127.0.0.1 -> {tries['tcp']}",
                   f"abstract unix -> {tries['unix']}, 1.1.1.1:53 -> {tries['internet']}; "
                   f"engine accepted {accepted or 'nothing'}")


@attack("ctypes libc: setuid, mount, unshare, ptrace, kill(-1)")
async def libc_calls(lab: Lab) -> Verdict:
    engine = lab.engine_pid
    code = f"""
import os, subprocess, sys
os.mkdir('m')
mounted = libc('mount', b'tmpfs', b'm', b'tmpfs', 0, None)
if mounted == 'ok':
    libc('umount2', b'm', 2)  # should it work, leave no mount behind on the host
report(setuid=libc('setuid', 0), setgid=libc('setgid', 0), mount=mounted,
       unshare=libc('unshare', 0x40000000 | 0x00020000),  # CLONE_NEWNET | CLONE_NEWNS
       ptrace=libc('ptrace', 0x4206, {engine}, None, None),  # PTRACE_SEIZE: attaches without stopping
       setns=attempt(open, '/proc/1/ns/mnt', 'rb'))
import time
own = os.fork()
if own == 0:
    time.sleep(30)
    os._exit(0)
if attempt(os.kill, {engine}, 0) == 'ok':  # kill(-1) would reach the engine: the probe proves it
    report(kill_all='skipped')
else:
    report(kill_all=libc('kill', -1, 9))
    for _ in range(500):
        pid, status = os.waitpid(own, os.WNOHANG)
        if pid:
            break
        time.sleep(0.01)
    report(own_killed=bool(pid) and os.waitstatus_to_exitcode(status) == -9)
"""
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # another uid's process
    try:
        run = await lab.run(code)
        canary_alive = canary.poll() is None
    finally:
        canary.kill()
        canary.wait()
    f = run.facts
    calls = {k: f.get(k, "?") for k in ("setuid", "setgid", "mount", "unshare", "ptrace", "setns")}
    denied = all(v in DENIED for v in calls.values())
    kill_all = f.get("kill_all", "?")
    own_killed = f.get("own_killed") is True  # kill(-1) works, and reaches only the run's own uid
    contained = denied and kill_all != "skipped" and own_killed and canary_alive and alive(engine)
    how = ", ".join(f"{k} -> {v}" for k, v in calls.items() if k != "setgid")
    if kill_all == "skipped":
        kill = "kill(-1, 9) not sent: it would reach the engine"
    else:
        kill = f"kill(-1, 9) -> {kill_all}, {'its own child killed' if own_killed else 'own child NOT killed'}"
    return Verdict(contained, how, f"{kill}; canary {'alive' if canary_alive else 'KILLED'}, engine alive")


@attack("user namespace, then undo the mounts")
async def user_namespace(lab: Lab) -> Verdict:
    name = f"attack-{uuid.uuid4().hex}"
    code = f"""
import os
report(unshare=libc('unshare', 0x10000000 | 0x00020000))  # CLONE_NEWUSER | CLONE_NEWNS
report(umount_root=libc('umount2', b'/root', 2), umount_proc=libc('umount2', b'/proc', 2),  # MNT_DETACH
       remount_rw=libc('mount', None, b'/', None, 32 | 4096, None),  # MS_REMOUNT | MS_BIND, not read-only
       mount_proc=libc('mount', b'proc', b'.', b'proc', 0, None),
       uid_map=attempt(lambda: open('/proc/self/uid_map', 'w').write('0 %d 1' % _os.getuid())),
       write=attempt(lambda: open('{PROJECT / name}', 'w').write('pwned')))
"""
    run = await lab.run(code)
    target = PROJECT / name
    reached = target.exists()
    if reached:
        target.unlink()
    f = run.facts
    keys = ("umount_root", "umount_proc", "remount_rw", "mount_proc", "uid_map", "write")
    steps = {k: f.get(k, "?") for k in keys}
    contained = all(v in DENIED for v in steps.values()) and not reached
    unshare = f.get("unshare", "?")
    if unshare != "ok":
        return Verdict(contained and unshare in DENIED, f"unshare(CLONE_NEWUSER) -> {unshare}", "no user namespace")
    locked = "but its mounts are locked" if contained else "NOT contained"
    return Verdict(contained, f"user ns ALLOWED, {locked}: "
                   f"umount /root -> {steps['umount_root']}, remount / rw -> {steps['remount_rw']}",
                   f"mount proc -> {steps['mount_proc']}, uid_map -> {steps['uid_map']}, "
                   f"write project -> {steps['write']}")


@attack("setuid-root binary (mount)")
async def setuid_binary(lab: Lab) -> Verdict:
    code = """
import os, shutil, stat, subprocess
path = shutil.which('mount')
if path and os.stat(path).st_mode & stat.S_ISUID and os.stat(path).st_uid == 0:
    os.mkdir('m')
    p = subprocess.run([path, '-t', 'tmpfs', 'none', 'm'], capture_output=True, text=True)
    said = (p.stderr.strip().splitlines() or [''])[0][:60]
    report(path=path, rc=p.returncode, said=said, mounted=os.path.ismount('m'))
    if os.path.ismount('m'):
        subprocess.run([shutil.which('umount') or 'umount', 'm'])  # should it work, leave no mount behind
else:
    report(path=None)
"""
    f = (await lab.run(code)).facts
    if f.get("path") is None:
        return Verdict("uid" in f, "nothing to attack: no setuid-root mount binary", "")
    contained = f.get("rc") not in (0, None) and f.get("mounted") is False
    how = "NO_NEW_PRIVS: the setuid bit is ignored, mount runs as the run's uid" if contained else "mount worked"
    return Verdict(contained, how, f"{f['path']} -> exit {f.get('rc')}: {f.get('said')!r}")


@attack("/proc of other processes")
async def other_proc(lab: Lab) -> Verdict:
    code = f"""
import os
mine, foreign = [], []
try:
    names = os.listdir('/proc')
except OSError as e:
    names = []
    report(listing=err(e))  # /proc cannot even be listed
for name in filter(str.isdigit, names):
    try:
        with open(f'/proc/{{name}}/status') as f:
            uid = int(next(line for line in f if line.startswith('Uid:')).split()[1])
    except (OSError, StopIteration):
        continue
    (mine if uid == os.getuid() else foreign).append(int(name))
report(mine=len(mine), foreign=foreign[:20], init=attempt(open, '/proc/1/cmdline', 'rb'),
       engine=attempt(open, '/proc/{lab.engine_pid}/cmdline', 'rb'),
       mem=attempt(open, '/proc/{lab.engine_pid}/mem', 'rb'))
"""
    f = (await lab.run(code)).facts
    reads = {k: f.get(k, "?") for k in ("init", "engine", "mem")}
    contained = "mine" in f and not f.get("foreign") and all(v in DENIED for v in reads.values())
    where = ("Landlock: /proc not listable" if f.get("listing") else "own /proc (hidepid=2)") if contained \
        else "not hidden"
    return Verdict(contained, f"{where}: /proc/1 -> {reads['init']}, /proc/<engine> -> {reads['engine']}",
                   f"sees its own {f.get('mine')} process(es) and {len(f.get('foreign', []))} others")


@attack("symlink and hard-link escape")
async def link_escape(lab: Lab) -> Verdict:
    victim = PROJECT / "pyproject.toml"
    if not victim.is_file():
        victim = Path(sandbox.__file__).resolve()
    before, name = _sha(victim), f"attack-{uuid.uuid4().hex}"
    code = f"""
import os
os.symlink({str(victim)!r}, 'link')
os.symlink({str(PROJECT)!r}, 'dir')
# Opening for append proves write access without changing a byte, should the open succeed.
report(via_link=attempt(lambda: open('link', 'ab').close()), hard=attempt(os.link, {str(victim)!r}, 'hard'),
       via_dir=attempt(lambda: open('dir/{name}', 'w').close()))
"""
    run = await lab.run(code)
    dropped = PROJECT / name
    planted = dropped.exists()
    if planted:
        dropped.unlink()
    f = run.facts
    tries = {k: f.get(k, "?") for k in ("via_link", "hard", "via_dir")}
    intact = victim.is_file() and _sha(victim) == before
    contained = intact and not planted and all(v in DENIED for v in tries.values())
    steps = (("via_link", "write via symlink"), ("via_dir", "create via dir symlink"), ("hard", "hard link"))
    how = ", ".join(f"{what} -> {tries[k]} ({_why(tries[k])})" for k, what in steps)
    return Verdict(contained, how, f"{victim.name} {'unchanged' if intact else 'CHANGED'}, "
                   f"project dir {'WRITTEN' if planted else 'untouched'}")
