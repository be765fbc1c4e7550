"""The layers that need no privilege (engine/sandbox/confine.py), each against the real
sandbox, and each with its private switch off: a test that passes with the layer on must
see the hole open with it off, so it cannot pass whatever the code does. Also: the seccomp
program's shape, the probe's warning when a layer is missing, multiprocessing's clear error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import signal
import struct
from collections.abc import Iterator

import pytest

from engine.sandbox import allowlist, client, confine, probing
from engine.sandbox import runner as sandbox
from engine.sandbox.runner import SandboxLimits, run_python
from engine.tools.code_interpreter import format_result

FAST = SandboxLimits(timeout_s=10)
KERNEL = confine.kernel_layers()
needs_landlock = pytest.mark.skipif(KERNEL["landlock"] < 6, reason="needs Landlock ABI >= 6 (kernel 6.12+)")
needs_seccomp = pytest.mark.skipif(not KERNEL["seccomp"], reason="needs seccomp on x86_64")


@pytest.fixture
def layers_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """The runner's private switch, emptied after the test."""
    off: set[str] = set()
    monkeypatch.setattr(sandbox, "_LAYERS_OFF", off)
    yield off


def run(code: str) -> tuple[str, str]:
    result = asyncio.run(run_python(code, FAST))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip(), result.stderr


# A file every mode leaves readable by file modes and mounts (world-readable, under /etc,
# which the mount namespace keeps read-only but visible): only Landlock refuses it.
READ_ETC = """
import os
target = next(p for p in ('/etc/hostname', '/etc/hosts', '/etc/fstab', '/etc/debian_version')
              if os.path.isfile(p) and os.path.realpath(p).startswith('/etc/'))
try:
    open(target).read()
    print('read')
except PermissionError as e:
    print('EACCES' if e.errno == 13 else e.errno)
"""


@needs_landlock
@pytest.mark.parametrize("off", [False, True], ids=["on", "switched-off"])
def test_landlock_refuses_files_outside_its_rules(layers_off: set[str], off: bool) -> None:
    if off:
        layers_off.add("landlock")
    out, _ = run(READ_ETC + "open('mine.txt', 'w').write('x'); print(open('mine.txt').read())\n")
    assert out.splitlines() == (["read", "x"] if off else ["EACCES", "x"])  # the work dir stays writable


SECCOMP_CALLS = """
import ctypes, fcntl, os, socket
lib = ctypes.CDLL(None, use_errno=True)
lib.syscall.restype = ctypes.c_long
def t(fn):
    try:
        fn()
        return 'ok'
    except OSError as e:
        return e.errno
def raw(nr, *args):
    return 'ok' if lib.syscall(nr, *args) >= 0 else ctypes.get_errno()
f = open('lockme', 'w')
a, b = socket.socketpair()
print(t(lambda: os.close(os.memfd_create('x'))), t(lambda: socket.socket(socket.AF_UNIX).close()),
      t(lambda: fcntl.flock(f, fcntl.LOCK_EX)), t(lambda: fcntl.lockf(f, fcntl.LOCK_EX)),
      t(lambda: a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)), raw(294, 0),
      t(lambda: os.close(os.open('suid', os.O_CREAT | os.O_WRONLY, 0o4755))), raw(999),
      t(lambda: [s.close() for s in socket.socketpair()]))
"""


@needs_seccomp
@pytest.mark.parametrize("off", [False, True], ids=["on", "switched-off"])
def test_seccomp_refuses_what_it_does_not_allow_but_not_a_socketpair(layers_off: set[str], off: bool) -> None:
    # memfd, a socket, flock, fcntl locks, a socket buffer size, inotify, a setuid file: EPERM; a
    # system call no kernel has yet: EPERM too (ENOSYS without the filter); the unnamed pair stays.
    if off:
        layers_off.add("seccomp")
    out, _ = run(SECCOMP_CALLS)
    assert out.split() == (["ok"] * 7 + ["38", "ok"] if off else ["1"] * 8 + ["ok"])


# i386's getpid through int 0x80 from a 64-bit process: another table's numbers, so the filter kills it.
FOREIGN_ABI = """
import ctypes, mmap
code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20; int 0x80; ret
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
print('before', flush=True)
ctypes.CFUNCTYPE(ctypes.c_int)(address)()
print('after')
"""


@needs_seccomp
def test_a_foreign_system_call_table_kills_the_run_and_says_so() -> None:
    result = asyncio.run(run_python(FOREIGN_ABI, FAST))
    assert result.returncode == -signal.SIGSYS and result.stdout == "before\n"
    text = format_result(result, FAST.timeout_s)
    assert text.error == "crash" and "killed by SIGSYS" in text.text, text.text


ALLOW, EPERM, ENOTTY, ENOSYS, NOOP = (allowlist.RET_ALLOW, allowlist.RET_ERRNO | 1, allowlist.RET_ERRNO | 25,
                                      allowlist.RET_ERRNO | 38, allowlist.RET_ERRNO)
NR = {name: spec[0] for table in (allowlist.ALLOWED, allowlist.FILTERED, allowlist.ENOSYS_CALLS)
      for name, spec in table.items()}


@pytest.mark.parametrize("own_uid", [True, False], ids=["own-uid", "no-uid"])
def test_the_allowlist_denies_by_default_and_checks_the_architecture_first(own_uid: bool) -> None:
    prog = allowlist.filter_program(own_uid)
    assert len(prog) % 8 == 0 and len(prog) // 8 < 4096
    ops = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    assert ops[0] == (allowlist.LD_ABS, 0, 0, 4) and ops[1][3] == allowlist.AUDIT_ARCH_X86_64
    for name, (nr, why) in allowlist.ALLOWED.items():
        assert why and allowlist.outcome(prog, nr, (7, 0o6777, 1 << 40)) == ALLOW, name
    for name, (nr, why) in allowlist.ENOSYS_CALLS.items():
        assert why and allowlist.outcome(prog, nr) == ENOSYS, name
    assert all(why for _, _, why in allowlist.FILTERED.values())
    # Calls nobody listed, this kernel's and a future one's, get EPERM; so does the x32 table.
    for nr in (240, 241, 64, 29, 248, 250, 253, 254, 294, 300, 425, 73, 469, 470, 999):
        assert allowlist.outcome(prog, nr) == EPERM, nr
    assert allowlist.outcome(prog, allowlist.X32_BIT | 0) == EPERM
    assert allowlist.outcome(prog, 20, arch=0x40000003) == allowlist.RET_KILL_PROCESS  # i386: other numbers


def _says(prog: bytes, name: str, *args: int) -> int:
    return allowlist.outcome(prog, NR[name], args)


def test_the_argument_rules_let_one_use_through() -> None:
    own, user = allowlist.filter_program(True), allowlist.filter_program(False)
    for prog in (own, user):
        assert _says(prog, "openat", -100, 0, 0o100 | 0o1, 0o644) == ALLOW  # O_CREAT, an ordinary mode
        assert _says(prog, "openat", -100, 0, 0o100, 0o4755) == EPERM  # setuid on creation
        assert _says(prog, "open", 0, 0o100, 0o2755) == EPERM and _says(prog, "creat", 0, 0o6700) == EPERM
        assert _says(prog, "mkdir", 0, 0o2775) == EPERM and _says(prog, "mkdirat", -100, 0, 0o755) == ALLOW
        assert _says(prog, "mknodat", -100, 0, 0o010644) == ALLOW  # mkfifo
        assert _says(prog, "mknodat", -100, 0, 0o020644) == EPERM  # a character device
        assert _says(prog, "socketpair", 1, 1 | 0o2000000, 0) == ALLOW  # AF_UNIX, SOCK_STREAM | CLOEXEC
        assert _says(prog, "socketpair", 1, 2, 0) == EPERM and _says(prog, "socketpair", 2, 1, 0) == EPERM
        assert _says(prog, "setsockopt", 3, 1, 9) == ALLOW  # SO_KEEPALIVE
        for option in (7, 8, 32, 33, 26, 50):  # buffer sizes, socket filters
            assert _says(prog, "setsockopt", 3, 1, option) == EPERM
        assert _says(prog, "clone", 0x3D0F00) == ALLOW  # a thread
        assert _says(prog, "clone", 0x10000000 | 17) == EPERM  # CLONE_NEWUSER
        for cmd in (0, 1, 2, 3, 4, 1030):
            assert _says(prog, "fcntl", 3, cmd) == ALLOW
        for cmd in (5, 6, 7, 36, 37, 38, 8, 1024, 1026, 1031):  # locks, SIGIO owner, lease, dnotify, pipe size
            assert _says(prog, "fcntl", 3, cmd) == EPERM
        for request in (0x5401, 0x5413, 0x541B, 0x5421, 0x5451, 0x80086601, 1 << 32 | 0x5401):  # queries
            assert _says(prog, "ioctl", 1, request) == ALLOW, hex(request)
        # TIOCSTI, FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR, FIOSETOWN, SIOCSPGRP, FIOASYNC, FICLONE, a device's
        for request in (0x5412, 0x40086602, 0x401C5820, 0x8901, 0x8902, 0x5452, 0x40049409, 0xC0104601):
            assert _says(prog, "ioctl", 3, request) == ENOTTY, hex(request)
        # The core limit stays 1 (never dump, whatever core_pattern): setting it does nothing, reading it works.
        assert _says(prog, "setrlimit", 4, 0) == NOOP and _says(prog, "setrlimit", 7, 0) == ALLOW
        assert _says(prog, "prlimit64", 0, 4, 0, 1 << 20) == ALLOW  # getrlimit(RLIMIT_CORE)
        for new in (1 << 20, 1 << 40):
            assert _says(prog, "prlimit64", 0, 4, new, 0) == NOOP
        assert _says(prog, "prlimit64", 0, 7, 1 << 20, 0) == ALLOW
        assert _says(prog, "prctl", 15) == ALLOW and _says(prog, "prctl", 35) == EPERM  # NAME; PR_SET_MM
        assert _says(prog, "prlimit64", 0, 7) == ALLOW and _says(prog, "prlimit64", 1, 7) == EPERM
        assert _says(prog, "setpriority", 0, 0, 5) == ALLOW and _says(prog, "setpriority", 2, 0, 5) == EPERM
        assert _says(prog, "personality", 0xFFFFFFFF) == ALLOW and _says(prog, "personality", 0x40000) == EPERM
        # Memory and mapped files, never the host's hugetlb pool (MAP_HUGETLB, with or without a page size).
        assert _says(prog, "mmap", 0, 4096, 3, 0x22) == ALLOW and _says(prog, "mmap", 0, 4096, 1, 0x1, 3) == ALLOW
        assert _says(prog, "mmap", 0, 2 << 20, 3, 0x40022) == EPERM
        assert _says(prog, "mmap", 0, 2 << 20, 3, 0x40022 | 21 << 26) == EPERM  # MAP_HUGE_2MB
        # Its own I/O priority: none, best effort at level 4 or below, idle; never above (nor real time).
        for ioprio in (0, 2 << 13 | 4, 2 << 13 | 7, 3 << 13, 3 << 13 | 7):
            assert _says(prog, "ioprio_set", 1, 0, ioprio) == ALLOW, hex(ioprio)
        for ioprio in (2 << 13, 2 << 13 | 3, 1 << 13, 1 << 13 | 7, 2 << 13 | 1 << 3 | 4, 4 << 13, 0xFFFFFFFF):
            assert _says(prog, "ioprio_set", 1, 0, ioprio) == EPERM, hex(ioprio)
        assert _says(prog, "ioprio_set", 1, 7, 2 << 13 | 4) == EPERM and _says(prog, "ioprio_set", 3, 0, 0) == EPERM
    # With a uid of its own the run owns only its work dir: modes and times may change there.
    assert _says(own, "fchmod", 3, 0o755) == ALLOW and _says(own, "fchmod", 3, 0o4755) == EPERM
    assert _says(own, "fchmodat", -100, 0, 0o644) == ALLOW and _says(own, "utimensat", 3, 0, 0) == ALLOW
    assert _says(own, "setsid") == ALLOW
    # Without one, every file of the engine's user would be the run's: refused; setsid a no-op.
    assert _says(user, "fchmod", 3, 0o755) == EPERM and _says(user, "chmod", 0, 0o644) == EPERM
    assert _says(user, "utimensat", 3, 0, 0) == EPERM and _says(user, "setsid") == NOOP


def test_seccomp_is_not_claimed_on_another_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(confine, "ARCH", "aarch64")
    assert confine.seccomp_available() is False
    assert confine.kernel_layers()["arch"] == "aarch64"


@pytest.mark.parametrize("missing", ["landlock", "seccomp"])
def test_a_missing_layer_is_said_once_loudly(layers_off: set[str], missing: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    layers_off.add(missing)  # as the engine sees a kernel without it
    probing.reset()
    try:
        with caplog.at_level(logging.WARNING, logger=probing.__name__):
            first = probing.probe_sync()
            second = probing.probe_sync()
    finally:
        probing.reset()
    assert first.ok and second is first
    assert not first.isolation[missing]
    assert any(missing.lower() in gap.lower() for gap in first.isolation["cannot_hold"])
    warnings = [r for r in caplog.records if "SANDBOX LAYER MISSING" in r.getMessage()]
    assert len(warnings) == 1 and missing in warnings[0].getMessage()


def test_the_probe_names_the_mode_and_what_it_cannot_hold() -> None:
    probing.reset()
    try:
        iso = probing.probe_sync().isolation
    finally:
        probing.reset()
    assert iso["mode"] in ("root with namespaces", "root without namespaces (no CAP_SYS_ADMIN)", "ordinary user")
    assert iso["landlock"] == (KERNEL["landlock"]) and iso["seccomp"] == KERNEL["seccomp"]
    assert ("total disk use" in " ".join(iso["cannot_hold"])) == (not iso["mntns"])
    assert iso["multiprocessing"].startswith("refused")


def test_multiprocessing_is_refused_with_a_clear_error() -> None:
    result = asyncio.run(run_python("import multiprocessing\nmultiprocessing.Lock()\n", FAST))
    assert result.returncode == 1
    assert "PermissionError" in result.stderr and "multiprocessing is not available in this sandbox" in result.stderr


def test_the_layers_cost_no_thread_in_the_zygote() -> None:
    z = client.current() or sandbox._zygote()
    assert z.info["threads"] == 1 and z.info["layers"]["arch"] == platform.machine()


@needs_landlock
@needs_seccomp
@pytest.mark.parametrize("extra", [False, True], ids=["plain", "with-files"])
def test_without_namespaces_the_work_dir_goes_with_or_without_the_cleanup_fork(extra: bool) -> None:
    """As root without namespaces (a default container), the work dir is on the host's /tmp:
    a plain one is removed by the zygote, one with more in it by the cleanup helper."""
    if os.geteuid() != 0:
        pytest.skip("a uid per run needs root")
    caps = sandbox._capabilities()
    bare = sandbox._Capabilities(root=True, uids=caps.uids, cgroup=caps.cgroup, cgroup_parents=caps.cgroup_parents)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sandbox, "_caps", bare)
        more = "os.mkdir('d')\nopen('d/f', 'w').write('x' * 4096)\n" if extra else ""
        code = "import os\nprint(os.getcwd())\n" + more
        out, _ = run(code)
    assert out.startswith("/tmp/sandbox-")
    assert not os.path.lexists(out)
