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
import struct
from collections.abc import Iterator

import pytest

from engine.sandbox import client, confine, probing
from engine.sandbox import runner as sandbox
from engine.sandbox.runner import SandboxLimits, run_python

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
import os, socket
def t(fn):
    try:
        fn()
        return 'ok'
    except OSError as e:
        return e.errno
print(t(lambda: os.close(os.memfd_create('x'))), t(lambda: socket.socket(socket.AF_UNIX).close()),
      t(lambda: [s.close() for s in socket.socketpair()]))
"""


@needs_seccomp
@pytest.mark.parametrize("off", [False, True], ids=["on", "switched-off"])
def test_seccomp_refuses_memfd_and_sockets_but_not_a_socketpair(layers_off: set[str], off: bool) -> None:
    if off:
        layers_off.add("seccomp")
    out, _ = run(SECCOMP_CALLS)
    assert out.split() == (["ok", "ok", "ok"] if off else ["1", "1", "ok"])  # EPERM = 1


def test_the_filter_checks_the_architecture_first_and_jumps_in_range() -> None:
    for keep_group in (False, True):
        prog = confine.filter_program(keep_group)
        assert len(prog) % 8 == 0 and len(prog) // 8 < 200
        ops = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
        assert ops[0] == (confine.LD_ABS, 0, 0, 4) and ops[1][3] == confine.AUDIT_ARCH_X86_64
        assert ops[-1] == (confine.RET, 0, 0, confine.RET_KILL_PROCESS)
        refused = {k for code, _, _, k in ops if code == confine.JEQ}
        assert set(confine.REFUSED.values()) <= refused
        assert (confine.NR_SETSID in refused) == keep_group  # a no-op only where no uid per run


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
