"""The first stage of a sandboxed run: builds the sandbox inside the fresh child, then execs.

Run by path as `sys.executable -I -S launcher.py <json config>` (see
`tools/sandbox/runner.py`, which also documents the layers); the engine imports it only for
`SETUP_FAILED`, and importing it runs nothing. `-S` skips `site`, so only the standard
library is used here; `-I` keeps this file's directory off `sys.path`, so no module of the
`tools` package can shadow a stdlib one.

A separate program instead of `preexec_fn`, because `preexec_fn` runs Python between fork
and exec, which can deadlock in a process that has threads. The config selects one of:

* a sandboxed run: namespaces, uid drop, rlimits, then `execv` of `python -I -B main.py`;
* `probe`: only try the namespaces (exit 0 when they work), for the capability probe;
* `kill`: the cleanup helper: become the uid, then SIGKILL all of its processes
  (exit 0 when there were any, 1 when there were none).

Any failure exits with `SETUP_FAILED` (125) after writing `<nonce> <error>` to stderr, so the
parent can tell a broken sandbox from the sandboxed program's own exit status.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import signal
import sys
import time
from typing import Any

SETUP_FAILED = 125  # tools.sandbox.runner re-exports it
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
# Per-mount flags a read-only bind remount must repeat, or the kernel refuses it (EPERM).
KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "relatime": 1 << 21}
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
PR_SET_NO_NEW_PRIVS = 38


class _Libc:
    """The few libc calls `os` lacks, raising OSError like `os` does."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    @staticmethod
    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(self, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        args = [None if a is None else a.encode() for a in (src, target, fstype)]
        self.check(self.lib.mount(*args, flags, None if data is None else data.encode()), f"mount {target}")

    def unshare(self, flags: int) -> None:
        self.check(self.lib.unshare(flags), "unshare")

    def no_new_privs(self) -> None:
        self.check(self.lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def become(uid: int) -> None:
    """Drop from root to `uid` (group too, no supplementary groups)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to a uid drops every capability


def living(uid: int) -> bool:
    """Whether a process of `uid` other than this one is alive (not a zombie)."""
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


def _account_files(uid: int, home: str) -> dict[str, str]:
    """Stand-in /etc/passwd and /etc/group naming root and the run's own uid only."""
    return {
        "passwd": f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}:sandbox:{home}:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{uid}:\n",
    }


def isolate_fs(libc: _Libc, cfg: dict[str, Any], uid: int) -> None:
    """In the new mount namespace: private /tmp, hidden paths, own /proc, the rest read-only."""
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here propagates to the host
    libc.mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk']},nr_inodes=8192,mode=755")
    staged = [(f"/tmp/.stage{i}", path) for i, path in enumerate(cfg["expose"])]
    for stage, path in staged:  # the interpreter's dirs, bound aside before their parent is hidden
        os.mkdir(stage)
        libc.mount(path, stage, None, MS_BIND | MS_REC)
    for path in cfg["hide"]:
        libc.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=755")
    for stage, path in staged:
        os.makedirs(path, exist_ok=True)
        libc.mount(stage, path, None, MS_MOVE)
        os.rmdir(stage)
    for name, text in _account_files(uid, cfg["workdir"]).items():
        target = f"/etc/{name}"
        if os.path.isfile(target):  # the host's users and groups are none of the code's business
            stand_in = f"/tmp/.{name}"
            with open(stand_in, "w") as f:
                f.write(text)
            os.chmod(stand_in, 0o644)
            libc.mount(stand_in, target, None, MS_BIND)
            os.unlink(stand_in)  # the bind mount keeps the file alive
    try:  # a /proc of our own that shows the sandbox only its own processes
        libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        pass  # the host's /proc stays; other uids' processes can still not be signalled
    os.mkdir(cfg["workdir"], 0o700)
    os.chown(cfg["workdir"], uid, uid)
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    points = [(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), r[4]), r[5].split(",")) for r in rows]
    for point, opts in points:
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | sum(KEEP.get(o, 0) for o in opts)
        try:  # a bind remount changes this mount only, never the host's filesystem
            if point != "/tmp":
                libc.mount(None, point, None, flags)
        except OSError:
            pass  # hidden under one of our tmpfs, or no mount point any more: checked next
    for point, _ in points:  # whatever the child can reach must now be read-only, /tmp aside
        try:
            writable = not os.statvfs(point).f_flag & os.ST_RDONLY
        except OSError:
            continue
        if writable and point != "/tmp" and not point.startswith("/tmp/"):
            raise OSError(30, f"could not make {point} read-only")


def kill_uid(uid: int) -> None:
    """The cleanup helper: SIGKILL every process of `uid`; exit 0 if there were any, else 1."""
    become(uid)
    found = living(uid)  # kill(-1)'s return value does not say whether it hit anything
    os.kill(-1, signal.SIGKILL)  # atomic with respect to fork, unlike any scan
    for _ in range(1000):  # SIGKILL is only pending until each target runs: wait for the exits
        if not living(uid):
            break
        time.sleep(0.005)
    os._exit(0 if found else 1)


def launch(cfg: dict[str, Any]) -> None:
    """Build the sandbox in this process and exec the user's program (or just probe)."""
    libc = _Libc()
    code = b""
    if cfg["mntns"] and not cfg["probe"]:  # read now: the host's /tmp is hidden soon
        with open(cfg["script_src"], "rb") as src:
            code = src.read()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    flags = (CLONE_NEWNET if cfg["netns"] else 0) | (CLONE_NEWNS if cfg["mntns"] else 0)
    if flags:
        libc.unshare(flags)
    uid = cfg["uid"]
    if cfg["mntns"]:
        isolate_fs(libc, cfg, uid)
    if cfg["probe"]:
        os._exit(0)
    if uid is not None:
        become(uid)
        libc.no_new_privs()  # setuid binaries cannot undo the drop
        try:  # leftovers of a crashed engine that held this uid before us
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.chdir(cfg["workdir"])
    if cfg["mntns"]:
        with open(cfg["script"], "wb") as dst:
            dst.write(code)
    for name in ("NPROC", "FSIZE", "NOFILE", "AS"):  # lowered only after setresuid: see sandbox._config
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (cfg[name], cfg[name]))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["CPU"], cfg["CPU"] + 1))  # SIGXCPU, then SIGKILL
    os.execv(sys.executable, [sys.executable, "-I", "-B", cfg["script"]])


def main() -> None:  # pragma: no cover - runs in the child
    cfg = json.loads(sys.argv[1])
    try:
        if "kill" in cfg:
            kill_uid(cfg["kill"])
        launch(cfg)
    except Exception as e:  # noqa: BLE001 - whatever failed, the parent must hear of it
        os.write(2, f"{cfg.get('nonce')} {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main()
