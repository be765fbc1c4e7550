"""The layers that need no privilege: a Landlock ruleset and a seccomp filter, applied last.

Imported by `zygote.py` (by path, like `child.py`) and by the engine for `kernel_layers`;
standard library only, importing it runs nothing. The zygote's forker calls `prepare()` once
per kind of run (it builds the BPF program and decides the Landlock rights); every run calls
`apply()` after its rlimits and right before the model's code, in this order:

1. Landlock (`landlock_create_ruleset`, `landlock_add_rule`, `landlock_restrict_self`: raw
   system calls through `ctypes`, because the bindings on PyPI cost several times more per
   run and cover less). Handled: every file access the kernel's ABI knows; TCP bind and
   connect (ABI >= 4); signals and abstract unix sockets scoped to the run (ABI >= 6).
   Granted: read and execute beneath the interpreter's directories and the system's
   (`/usr`, `/lib*`, `/bin`, `/sbin`), read of a few files (`/etc/ld.so.cache`,
   `/etc/localtime`, `/dev/urandom`, ...), read and write of `/dev/null`, read of a few
   entries of the run's own `/proc/<pid>` (`PROC_SELF`: not `net`, which shows the host's
   sockets where there is no network namespace) and of `/sys/devices/system/cpu`, everything
   beneath the run's work dir. A refused open gets EACCES, a refused link across rules EXDEV, a refused TCP
   bind/connect EACCES, a signal or ptrace to a process outside the run EPERM.
2. seccomp (`prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`, the child is single-threaded so no
   TSYNC is needed): a default-deny allowlist, one table with why for each call
   (`allowlist.py`), built once per kind of run in the forker and installed per run. A call it
   does not name gets EPERM; one of another architecture's table kills the process.
   Where a run has no uid of its own (an ordinary user's engine), `setsid` and `setpgid`
   return success without doing anything (every process of the run stays in its process
   group, which is how its supervisor finds and kills them all), and modes and times of files
   cannot be changed at all (every file of the engine's user would be the run's to change).

Only x86_64 system call numbers are written here: on another architecture the filter is
not installed and `kernel_layers()` says so (Landlock's numbers are the same everywhere).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import sysconfig
from typing import Any

if __package__:  # imported as engine.sandbox.confine
    from engine.sandbox import allowlist
else:  # loaded by path in the zygote
    import allowlist  # type: ignore[no-redef]

ARCH = platform.machine()
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock's file rights, by bit; the ABI that introduced each one beyond the first 13.
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
FS_FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
PR_GET_SECCOMP, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 21, 22, 2

# Read and execute beneath these (as well as the interpreter's own directories).
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/sys/devices/system/cpu")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/dev/urandom", "/dev/random", "/dev/zero", "/dev/full",
                "/proc/cpuinfo", "/proc/meminfo")  # the machine's, not a process's: BLAS and torch read them
RW_FILES = ("/dev/null",)
# The run's own /proc/<pid> entries it may read: status, memory maps and descriptors (psutil,
# glibc's stack bounds, subprocess). Not `net` (the host's sockets without a network namespace),
# `task` (each thread's `net` again), `mounts` (the host's mount table), nor the `root`, `cwd` and
# `exe` links (a rule on a link would grant what it points to).
PROC_SELF = ("status", "stat", "statm", "cmdline", "comm", "environ", "auxv", "limits", "maps", "smaps",
             "smaps_rollup", "fd", "fdinfo", "cgroup", "io", "oom_score", "sched", "numa_maps", "wchan")

_disabled: set[str] = set()  # tests: "landlock" / "seccomp" switched off in this process


_lib: Any = None


def _libc() -> Any:
    """libc through ctypes, loaded once (in the zygote: a child pays no dlopen)."""
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL(None, use_errno=True)
        _lib.syscall.restype = ctypes.c_long
    return _lib


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is absent or disabled."""
    if "landlock" in _disabled:
        return 0
    lib = _libc()
    abi = lib.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                      ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(abi), 0)


def seccomp_available() -> bool:
    """Whether this kernel filters system calls and this file knows the architecture's numbers."""
    if "seccomp" in _disabled or ARCH != "x86_64":
        return False
    lib = _libc()
    return int(lib.prctl(PR_GET_SECCOMP, 0, 0, 0, 0)) >= 0  # EINVAL where CONFIG_SECCOMP is off


def kernel_layers() -> dict[str, Any]:
    """What this kernel offers: {"landlock": ABI or 0, "seccomp": bool, "arch": machine}."""
    return {"landlock": landlock_abi(), "seccomp": seccomp_available(), "arch": ARCH}


def handled_fs(abi: int) -> int:
    """Every file right the ABI knows (REFER from 2, TRUNCATE from 3, IOCTL_DEV from 5)."""
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= 1 << 13
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def interpreter_dirs() -> set[str]:
    """Real paths of the interpreter's directories (prefixes, the executable's install,
    the standard library and site-packages); the same set the engine binds into a mount
    namespace, never the engine's checkout unless installed inside a prefix."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    paths.update(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return {os.path.realpath(p) for p in paths if p and os.path.isdir(p)} - {"/"}  # never the whole host


def prepare(cfg: dict[str, Any], layers: dict[str, Any]) -> dict[str, Any]:
    """In the zygote, once per configuration: the rights and paths of the Landlock ruleset
    and the BPF program, so a child only opens paths and makes system calls."""
    abi = layers.get("landlock", 0) if cfg.get("landlock", True) else 0
    use_seccomp = bool(layers.get("seccomp")) and cfg.get("seccomp", True)
    read = FS_READ_FILE | FS_READ_DIR | FS_EXECUTE
    rules: list[tuple[str, int]] = []
    if abi:
        fs = handled_fs(abi)
        dirs = sorted(interpreter_dirs() | {os.path.realpath(d) for d in SYSTEM_DIRS if os.path.isdir(d)})
        rules += [(d, read & fs) for d in dirs]  # (files take only file rights: see below)
        files = list(SYSTEM_FILES)
        if cfg.get("mntns"):
            files += ["/etc/passwd", "/etc/group"]  # the run's stand-ins, not the host's
        rules += [(f, FS_READ_FILE) for f in files if os.path.exists(f)]
        rules += [(f, (FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE) & fs) for f in RW_FILES if os.path.exists(f)]
        rules = [(p, r if os.path.isdir(p) else r & FS_FILE_ONLY) for p, r in rules]
    return {
        "abi": abi,
        "fs": handled_fs(abi) if abi else 0,
        "net": NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
        "scoped": SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0,
        "rules": rules,
        "bpf": allowlist.filter_program(own_uid=cfg.get("uid") is not None) if use_seccomp else None,
    }


def hold(prepared: dict[str, Any]) -> list[tuple[int, int, str]]:
    """In the child, before it drops its uid: O_PATH descriptors of the paths to grant (a
    uid of the run's own may not search the way to an interpreter under /root)."""
    held = []
    for path, rights in prepared["rules"] if prepared["abi"] else ():
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this host lacks (or the zygote's user cannot reach): nothing to grant
        held.append((fd, rights, path))
    return held


def apply(prepared: dict[str, Any], held: list[tuple[int, int, str]], workdir: str) -> None:
    """In the child, last before the model's code: restrict itself with Landlock, then
    install the seccomp filter. Raises OSError when a layer the kernel offers fails."""
    lib = _libc()
    if prepared["abi"]:
        proc = f"/proc/{os.getpid()}"
        for name in PROC_SELF:  # its own /proc entries (read)
            try:
                fd = os.open(f"{proc}/{name}", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # an entry this kernel lacks
            rights = FS_READ_FILE | FS_READ_DIR if name in ("fd", "fdinfo") else FS_READ_FILE
            held.append((fd, rights, f"{proc}/{name}"))
        held.append((os.open(workdir, os.O_PATH | os.O_CLOEXEC), prepared["fs"], workdir))  # everything
        _landlock(lib, prepared, held)
    if prepared["bpf"] is not None:
        _seccomp(lib, prepared["bpf"])


def _landlock(lib: Any, prepared: dict[str, Any], held: list[tuple[int, int, str]]) -> None:
    abi, fs = prepared["abi"], prepared["fs"]
    attr = struct.pack("=QQQ", fs, prepared["net"], prepared["scoped"])
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    buf = ctypes.create_string_buffer(attr[:size], size)
    ruleset = int(lib.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(size), ctypes.c_uint32(0)))
    try:
        if ruleset < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
        for fd, rights, path in held:
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
            if lib.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"landlock_add_rule {path}: {os.strerror(err)}")
        if lib.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        for fd, _, _ in held:
            os.close(fd)
        if ruleset >= 0:
            os.close(ruleset)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _seccomp(lib: Any, program: bytes) -> None:
    prog = _SockFprog(len(program) // 8, program)
    if lib.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")
