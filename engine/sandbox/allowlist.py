"""The seccomp allowlist: every system call model code may make, each with why, and the BPF program.

Default deny: a system call this table does not name fails with EPERM, so does one of a kernel
newer than this file; a call of another architecture's table (i386 through `int 0x80`) kills the
process, because its numbers mean other calls. Allowed calls fall in three kinds:

* `ALLOWED`: whatever the arguments (the process's own memory, files Landlock lets it open, its
  own processes and signals, clocks);
* `FILTERED`: one use only, decided by an argument (`RULES` says which): `mmap` without the host's
  hugetlb pool, creation modes without setuid/setgid bits, a unix stream `socketpair` and no
  option that grows its buffers, `clone` without namespaces, `fcntl` without locks, leases or
  signal ownership, `ioctl` of a few queries (any other request gets ENOTTY, the kernel's own "not
  for this descriptor"), `prctl` of a few options, limits of its own but the core dump's, an I/O
  priority no higher than the default;
* `ENOSYS`: calls glibc tries first and falls back from only on ENOSYS (`clone3` -> `clone`,
  whose flags the filter can read; `openat2` -> `openat`, whose mode it can read).

What the table leaves out on purpose, so code gets EPERM: sockets of any kind but that pair,
`sendmsg` (descriptors in flight would outlive the fd limit), ptrace and the other process
inspection calls, namespaces and mounts, keyrings, SysV and POSIX message queues, memfd,
io_uring, bpf, perf, userfaultfd, `flock` and fcntl locks (a lock on a file every run can open is
a signal between runs), inotify and fanotify (a watch on a shared directory shows another run's
file names), `mincore` and `cachestat` (page cache residency of shared files), xattr and
attribute writes, changing ids, and everything of the host (time, modules, reboot, swap, quota).

Standard library only: the zygote loads this file by path (see `confine.py`).
"""

from __future__ import annotations

import struct
from typing import Any

AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, ENOTTY, ENOSYS = 1, 25, 38
LD_ABS, JEQ, JGE, JSET, JA, AND, RET = 0x20, 0x15, 0x35, 0x45, 0x05, 0x54, 0x06
ALLOW, DENY, NOSYS, NOTTY, NOOP = "allow", "deny", "nosys", "notty", "noop"  # the filter's outcomes

# x86_64 numbers. Why each is safe to allow: Landlock decides which files and processes a call may
# reach, the uid and rlimits bound what it may hold; these calls reach nothing else.
ALLOWED: dict[str, tuple[int, str]] = {
    # memory of its own
    "brk": (12, "the heap"), "munmap": (11, "memory"),
    "mprotect": (10, "memory protection (the loader, ctypes closures)"), "mremap": (25, "realloc of large blocks"),
    "madvise": (28, "malloc returns memory"), "msync": (26, "mapped files of its own"),
    "mbind": (237, "NUMA policy of its own memory (OpenBLAS, torch)"), "set_mempolicy": (238, "NUMA policy of itself"),
    "get_mempolicy": (239, "NUMA policy of itself"), "set_mempolicy_home_node": (450, "NUMA policy of its own memory"),
    "membarrier": (324, "memory barriers of its own threads"), "mseal": (462, "sealing its own mappings"),
    "map_shadow_stack": (453, "CET shadow stacks of its own threads"),
    # descriptors and files (Landlock decides which files; the work dir is the only writable place)
    "read": (0, "I/O"), "write": (1, "I/O"), "pread64": (17, "I/O (sqlite3)"), "pwrite64": (18, "I/O (sqlite3)"),
    "readv": (19, "I/O"), "writev": (20, "I/O"), "preadv": (295, "I/O"), "pwritev": (296, "I/O"),
    "preadv2": (327, "I/O"), "pwritev2": (328, "I/O"), "lseek": (8, "I/O"), "close": (3, "descriptors"),
    "close_range": (436, "subprocess closes inherited descriptors"), "dup": (32, "descriptors"),
    "dup2": (33, "descriptors"), "dup3": (292, "descriptors"), "pipe": (22, "pipes (bounded: no F_SETPIPE_SZ)"),
    "pipe2": (293, "pipes (bounded: no F_SETPIPE_SZ)"), "stat": (4, "file status"), "fstat": (5, "file status"),
    "lstat": (6, "file status"), "newfstatat": (262, "file status"), "statx": (332, "file status"),
    "statfs": (137, "free space"), "fstatfs": (138, "free space"), "access": (21, "permission checks"),
    "faccessat": (269, "permission checks"), "faccessat2": (439, "permission checks"),
    "readlink": (89, "links"), "readlinkat": (267, "links"), "getdents": (78, "directory listings"),
    "getdents64": (217, "directory listings"), "getcwd": (79, "working directory"), "chdir": (80, "working directory"),
    "fchdir": (81, "working directory"), "rename": (82, "files in the work dir"),
    "renameat": (264, "files in the work dir"), "renameat2": (316, "files in the work dir"),
    "rmdir": (84, "files in the work dir"), "unlink": (87, "files in the work dir"),
    "unlinkat": (263, "files in the work dir"), "link": (86, "files in the work dir (Landlock: not across rules)"),
    "linkat": (265, "files in the work dir"), "symlink": (88, "files in the work dir"),
    "symlinkat": (266, "files in the work dir"), "truncate": (76, "files in the work dir"),
    "ftruncate": (77, "files in the work dir"), "fallocate": (285, "files (RLIMIT_FSIZE bounds them)"),
    "fsync": (74, "sqlite3"), "fdatasync": (75, "sqlite3"), "sync_file_range": (277, "files of its own"),
    "fadvise64": (221, "read-ahead hints"), "readahead": (187, "read-ahead"), "umask": (95, "creation mask"),
    "sendfile": (40, "shutil copies"), "copy_file_range": (326, "shutil copies"), "splice": (275, "pipes"),
    "tee": (276, "pipes"), "getxattr": (191, "reading attributes (ls -l)"), "lgetxattr": (192, "reading attributes"),
    "fgetxattr": (193, "reading attributes"), "listxattr": (194, "reading attributes"),
    "llistxattr": (195, "reading attributes"), "flistxattr": (196, "reading attributes"),
    "getxattrat": (464, "reading attributes"), "listxattrat": (465, "reading attributes"),
    "file_getattr": (468, "reading attributes"),
    # waiting on descriptors
    "select": (23, "waiting"), "pselect6": (270, "waiting"), "poll": (7, "waiting"), "ppoll": (271, "waiting"),
    "epoll_create": (213, "asyncio"), "epoll_create1": (291, "asyncio"), "epoll_ctl": (233, "asyncio"),
    "epoll_wait": (232, "asyncio"), "epoll_pwait": (281, "asyncio"), "epoll_pwait2": (441, "asyncio"),
    "eventfd": (284, "event counters"), "eventfd2": (290, "event counters"), "timerfd_create": (283, "timers"),
    "timerfd_settime": (286, "timers"), "timerfd_gettime": (287, "timers"), "signalfd": (282, "signals as files"),
    "signalfd4": (289, "signals as files"),
    # the unnamed socket pair (see socketpair below): talking over it
    "sendto": (44, "asyncio's self-pipe"), "recvfrom": (45, "asyncio's self-pipe"),
    "recvmsg": (47, "receiving on the pair"), "shutdown": (48, "closing one way of the pair"),
    "getsockname": (51, "asyncio"), "getpeername": (52, "asyncio"), "getsockopt": (55, "reading socket options"),
    # processes and threads of its own (RLIMIT_NPROC and the cgroup bound them)
    "fork": (57, "processes"), "vfork": (58, "subprocess"), "execve": (59, "subprocess (Landlock: granted dirs)"),
    "execveat": (322, "subprocess"), "exit": (60, "threads end"), "exit_group": (231, "processes end"),
    "wait4": (61, "reaping children"), "waitid": (247, "reaping children"),
    "set_tid_address": (218, "thread start"), "set_robust_list": (273, "thread start"),
    "rseq": (334, "thread start (glibc)"), "arch_prctl": (158, "thread-local storage"),
    "futex": (202, "locks between its threads"), "futex_waitv": (449, "locks between its threads"),
    "futex_wake": (454, "locks between its threads"), "futex_wait": (455, "locks between its threads"),
    "futex_requeue": (456, "locks between its threads"), "sched_yield": (24, "threads"),
    "sched_getaffinity": (204, "os.cpu_count, OpenBLAS"), "sched_getparam": (143, "reading scheduling"),
    "sched_getscheduler": (145, "reading scheduling"), "sched_getattr": (315, "reading scheduling"),
    "sched_get_priority_max": (146, "reading scheduling"), "sched_get_priority_min": (147, "reading scheduling"),
    "sched_rr_get_interval": (148, "reading scheduling"), "getpriority": (140, "reading priority"),
    "ioprio_get": (252, "reading I/O priority"), "getcpu": (309, "which CPU it runs on"),
    # signals (Landlock scopes them to the run; a uid of its own bounds them too)
    "rt_sigaction": (13, "signal handlers"), "rt_sigprocmask": (14, "signal masks"),
    "rt_sigreturn": (15, "signal handlers"), "rt_sigpending": (127, "signals"), "rt_sigtimedwait": (128, "signals"),
    "rt_sigsuspend": (130, "signals"), "sigaltstack": (131, "signal stacks (faulthandler)"), "pause": (34, "signals"),
    "kill": (62, "signals to its own processes"), "tkill": (200, "signals to its own threads"),
    "tgkill": (234, "signals to its own threads"), "restart_syscall": (219, "interrupted calls"),
    "alarm": (37, "timers"), "setitimer": (38, "timers"), "getitimer": (36, "timers"),
    "timer_create": (222, "timers"), "timer_settime": (223, "timers"), "timer_gettime": (224, "timers"),
    "timer_getoverrun": (225, "timers"), "timer_delete": (226, "timers"),
    # clocks and identity (reading)
    "clock_gettime": (228, "time"), "clock_getres": (229, "time"), "clock_nanosleep": (230, "sleeping"),
    "nanosleep": (35, "sleeping"), "gettimeofday": (96, "time"), "time": (201, "time"), "times": (100, "CPU time"),
    "getrusage": (98, "CPU time"), "getpid": (39, "identity"), "getppid": (110, "identity"), "gettid": (186, "identity"),
    "getuid": (102, "identity"), "geteuid": (107, "identity"), "getgid": (104, "identity"),
    "getegid": (108, "identity"), "getresuid": (118, "identity"), "getresgid": (120, "identity"),
    "getgroups": (115, "identity"), "getpgrp": (111, "identity"), "getpgid": (121, "identity"),
    "getsid": (124, "identity"), "capget": (125, "reading capabilities (none)"), "uname": (63, "platform"),
    "sysinfo": (99, "memory size (sysconf)"), "getrlimit": (97, "its limits"),
    "getrandom": (318, "random numbers"),
}

# One use only: the rule in `RULES` lets that use through, everything else gets EPERM.
FILTERED: dict[str, tuple[int, str, str]] = {
    "mmap": (9, "no_hugetlb:3", "memory and mapped files; never from the host's hugetlb pool"),
    "open": (2, "create_mode:2", "open and create files; no setuid/setgid creation mode"),
    "openat": (257, "create_mode:3", "open and create files; no setuid/setgid creation mode"),
    "creat": (85, "create_mode:1", "create files; no setuid/setgid mode"),
    "mkdir": (83, "create_mode:1", "directories; no setgid mode"),
    "mkdirat": (258, "create_mode:2", "directories; no setgid mode"),
    "mknod": (133, "fifo:1", "mkfifo only"), "mknodat": (259, "fifo:2", "mkfifo only"),
    "chmod": (90, "chmod:1", "shutil.copy: modes of files the run's own uid owns, no setuid/setgid"),
    "fchmod": (91, "chmod:1", "modes of files the run's own uid owns, no setuid/setgid"),
    "fchmodat": (268, "chmod:2", "modes of files the run's own uid owns, no setuid/setgid"),
    "fchmodat2": (452, "chmod:2", "modes of files the run's own uid owns, no setuid/setgid"),
    "utime": (132, "own_uid", "times of files the run's own uid owns (copy2, tarfile)"),
    "utimes": (235, "own_uid", "times of files the run's own uid owns"),
    "futimesat": (261, "own_uid", "times of files the run's own uid owns"),
    "utimensat": (280, "own_uid", "times of files the run's own uid owns"),
    "socketpair": (53, "unix_stream", "asyncio's self-pipe: an unnamed unix stream pair, nothing else"),
    "setsockopt": (54, "sockopt", "harmless options of that pair; never a buffer size"),
    "clone": (56, "clone", "threads and processes, never in new namespaces"),
    "fcntl": (72, "fcntl", "descriptor flags; no locks, leases, signal owners or pipe sizes"),
    "ioctl": (16, "ioctl", "terminal and descriptor queries; never a file's flags, a signal owner or terminal input"),
    "prctl": (157, "prctl", "naming threads, its own death signal and dumpability, no_new_privs"),
    "personality": (135, "personality", "querying the personality only"),
    "setrlimit": (160, "rlimit", ("lowering its own limits (raising a hard one needs a capability it lacks); "
                                  "the core dump's: success without effect")),
    "prlimit64": (302, "prlimit", ("its own limits (getrlimit and setrlimit go through it); setting the core "
                                   "dump's: success without effect")),
    "sched_setaffinity": (203, "pid0", "pinning its own threads (torch)"),
    "sched_setparam": (142, "pid0", "its own scheduling"), "sched_setscheduler": (144, "pid0", "its own scheduling"),
    "sched_setattr": (314, "pid0", "its own scheduling"),
    "setpriority": (141, "prio_self", "its own nice value (PRIO_USER would reach the engine's)"),
    "ioprio_set": (251, "ioprio_self", "its own I/O priority, never above the default (best effort, level 4)"),
    "setsid": (112, "own_group", "a session of its own; a no-op where the run has no uid of its own"),
    "setpgid": (109, "own_group", "a process group of its own; a no-op where the run has no uid of its own"),
}

# glibc tries these first and falls back only on ENOSYS, to calls whose arguments the filter reads.
ENOSYS_CALLS: dict[str, tuple[int, str]] = {
    "clone3": (435, "its flags live in memory the filter cannot read: glibc falls back to clone"),
    "openat2": (437, "its mode lives in memory the filter cannot read: callers fall back to openat"),
}

S_ISUID_ISGID = 0o6000
S_IFMT, S_IFIFO = 0o170000, 0o010000
CLONE_NAMESPACES = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
AF_UNIX, SOCK_STREAM, SOCK_TYPE_MASK, SOL_SOCKET = 1, 1, 0xF, 1
# At SOL_SOCKET: REUSEADDR, KEEPALIVE, LINGER, PASSCRED, RCVLOWAT, SNDLOWAT, RCVTIMEO/SNDTIMEO (old
# and new), PEEK_OFF. Not SNDBUF/RCVBUF (and their FORCE): the budget counts each socket at its default.
SOCKOPTS = (2, 9, 13, 16, 18, 19, 20, 21, 42, 66, 67)
# F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_DUPFD_CLOEXEC, F_GETPIPE_SZ, F_GET_SEALS.
FCNTL_CMDS = (0, 1, 2, 3, 4, 1030, 1032, 1034)
# The queries code makes of a descriptor: TCGETS, TCGETS2 (isatty, termios), TIOCGPGRP,
# TIOCOUTQ, TIOCGWINSZ (the terminal's size), FIONREAD, FIONBIO (socket.setblocking), FIONCLEX,
# FIOCLEX (os.set_inheritable), FIOQSIZE, FIGETBSZ, and reading a file's flags, version, extended
# attributes and extents. Not: setting a file's flags or project (FS_IOC_SETFLAGS, FSSETXATTR: an
# ordinary user's run owns every file of the engine's user it can open, read-only or not), a
# descriptor's signal owner (FIOSETOWN, SIOCSPGRP: SIGIO and SIGURG at another process), pushing
# input into a terminal (TIOCSTI), nor whatever a device or a filesystem adds.
IOCTL_CMDS = (0x5401, 0x802C542A, 0x540F, 0x5411, 0x5413, 0x541B, 0x5421, 0x5450, 0x5451, 0x5460, 2,
              0x80086601, 0x80087601, 0x801C581F, 0xC020660B)
# RLIMIT_CORE stays at 1, the value the kernel reads as "never dump", also where core_pattern pipes
# a crash to a helper of the host's (with 0 that helper still runs, as root, outside the sandbox).
# Setting it succeeds without effect: code that turns core dumps off gets what it asked for.
RLIMIT_CORE = 4
# PDEATHSIG set/get, DUMPABLE get/set, KEEPCAPS get, NAME set/get, SECCOMP get, CAPBSET_READ,
# TIMERSLACK set/get, MCE_KILL_GET, CHILD_SUBREAPER set/get, NO_NEW_PRIVS set/get,
# TID_ADDRESS get, THP_DISABLE set/get, SPECULATION_CTRL get/set, SET_VMA (glibc names its maps).
PRCTL_OPTIONS = (1, 2, 3, 4, 7, 15, 16, 21, 23, 29, 30, 34, 36, 37, 38, 39, 40, 41, 42, 52, 53, 0x53564D41)
PERSONALITY_QUERY = 0xFFFFFFFF
PRIO_PROCESS, IOPRIO_WHO_PROCESS = 0, 1
# I/O priorities a run may take (class << 13 | level): none (derived from the nice value, which
# RLIMIT_NICE keeps at or below the engine's), best effort at level 4 (a nice-0 process's) or lower,
# idle. Best effort at levels 0-3 needs no capability, yet puts the run's I/O before the engine's.
IOPRIO_NONE, IOPRIO_BE_DEFAULT, IOPRIO_BE_LOWEST, IOPRIO_IDLE, IOPRIO_END = 0, 0x4004, 0x4007, 0x6000, 0x8000
# mmap's MAP_HUGETLB: pages of the host's hugetlb pool, which no memory cgroup (v1, or v2 without
# memory_hugetlb_accounting) counts, taken from whatever the host reserved them for.
MAP_HUGETLB = 0x40000


def _arg(i: int, high: bool = False) -> int:
    """Offset of argument `i`'s low (or high) 32 bits in struct seccomp_data."""
    return 16 + 8 * i + (4 if high else 0)


class Asm:
    """A tiny classic-BPF assembler. Conditional jumps go to the next instruction or skip one
    (offsets 0 and 1), every farther jump is a JA to a named label (forward only), so no
    offset ever overflows the 8 bits of a conditional jump."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int, int, Any]] = []
        self.labels: dict[str, int] = {}
        self._fresh = 0

    def op(self, code: int, k: Any, jt: int = 0, jf: int = 0) -> None:
        self.code.append((code, jt, jf, k))

    def fresh(self, stem: str) -> str:
        self._fresh += 1
        return f"{stem}.{self._fresh}"

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.op(LD_ABS, offset)

    def go(self, target: str) -> None:
        """End this path: return an outcome, or jump to a rule's label."""
        if target == ALLOW:
            self.op(RET, RET_ALLOW)
        elif target == DENY:
            self.op(RET, RET_ERRNO | EPERM)
        elif target == NOSYS:
            self.op(RET, RET_ERRNO | ENOSYS)
        elif target == NOTTY:
            self.op(RET, RET_ERRNO | ENOTTY)
        elif target == NOOP:
            self.op(RET, RET_ERRNO | 0)  # success without effect
        else:
            self.op(JA, target)

    def when(self, code: int, k: int, target: str) -> None:
        """If A `code` k (JEQ, JGE, JSET): go to `target`; else fall through."""
        self.op(code, k, 0, 1)
        self.go(target)

    def unless(self, code: int, k: int, target: str) -> None:
        """If not A `code` k: go to `target`; else fall through."""
        self.op(code, k, 1, 0)
        self.go(target)

    def build(self) -> bytes:
        out = b""
        for i, (code, jt, jf, k) in enumerate(self.code):
            if code == JA:
                k = self.labels[k] - i - 1
                if k < 0:
                    raise ValueError("BPF jumps go forward only")
            out += struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)
        if len(self.code) > 4096:
            raise ValueError("BPF program longer than the kernel takes")
        return out


def _tree(a: Asm, entries: list[tuple[int, str]]) -> None:
    """A binary search on the system call number in A: a handful of comparisons per call, and
    the kernel's per-number cache of constant answers sees exactly which calls are always allowed."""
    if len(entries) <= 3:
        for nr, target in entries:
            a.when(JEQ, nr, target)
        a.go(DENY)
        return
    mid = len(entries) // 2
    upper = a.fresh("upper")
    a.when(JGE, entries[mid][0], upper)
    _tree(a, entries[:mid])
    a.label(upper)
    _tree(a, entries[mid:])


def _rule(a: Asm, rule: str, own_uid: bool) -> None:
    """The checks of one rule of `FILTERED`, at its label; every path ends in an outcome."""
    name, _, arg = rule.partition(":")
    i = int(arg) if arg else 0
    if name == "create_mode":  # a setuid/setgid file or directory would outlive the run as a way in
        a.load(_arg(i))
        a.when(JSET, S_ISUID_ISGID, DENY)
        a.go(ALLOW)
    elif name == "fifo":  # mkfifo: a FIFO, no setuid/setgid bits
        a.load(_arg(i))
        a.when(JSET, S_ISUID_ISGID, DENY)
        a.op(AND, S_IFMT)
        a.when(JEQ, S_IFIFO, ALLOW)
        a.go(DENY)
    elif name == "chmod":  # without a uid of its own every file of the engine's user would be the run's
        if not own_uid:
            a.go(DENY)
            return
        a.load(_arg(i))
        a.when(JSET, S_ISUID_ISGID, DENY)
        a.go(ALLOW)
    elif name == "own_uid":
        a.go(ALLOW if own_uid else DENY)
    elif name == "own_group":  # without a uid of its own the process group is how cleanup finds them all
        a.go(ALLOW if own_uid else NOOP)
    elif name == "unix_stream":
        a.load(_arg(0))
        a.unless(JEQ, AF_UNIX, DENY)
        a.load(_arg(1))
        a.op(AND, SOCK_TYPE_MASK)
        a.when(JEQ, SOCK_STREAM, ALLOW)
        a.go(DENY)
    elif name == "sockopt":
        a.load(_arg(1))
        a.unless(JEQ, SOL_SOCKET, DENY)
        a.load(_arg(2))
        for option in SOCKOPTS:
            a.when(JEQ, option, ALLOW)
        a.go(DENY)
    elif name == "clone":
        a.load(_arg(0))
        a.when(JSET, CLONE_NAMESPACES, DENY)
        a.go(ALLOW)
    elif name in ("fcntl", "prctl"):
        a.load(_arg(1 if name == "fcntl" else 0))
        for cmd in FCNTL_CMDS if name == "fcntl" else PRCTL_OPTIONS:
            a.when(JEQ, cmd, ALLOW)
        a.go(DENY)
    elif name == "ioctl":  # the request is an unsigned int: its low 32 bits are all of it
        a.load(_arg(1))
        for cmd in IOCTL_CMDS:
            a.when(JEQ, cmd, ALLOW)
        a.go(NOTTY)
    elif name == "rlimit":  # setrlimit(resource, new)
        a.load(_arg(0))
        a.when(JEQ, RLIMIT_CORE, NOOP)
        a.go(ALLOW)
    elif name == "prlimit":  # prlimit64(pid, resource, new, old): itself; the core limit read only
        a.load(_arg(0))
        a.unless(JEQ, 0, DENY)
        a.load(_arg(1))
        a.unless(JEQ, RLIMIT_CORE, ALLOW)
        a.load(_arg(2))
        a.unless(JEQ, 0, NOOP)  # a new limit (a pointer): 64 bits, both halves must be 0 to read only
        a.load(_arg(2, high=True))
        a.when(JEQ, 0, ALLOW)
        a.go(NOOP)
    elif name == "personality":
        a.load(_arg(0))
        a.when(JEQ, PERSONALITY_QUERY, ALLOW)
        a.go(DENY)
    elif name == "pid0":  # itself only: BPF compares with constants, so "its own pid" is 0
        a.load(_arg(0))
        a.when(JEQ, 0, ALLOW)
        a.go(DENY)
    elif name == "prio_self":
        a.load(_arg(0))
        a.unless(JEQ, PRIO_PROCESS, DENY)
        a.load(_arg(1))
        a.when(JEQ, 0, ALLOW)
        a.go(DENY)
    elif name == "ioprio_self":  # ioprio_set(which, who, ioprio): itself, never above the default
        a.load(_arg(0))
        a.unless(JEQ, IOPRIO_WHO_PROCESS, DENY)
        a.load(_arg(1))
        a.unless(JEQ, 0, DENY)
        a.load(_arg(2))  # an int: its low 32 bits are all of it
        a.when(JEQ, IOPRIO_NONE, ALLOW)
        a.when(JGE, IOPRIO_END, DENY)
        a.when(JGE, IOPRIO_IDLE, ALLOW)
        a.when(JGE, IOPRIO_BE_LOWEST + 1, DENY)
        a.when(JGE, IOPRIO_BE_DEFAULT, ALLOW)
        a.go(DENY)
    elif name == "no_hugetlb":
        a.load(_arg(i))
        a.when(JSET, MAP_HUGETLB, DENY)
        a.go(ALLOW)
    else:
        raise ValueError(f"unknown rule {rule!r}")


def filter_program(own_uid: bool) -> bytes:
    """The BPF program. `own_uid`: the run has a uid of its own (as root), so it owns no file
    outside its work dir and may change modes and times; without one (an ordinary user's engine)
    those calls are refused, and setsid/setpgid succeed without effect (see `own_group`)."""
    a = Asm()
    a.load(4)  # arch
    a.unless(JEQ, AUDIT_ARCH_X86_64, "kill")
    a.load(0)  # nr
    a.when(JGE, X32_BIT, DENY)  # x32: the same numbers with a flag; refused whole
    entries = [(nr, ALLOW) for nr, _ in ALLOWED.values()]
    entries += [(nr, NOSYS) for nr, _ in ENOSYS_CALLS.values()]
    rules = sorted({rule for _, rule, _ in FILTERED.values()})
    entries += [(nr, f"rule.{rule}") for nr, rule, _ in FILTERED.values()]
    entries.sort()
    if len({nr for nr, _ in entries}) != len(entries):
        raise ValueError("a system call is listed twice")
    _tree(a, entries)
    for rule in rules:
        a.label(f"rule.{rule}")
        _rule(a, rule, own_uid)
    a.label("kill")
    a.op(RET, RET_KILL_PROCESS)
    return a.build()


def outcome(program: bytes, nr: int, args: tuple[int, ...] = (), arch: int = AUDIT_ARCH_X86_64) -> int:
    """What `program` returns for one call (a small interpreter of the instructions used here):
    tests ask it, and `explain` shows it, without loading the filter."""
    ops = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    # struct seccomp_data in 32-bit words: nr, arch, the instruction pointer, then each argument low, high.
    words = [nr, arch, 0, 0] + [w for a in (list(args) + [0] * 6)[:6] for w in (a & 0xFFFFFFFF, a >> 32 & 0xFFFFFFFF)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ops[pc]
        pc += 1
        if code == LD_ABS:
            acc = words[k // 4]
        elif code == AND:
            acc &= k
        elif code == RET:
            return k
        elif code == JA:
            pc += k
        else:
            hit = {JEQ: acc == k, JGE: acc >= k, JSET: bool(acc & k)}[code]
            pc += jt if hit else jf
