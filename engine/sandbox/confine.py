"""The layers that need no privilege: a Landlock ruleset and a seccomp filter, applied last.

Imported by `zygote.py` (by path, like `child.py`) and by the engine for `kernel_layers`;
standard library only, importing it runs nothing. The zygote calls `prepare()` once per
configuration (it builds the BPF program and decides the Landlock rights); every forked child
calls `apply()` after its rlimits and right before the model's code, in this order:

1. Landlock (`landlock_create_ruleset`, `landlock_add_rule`, `landlock_restrict_self`: raw
   system calls through `ctypes`, because the bindings on PyPI cost several times more per
   run and cover less). Handled: every file access the kernel's ABI knows; TCP bind and
   connect (ABI >= 4); signals and abstract unix sockets scoped to the run (ABI >= 6).
   Granted: read and execute beneath the interpreter's directories and the system's
   (`/usr`, `/lib*`, `/bin`, `/sbin`), read of a few files (`/etc/ld.so.cache`,
   `/etc/localtime`, `/dev/urandom`, ...), read and write of `/dev/null`, read of the run's
   own `/proc/<pid>` and of `/sys/devices/system/cpu`, everything beneath the run's work
   dir. A refused open gets EACCES, a refused link across rules EXDEV, a refused TCP
   bind/connect EACCES, a signal or ptrace to a process outside the run EPERM.
2. seccomp (`prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`, the child is single-threaded so no
   TSYNC is needed): a BPF program built once in the zygote (`filter_program`) and installed
   per run. It refuses with EPERM: socket() of every family and connect/bind/listen/accept
   (a unix stream `socketpair` stays: asyncio and `multiprocessing.Pipe` use it), ptrace,
   process_vm_*, kcmp, pidfd_getfd, process_madvise, the mount calls old and new,
   chroot/pivot_root, unshare, setns, clone with a namespace flag, keyrings, SysV IPC,
   memfd, io_uring, bpf, perf_event_open, userfaultfd, personality changes, prlimit64 of
   another process, scheduling and priority changes of other processes, chmod/chown/
   xattr/utime by path, handle-based opens, module and kexec calls. clone3 gets ENOSYS, so
   glibc falls back to clone, whose flags the filter can read. A system call of another
   architecture's table (i386 through int 0x80, x32) kills the process.
   Raising a hard rlimit needs CAP_SYS_RESOURCE, which the child never holds: the kernel
   refuses it (EPERM) without the filter's help.
   Where a run has no uid of its own (an ordinary user's engine), `setsid` and `setpgid`
   return success without doing anything: every process of the run stays in its process
   group, which is how the zygote finds and kills them all. This is the one refusal that is
   a silent no-op, and it is kept only there.

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
EPERM, ENOSYS = 1, 38

# Read and execute beneath these (as well as the interpreter's own directories).
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/sys/devices/system/cpu")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/dev/urandom", "/dev/random", "/dev/zero", "/dev/full",
                "/proc/cpuinfo", "/proc/meminfo")  # the machine's, not a process's: BLAS and torch read them
RW_FILES = ("/dev/null",)

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
        "bpf": filter_program(keep_group=cfg.get("uid") is None) if use_seccomp else None,
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
        extra = [(f"/proc/{os.getpid()}", FS_READ_FILE | FS_READ_DIR), (workdir, prepared["fs"])]
        for path, rights in extra:  # its own /proc entries (read), and its work dir (everything)
            held.append((os.open(path, os.O_PATH | os.O_CLOEXEC), rights, path))
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


# --- the BPF program (x86_64) -----------------------------------------------------------

AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
LD_ABS, JEQ, JGE, JSET, AND, RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
AF_UNIX, SOCK_STREAM, SOCK_TYPE_MASK = 1, 1, 0xF
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (NEWTIME shares
# clone()'s exit-signal byte and is only accepted by clone3 and unshare, both refused).
CLONE_NAMESPACES = 0x7E020000

REFUSED = {  # name: x86_64 number, refused with EPERM whatever the arguments
    "socket": 41, "connect": 42, "accept": 43, "bind": 49, "listen": 50, "accept4": 288,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
    "process_madvise": 440, "process_mrelease": 448,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "open_tree_attr": 467,
    "unshare": 272, "setns": 308,
    "add_key": 248, "request_key": 249, "keyctl": 250,
    "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65, "semctl": 66,
    "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
    "memfd_create": 319, "memfd_secret": 447,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "chmod": 90, "fchmodat": 268, "fchmodat2": 452, "chown": 92, "lchown": 94, "fchownat": 260,
    "setxattr": 188, "lsetxattr": 189, "removexattr": 197, "lremovexattr": 198, "setxattrat": 463,
    "removexattrat": 466, "utime": 132, "utimes": 235, "futimesat": 261,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "acct": 163, "swapon": 167, "swapoff": 168,
    "quotactl": 179, "quotactl_fd": 443, "fanotify_init": 300, "kexec_load": 246, "kexec_file_load": 320,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "syslog": 103,
}
NR_CLONE, NR_CLONE3, NR_SOCKETPAIR, NR_PERSONALITY, NR_PRLIMIT64 = 56, 435, 53, 135, 302
NR_SETPRIORITY, NR_IOPRIO_SET, NR_UTIMENSAT, NR_SETSID, NR_SETPGID = 141, 251, 280, 112, 109
NR_SELF_ONLY = {"sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203, "sched_setattr": 314}


def _arg(i: int, high: bool = False) -> int:
    """Offset of argument `i`'s low (or high) 32 bits in struct seccomp_data."""
    return 16 + 8 * i + (4 if high else 0)


class _Asm:
    """A tiny BPF assembler: jumps name labels, resolved (forward only) at the end."""

    def __init__(self) -> None:
        self.code: list[tuple[int, Any, Any, int]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: Any = 0, jf: Any = 0) -> None:
        self.code.append((code, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def build(self) -> bytes:
        out = b""
        for i, (code, jt, jf, k) in enumerate(self.code):
            offs = [self.labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
            if not all(0 <= o < 256 for o in offs):
                raise ValueError("BPF jump out of range")
            out += struct.pack("=HBBI", code, offs[0], offs[1], k & 0xFFFFFFFF)
        return out


def filter_program(keep_group: bool) -> bytes:
    """The seccomp BPF program (see the module docstring); `keep_group` makes setsid and
    setpgid succeed without effect."""
    a = _Asm()
    a.op(LD_ABS, 4)  # arch
    a.op(JEQ, AUDIT_ARCH_X86_64, 0, "kill")
    a.op(LD_ABS, 0)  # nr
    a.op(JGE, X32_BIT, "eperm", 0)
    for nr in sorted(REFUSED.values()):
        a.op(JEQ, nr, "eperm", 0)
    a.op(JEQ, NR_CLONE3, "enosys", 0)
    checks = [("clone", NR_CLONE), ("socketpair", NR_SOCKETPAIR), ("personality", NR_PERSONALITY),
              ("prlimit", NR_PRLIMIT64), ("setpriority", NR_SETPRIORITY), ("ioprio", NR_IOPRIO_SET),
              ("utimensat", NR_UTIMENSAT), *(("self_only", nr) for nr in NR_SELF_ONLY.values())]
    for name, nr in checks:
        a.op(JEQ, nr, name, 0)
    if keep_group:
        a.op(JEQ, NR_SETSID, "noop", 0)
        a.op(JEQ, NR_SETPGID, "noop", 0)
    a.op(RET, RET_ALLOW)
    a.label("clone")
    a.op(LD_ABS, _arg(0))
    a.op(JSET, CLONE_NAMESPACES, "eperm", "allow")
    a.label("socketpair")  # only a unix stream pair (type may carry SOCK_CLOEXEC / SOCK_NONBLOCK)
    a.op(LD_ABS, _arg(0))
    a.op(JEQ, AF_UNIX, 0, "eperm")
    a.op(LD_ABS, _arg(1))
    a.op(AND, SOCK_TYPE_MASK)
    a.op(JEQ, SOCK_STREAM, "allow", "eperm")
    a.label("personality")  # only the query
    a.op(LD_ABS, _arg(0))
    a.op(JEQ, 0xFFFFFFFF, "allow", "eperm")
    a.label("prlimit")  # only its own limits (pid 0); getrlimit/setrlimit go through here too
    a.label("self_only")  # scheduling of itself only (pid 0)
    a.op(LD_ABS, _arg(0))
    a.op(JEQ, 0, "allow", "eperm")
    a.label("setpriority")  # PRIO_PROCESS of itself only: PRIO_USER 0 would reach the engine
    a.op(LD_ABS, _arg(0))
    a.op(JEQ, 0, "who0", "eperm")
    a.label("ioprio")  # IOPRIO_WHO_PROCESS (1) of itself only
    a.op(LD_ABS, _arg(0))
    a.op(JEQ, 1, "who0", "eperm")
    a.label("who0")
    a.op(LD_ABS, _arg(1))
    a.op(JEQ, 0, "allow", "eperm")
    a.label("utimensat")  # futimens (no path) stays: it changes only a file already opened
    a.op(LD_ABS, _arg(1))
    a.op(JEQ, 0, 0, "eperm")
    a.op(LD_ABS, _arg(1, high=True))
    a.op(JEQ, 0, "allow", "eperm")
    a.label("noop")
    a.op(RET, RET_ERRNO | 0)
    a.label("allow")
    a.op(RET, RET_ALLOW)
    a.label("enosys")
    a.op(RET, RET_ERRNO | ENOSYS)
    a.label("eperm")
    a.op(RET, RET_ERRNO | EPERM)
    a.label("kill")
    a.op(RET, RET_KILL_PROCESS)
    return a.build()
