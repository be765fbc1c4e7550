"""What a forked run does to become a sandbox, and the cleanup helpers.

Imported only by `zygote.py` and `forker.py` (the zygote's programs, loaded by path), and by the
engine's tests; importing it runs nothing. Standard library only, because the zygote imports it
before anything else and every sandboxed run inherits what it imports.

A run, still root (or the engine's user) right after the fork, in this order:
1. own session (so the whole process group can be killed), default signal dispositions;
2. joins the run's cgroup(s) (v2, or the v1 memory and pids controllers), before it
   allocates anything, so every page and task the run ever makes is counted;
3. new mount namespace where the host allows it (network and IPC ones only where seccomp is
   missing: the filter refuses every socket but an unnamed pair, and all SysV and POSIX IPC);
4. in the mount namespace: the host read-only, a private size-limited tmpfs on /tmp (`nosuid`),
   `hide` covered by empty tmpfs, `expose` (the interpreter's directories, wherever they
   live: /tmp, /root, /opt) bound back read-only, its own /proc, stand-in /etc/passwd and
   /etc/group naming root and the sandbox uids. All but the private /tmp come from a template
   namespace the zygote builds once (`build_template`); the run joins it and copies it
   (`isolate_run_fs`); `isolate_fs` builds everything per run where no template could be built;
5. holds O_PATH descriptors of the paths Landlock will grant (`confine.hold`: the uid may
   not be able to reach them), drops to the run's own uid and checks that no capability
   survived, `PR_SET_NO_NEW_PRIVS`, kills leftovers of that uid; its session keyring is the
   zygote's sealed one (permissions 0: no run can keep a key there);
6. rlimits (RLIMIT_NPROC counts the uid's tasks: see runner._config);
7. last, in `forker.become_run`: the Landlock ruleset and the seccomp filter (`confine.py`),
   which need no privilege and hold the code in every mode, an ordinary user's included,
   then RLIMIT_NOFILE (Landlock's rules take a descriptor each).

The cleanup helpers run after a run that may have left something. `clean_uid` runs as the uid:
SIGKILL to all of the uid's processes (kill(-1) is atomic with respect to fork), then it clears
and invalidates the uid's keyrings and removes its SysV objects and its files in world-writable
directories, so nothing of a run is left for the next lessee of the uid, in this engine process
or another. `clean_group` kills what is left of a run without a uid of its own (its process
group) and removes its work dir. Both remove trees with `remove_tree` (no recursion, no link
followed, whatever modes the run left) and say what they could not remove: the zygote then
quarantines the uid. The zygote skips them when the run's cgroup is empty, the uid holds no key,
and nothing of it can be outside its namespaces (the common case: a fork saved).

Any setup failure exits with `SETUP_FAILED` (125) after writing the error to the run's status
pipe, which the zygote reads and the model's code never holds.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import resource
import signal
import stat
import time
from typing import Any

SETUP_FAILED = 125  # engine.sandbox.runner re-exports it
CLEAN_STRAYS = 10  # the cleanup helper's exit code when it had to kill processes
CLEAN_LEFT = 11  # ... when something of the run is left that it could not remove (the uid is quarantined)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
# Per-mount flags a read-only bind remount must repeat, or the kernel refuses it (EPERM).
KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "relatime": 1 << 21}
CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWIPC = 0x40000000, 0x00020000, 0x08000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_SETPERM, KEYCTL_CLEAR = 0, 1, 5, 7
KEYCTL_INVALIDATE, KEYCTL_GET_PERSISTENT = 21, 22
KEY_SPEC_SESSION_KEYRING = -3
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())
IPC_RMID = 0
# Directories any uid may create entries in: where a run without a mount namespace leaves files.
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


class Libc:
    """The few libc calls `os` lacks, raising OSError like `os` does."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        self.lib.syscall.restype = ctypes.c_long

    @staticmethod
    def check(ret: int, what: str) -> None:
        """Raise OSError with errno when a libc call returned nonzero."""
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(self, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        """mount(2)."""
        args = [None if a is None else a.encode() for a in (src, target, fstype)]
        self.check(self.lib.mount(*args, flags, None if data is None else data.encode()), f"mount {target}")

    def umount(self, target: str) -> None:
        """umount2(2) with MNT_DETACH."""
        self.check(self.lib.umount2(target.encode(), MNT_DETACH), f"umount {target}")

    def unshare(self, flags: int) -> None:
        """unshare(2) (os.unshare arrives in 3.12)."""
        self.check(self.lib.unshare(flags), "unshare")

    def setns(self, fd: int, kind: int) -> None:
        """setns(2) (os.setns arrives in 3.12)."""
        self.check(self.lib.setns(fd, kind), "setns")

    def prctl(self, option: int, arg: int, what: str) -> None:
        """prctl(2) with one argument."""
        self.check(self.lib.prctl(option, arg, 0, 0, 0), what)

    def keyctl(self, *args: int) -> int:
        """keyctl(2) through syscall(2) (no libkeyutils needed); -1 with errno set on failure."""
        if SYS_KEYCTL is None:
            return -1
        return int(self.lib.syscall(SYS_KEYCTL, *(ctypes.c_long(a) for a in args)))


_libc: Libc | None = None


def libc() -> Libc:
    """The process's `Libc`, made once (in the zygote, so no forked child pays the dlopen)."""
    global _libc
    if _libc is None:
        _libc = Libc()
    return _libc


def become(uid: int) -> None:
    """Drop from root to `uid` (group too, no supplementary groups), and check that no
    capability survived (root without CAP_SYS_ADMIN still holds CAP_PERFMON, CAP_KILL, ...)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to a uid drops every capability
    held = capabilities_held()
    if held:
        raise OSError(1, f"capabilities survived the uid drop: {held:#x}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def capabilities_held() -> int:
    """This process's effective | permitted | inheritable capability bits (capget(2))."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (_CapData * 2)()
    if libc().lib.capget(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capget: {os.strerror(err)}")
    words = [d.effective | d.permitted | d.inheritable for d in data]
    return words[0] | words[1] << 32


def join_cgroups(cgroups: list[list[Any]]) -> None:
    """Create (if needed) each `[dir, [[file, value], ...]]` cgroup, write its limits in
    order (v1 wants memsw raised before the limit and lowered after it), move in."""
    for path, settings in cgroups:
        os.makedirs(path, exist_ok=True)
        for name, value in settings:
            target = os.path.join(path, name)
            if os.path.exists(target):  # memsw/swap files exist only with swap accounting
                with open(target, "w") as f:
                    f.write(str(value))
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def _account_files(uids: range, home: str) -> dict[str, str]:
    """Stand-in /etc/passwd and /etc/group naming root and the sandbox uids only."""
    return {
        "passwd": "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n" + "".join(
            f"sandbox:x:{uid}:{uid}:sandbox:{home}:/usr/sbin/nologin\n" for uid in uids),
        "group": "root:x:0:\n" + "".join(f"sandbox:x:{uid}:\n" for uid in uids),
    }


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def isolate_fs(libc: Libc, cfg: dict[str, Any], uid: int) -> None:
    """In the new mount namespace: private /tmp, hidden paths, own /proc, the rest read-only."""
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here propagates to the host
    # Held open before anything is covered: the interpreter's directories are bound back from
    # these, wherever they live (a venv under /tmp, pyenv under /root, a checkout under /home).
    held = [(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), path) for path in cfg["expose"]]
    libc.mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk']},nr_inodes=8192,mode=755")
    _hide_and_bind_back(libc, cfg["hide"], held)
    _stand_in_accounts(libc, range(uid, uid + 1), cfg["workdir"])
    try:  # a /proc of our own that shows the sandbox only its own processes
        libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        pass  # the host's /proc stays; other uids' processes can still not be signalled
    os.mkdir(cfg["workdir"], 0o700)
    os.chown(cfg["workdir"], uid, uid)
    _make_read_only(libc)


def _hide_and_bind_back(libc: Libc, hide: list[str], held: list[tuple[int, str]]) -> None:
    """Cover each hidden path with an empty tmpfs, then bind the held directories back over it
    (from their fds, opened before anything was covered), closing each fd."""
    for path in hide:
        libc.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=755")
    for fd, path in held:
        os.makedirs(path, exist_ok=True)
        libc.mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)


def build_template(libc: Libc, cfg: dict[str, Any]) -> None:
    """A mount namespace every run's starts as a copy of, built once per zygote: hidden
    paths, the interpreter's directories bound back, a /proc that shows a run only its own
    processes, everything read-only, /tmp included (each run mounts its own tmpfs over it).
    A run then pays for its private /tmp only (`isolate_run_fs`), not for ~40 mounts."""
    libc.unshare(CLONE_NEWNS)
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here propagates to the host
    outside = [p for p in cfg["expose"] if not _under(p, "/tmp")]  # /tmp ones: per run, see below
    held = [(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), path) for path in outside]
    _hide_and_bind_back(libc, cfg["hide"], held)
    # The stand-in accounts of every sandbox uid, written on a small tmpfs that is detached again
    # once they are bound in place (the bind mounts keep the files; the host's /tmp shows again).
    libc.mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=16,mode=755")
    first, count = cfg["accounts"]
    _stand_in_accounts(libc, range(first, first + count), cfg["workdir"])
    libc.umount("/tmp")
    try:  # a /proc of our own that shows the sandbox only its own processes
        libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        pass  # the host's /proc stays; other uids' processes can still not be signalled
    _make_read_only(libc, writable="")


def isolate_run_fs(libc: Libc, cfg: dict[str, Any], uid: int) -> None:
    """In a copy of the template: a private size-limited tmpfs on /tmp, the interpreter's
    directories under /tmp (a venv) bound back read-only, the workdir (the template holds the
    stand-in accounts)."""
    inside = [p for p in cfg["expose"] if _under(p, "/tmp")]
    held = [(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), path) for path in inside]
    libc.mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk']},nr_inodes=8192,mode=755")
    for fd, path in held:
        os.makedirs(path, exist_ok=True)
        libc.mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
        libc.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        if not os.statvfs(path).f_flag & os.ST_RDONLY:
            raise OSError(30, f"could not make {path} read-only")
    os.mkdir(cfg["workdir"], 0o700)
    os.chown(cfg["workdir"], uid, uid)


def _stand_in_accounts(libc: Libc, uids: range, home: str) -> None:
    for name, text in _account_files(uids, home).items():
        target = f"/etc/{name}"
        if os.path.isfile(target):  # the host's users and groups are none of the code's business
            stand_in = f"/tmp/.{name}"
            with open(stand_in, "w") as f:
                f.write(text)
            os.chmod(stand_in, 0o644)
            libc.mount(stand_in, target, None, MS_BIND)
            libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os.unlink(stand_in)  # the bind mount keeps the file alive


def _make_read_only(libc: Libc, writable: str = "/tmp") -> None:
    """Remount every mount point but `writable` (the private /tmp) read-only, then verify it."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    points = [(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), r[4]), r[5].split(",")) for r in rows]
    for point, opts in points:
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | sum(KEEP.get(o, 0) for o in opts)
        try:  # a bind remount changes this mount only, never the host's filesystem
            if point != writable:
                libc.mount(None, point, None, flags)
        except OSError:
            pass  # hidden under one of our tmpfs, or no mount point any more: checked next
    for point, _ in points:  # whatever the child can reach must now be read-only, /tmp aside
        try:
            os.statvfs(point)
        except OSError:
            continue
        if not os.statvfs(point).f_flag & os.ST_RDONLY and point != writable:
            raise OSError(30, f"could not make {point} read-only")


def hold_import_paths(paths: list[str]) -> dict[str, int]:
    """O_PATH descriptors of the import path's directories, opened while still root.

    Without a mount namespace a dropped uid cannot reach an interpreter under /root (pyenv,
    conda): `/proc/self/fd/N` reaches the directory itself, skipping its parents' modes."""
    held = {}
    for path in paths:
        try:
            held[path] = os.open(path, os.O_PATH | os.O_DIRECTORY)
        except OSError:
            pass  # a zip or a missing entry: imports skip it anyway
    return held


def reroute_import_paths(sys_path: list[str], held: dict[str, int]) -> None:
    """Replace the entries this uid cannot search by their held descriptors, in place."""
    for i, path in enumerate(sys_path):
        fd = held.get(path)
        if fd is not None and not os.access(path, os.R_OK | os.X_OK):
            sys_path[i] = f"/proc/self/fd/{fd}"


def enter(cfg: dict[str, Any], sys_path: list[str], before_drop: Any = None) -> None:
    """Turn this freshly forked process into the run's sandbox (see the module docstring).
    `before_drop()` runs in the run's final mount namespace, before the uid drop."""
    lib = libc()
    os.setsid()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)  # SIGPIPE: as python does
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    # 1, not 0: where core_pattern pipes a crash to a helper of the host's, the kernel runs that
    # helper (as root, outside every layer here) whatever the limit, but for exactly 1. A hard
    # limit of 0 (a host that forbids core dumps) cannot be raised without a capability: kept.
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    core = 1 if hard == resource.RLIM_INFINITY or hard >= 1 else 0
    resource.setrlimit(resource.RLIMIT_CORE, (core, core))
    _first_for_the_oom_killer()
    join_cgroups(cfg["cgroups"])  # in the host's mount namespace: /sys is read-only in ours
    template = cfg.get("template")
    if template is not None:
        lib.setns(template, CLONE_NEWNS)
        os.close(template)
    flags = (CLONE_NEWNET if cfg["netns"] else 0) | (CLONE_NEWNS if cfg["mntns"] else 0)
    flags |= CLONE_NEWIPC if cfg["ipcns"] else 0
    if flags:
        lib.unshare(flags)
    uid = cfg["uid"]
    held = hold_import_paths(sys_path) if uid is not None and not cfg["mntns"] else {}
    if cfg["mntns"] and template is not None:
        isolate_run_fs(lib, cfg, uid if uid is not None else os.getuid())
    elif cfg["mntns"]:
        isolate_fs(lib, cfg, uid if uid is not None else os.getuid())
    else:
        os.mkdir(cfg["workdir"], 0o700)
        if uid is not None:
            os.chown(cfg["workdir"], uid, uid)
    if before_drop is not None:
        before_drop()
    if uid is not None:
        become(uid)
        try:  # leftovers of a crashed engine that held this uid before us
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reroute_import_paths(sys_path, held)
        # The uid change made us undumpable (root-owned /proc/self); an exec by the uid would
        # have reset that. Only this uid's processes gain access, and nothing here is secret.
        lib.prctl(PR_SET_DUMPABLE, 1, "prctl(PR_SET_DUMPABLE)")
    lib.prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")  # no setuid binary undoes the drop
    lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")  # the zygote gone: so are we
    os.chdir(cfg["workdir"])


def _first_for_the_oom_killer() -> None:
    """Make this run (and all it forks) the OOM killer's first choice on the host, before the
    engine or the trainer: where only rlimits bound a run, the kernel's own memory for it (page
    tables of a sparse address space) is counted by none of them. Best effort: a /proc that
    refuses the write leaves the kernel's ordinary choice."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def set_limits(cfg: dict[str, Any]) -> None:
    """rlimits, after the uid drop (see runner._config). RLIMIT_AS bounds growth past what
    the process already maps (the zygote's preloaded modules), not the inherited total.
    Real-time scheduling and a raised priority stay refused whatever the engine's own limits
    allow (a run would take CPU from the engine and the other runs). RLIMIT_SIGPENDING is far below
    the host's: the kernel counts queued signals per user (see runner.RUN_SIGNALS). RLIMIT_NOFILE comes last,
    in `set_file_limit`: Landlock's rules open a descriptor each."""
    limits = dict(cfg["rlimits"])
    limits["AS"] += _mapped_bytes()
    for name in ("NPROC", "FSIZE", "AS", "SIGPENDING"):
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (limits[name], limits[name]))
    for name in ("RTPRIO", "NICE"):
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["CPU"], limits["CPU"] + 1))  # SIGXCPU, then SIGKILL


def set_file_limit(cfg: dict[str, Any]) -> None:
    """RLIMIT_NOFILE, once the Landlock rules' descriptors are closed."""
    files = cfg["rlimits"]["NOFILE"]
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def reaped(wake: int | None = None) -> list[tuple[int, int]]:
    """Empty the SIGCHLD wakeup pipe `wake`, then reap every exited child without waiting:
    (pid, exit code as `os.waitstatus_to_exitcode` gives it) each."""
    try:
        while wake is not None and os.read(wake, 512):
            pass
    except BlockingIOError:
        pass
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, os.waitstatus_to_exitcode(status)))


def _signalable() -> bool:
    """As a uid: whether kill(-1) reaches any other process of it (a zombie included)."""
    try:
        os.kill(-1, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _has_processes(uid: int) -> bool:
    """As `uid`: whether another live process of it exists. kill(-1, 0) reaches exactly the
    uid's processes (cheap, and usually ESRCH); only when it hits something is /proc read,
    because a zombie waiting for its reaper counts for kill() but holds nothing. The scan is
    not one instant: a chain of processes that each fork and exit at once is never where it
    looks, so it only says whether something is left after a kill(-1), never whether to kill."""
    return _signalable() and _living(uid)


def _living(uid: int) -> bool:
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            alive = fields["State"].split()[0] != "Z" and int(pid) != os.getpid()
            if alive and fields["Uid"].split()[0] == str(uid):
                return True
        except (OSError, ValueError, KeyError):
            pass  # not a process, or gone meanwhile
    return False


def key_state(uid: int) -> str:
    """The uid's key counts and bytes from /proc/key-users ("" when it holds no key)."""
    try:
        with open("/proc/key-users") as f:
            for line in f:
                head, _, rest = line.partition(":")
                if head.strip() == str(uid):
                    return " ".join(rest.split()[1:])  # without the reference count
    except OSError:
        return "?"  # cannot tell: never equal to a recorded state
    return ""


def seal_session_keyring(libc: Libc) -> None:
    """For the zygote: a fresh session keyring nobody, possessor included, may use. Every
    child inherits it, so no run can stash a key where a later run would find it."""
    if libc.keyctl(KEYCTL_JOIN_SESSION_KEYRING, 0) >= 0:
        libc.keyctl(KEYCTL_SETPERM, KEY_SPEC_SESSION_KEYRING, 0)


def cgroups_busy(cgroups: list[list[Any]]) -> bool:
    """Whether any task is left in the run's cgroups (tasks cannot leave them by themselves).
    Read from a counter where there is one (v2's `populated`, the pids controller's count, which
    holds a task from its fork until it is reaped): listing `cgroup.procs` is no instant, and a
    chain of processes that each fork and exit at once can be missed by it."""
    for path, _ in cgroups:
        try:
            events = os.path.join(path, "cgroup.events")
            if os.path.exists(events):
                with open(events) as f:
                    if "populated 1" in f.read():
                        return True
                continue
            counter = os.path.join(path, "pids.current")
            name = counter if os.path.exists(counter) else os.path.join(path, "cgroup.procs")
            with open(name) as f:
                if f.read().strip() not in ("", "0"):
                    return True
        except OSError:
            return True  # cannot tell: clean anyway
    return False


SYSV_ID = {"shm": "shmid", "msg": "msqid", "sem": "semid"}


def sysv_objects() -> list[tuple[str, dict[str, str]]]:
    """Every SysV object of this IPC namespace: (kind, its /proc/sysvipc fields by column name)."""
    found = []
    for kind in SYSV_ID:
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = f.read().splitlines()
        except OSError:
            continue
        found += [(kind, dict(zip(header.split(), row.split()))) for row in rows]
    return found


def _remove_ipc(uid: int) -> None:
    """Remove the uid's SysV objects (only needed when runs share the host's IPC namespace)."""
    lib = ctypes.CDLL(None, use_errno=True)
    calls = {"shm": lib.shmctl, "msg": lib.msgctl, "sem": lib.semctl}
    for kind, fields in sysv_objects():
        if fields.get("uid") == str(uid) or fields.get("cuid") == str(uid):
            calls[kind](int(fields[SYSV_ID[kind]]), IPC_RMID, None)


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _enter_dir(parent: int, name: str) -> int:
    """Open directory `name` beneath `parent` (never through a link) and make it u+rwx: the run
    may have left it unreadable or unwritable to its owner (fchmod through a descriptor)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=parent)
    except PermissionError:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{handle}", 0o700)  # the directory itself, not a name a link could redirect
        finally:
            os.close(handle)
        fd = os.open(name, flags, dir_fd=parent)
    if os.fstat(fd).st_mode & 0o700 != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def _unlink_files(fd: int) -> str | None:
    """Unlink every entry of directory `fd` but directories; the name of one directory left, if any."""
    subdir = None
    with os.scandir(fd) as entries:
        names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_dir in names:
        if is_dir:
            subdir = subdir or name
        else:
            os.unlink(name, dir_fd=fd)  # a link is removed, never followed
    return subdir


def _remove_beneath(parent: int, name: str, deadline: float | None) -> None:
    """Remove `name` beneath directory `parent` depth first, one directory open at a time (a tree
    deeper than the descriptor limit or the recursion limit is no harder), going back up through
    ".." checked against the directory it came from."""
    try:
        st = os.lstat(name, dir_fd=parent)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    names, idents = [name], [_ident(parent)]
    fd = _enter_dir(parent, name)
    try:
        while names:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(names)} levels deep when time ran out")
            sub = _unlink_files(fd)
            if sub is not None:
                idents.append(_ident(fd))
                inner = _enter_dir(fd, sub)
                os.close(fd)
                fd, inner = inner, -1
                names.append(sub)
                continue
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = up
            if _ident(fd) != idents.pop():
                raise OSError(f"{names[-1]!r} was moved while it was being removed")
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)


def remove_tree(path: str, deadline_s: float | None = 60.0) -> str:
    """Remove `path` and everything beneath it, whatever modes, depth or links the run left:
    without recursion, never following a link, every error caught. "" once `path` is gone,
    else what is left and why (it is never raised: the caller reports it). `deadline_s=None`
    where nothing of the run is alive to add to the tree: it is finite, and removed whole however
    long that takes (a run on many cores makes entries faster than one process removes them, so a
    clock would leave them on the host and quarantine the uid)."""
    head, name = os.path.split(os.path.normpath(path))
    problem = ""
    try:
        parent = os.open(head or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"{path}: {type(e).__name__}: {e}"
    try:
        _remove_beneath(parent, name, None if deadline_s is None else time.monotonic() + deadline_s)
    except Exception as e:  # noqa: BLE001 - whatever it was, the check below says what is left
        problem = f"{type(e).__name__}: {e}"
    finally:
        os.close(parent)
    try:
        os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as e:
        problem = problem or f"{type(e).__name__}: {e}"
    return f"{path} is left ({problem or 'no error seen'})"


def _remove_files(uid: int, workdir: str | None, deadline_s: float | None) -> list[str]:
    """Remove what the uid created in the world-writable directories, the workdir included;
    what could not be removed."""
    left = [remove_tree(workdir, deadline_s)] if workdir else []
    for parent in SHARED_DIRS:
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
            except OSError:
                continue  # gone meanwhile
            left.append(remove_tree(entry.path, deadline_s))
    return [problem for problem in left if problem]


def _sysv_left(uid: int) -> list[str]:
    return [f"SysV {kind} {fields[SYSV_ID[kind]]}" for kind, fields in sysv_objects() if fields.get("uid") == str(uid)]


def clean_group(pgid: int | None, workdir: str | None, reap: Any = None) -> tuple[int, str]:
    """Without a uid of the run's own: SIGKILL what is left of its process group until it is gone
    (seccomp keeps every process of the run in it), then remove the working directory. `reap()`
    reaps the killed where they are our children (a zombie still counts as a member).
    (exit code, what is left): 0 or `CLEAN_STRAYS` when it killed something, `CLEAN_LEFT` with
    the reason when something could not be removed."""
    found = False
    if pgid is not None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
                found = True
            except OSError:
                break  # ESRCH: the group is gone (its zombies reaped too)
            if reap is not None:
                reap()
            time.sleep(0.002)
        else:
            return CLEAN_LEFT, f"process group {pgid} survived SIGKILL for 5 s"
    left = remove_tree(workdir, None) if workdir else ""  # the group is gone: nothing adds to it
    if left:
        return CLEAN_LEFT, left
    return (CLEAN_STRAYS if found else 0), ""


def clean_uid(uid: int, workdir: str | None, shared_ipc: bool, shared_fs: bool) -> tuple[int, str]:
    """The cleanup helper, already forked: as `uid`, kill everything of it, then clear its
    keyrings, SysV objects (`shared_ipc`) and files (`shared_fs`), and check that none is left.
    (exit code, what is left): 0 or `CLEAN_STRAYS` when processes had to be killed,
    `CLEAN_LEFT` with the reason when something survived."""
    become(uid)
    lib = libc()
    found = False
    if _signalable():  # a live process, or a zombie: kill either way, a scan could miss a fork chain
        found = _living(uid)
        os.kill(-1, signal.SIGKILL)  # atomic with respect to fork, unlike any scan
        deadline = time.monotonic() + 5
        while _has_processes(uid) and time.monotonic() < deadline:  # pending until each one runs
            time.sleep(0.002)
    # The user, user-session and persistent keyrings outlive every process of the uid: empty
    # them and invalidate them (the kernel then frees them), by serial number, because looking
    # one up by its special id would create the others again.
    serials = [lib.keyctl(KEYCTL_GET_KEYRING_ID, ring, 0) for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING)]
    serials.append(lib.keyctl(KEYCTL_GET_PERSISTENT, -1, 0))  # -1: our uid; 0: link nowhere
    for serial in serials:
        if serial > 0:
            lib.keyctl(KEYCTL_CLEAR, serial)
            lib.keyctl(KEYCTL_INVALIDATE, serial)
    left = []
    alive = _has_processes(uid)
    if alive:
        left.append(f"processes of uid {uid} survived SIGKILL for 5 s")
    if shared_ipc:
        _remove_ipc(uid)
        left += _sysv_left(uid)
    if shared_fs:  # on a clock only while a survivor could still add to what it removes
        left += _remove_files(uid, workdir, 60.0 if alive else None)
    if left:
        return CLEAN_LEFT, "; ".join(left)[:2000]
    return (CLEAN_STRAYS if found else 0), ""
