"""Run untrusted, model-written Python in an isolated, resource-limited subprocess.

Layers (each one is there because a model will eventually try what it stops):

* The child is started without blocking the event loop as `sys.executable -I -S
  launcher.py <config>`: a stdlib-only program that builds the sandbox inside the
  fresh process and then `execv`s `sys.executable -I -B main.py`. A launcher instead of
  `preexec_fn`, because `preexec_fn` runs Python between fork and exec, which can deadlock
  in a process that has threads.
* Own session and process group (`start_new_session`), so a timeout kills the whole group.
* An environment built from scratch: nothing of `os.environ` (API keys!) reaches the child.
* rlimits: CPU seconds, address space, processes, file size, open files, no core dumps.
* As root, a uid/gid of its own per concurrent run (`UID_BASE`.., leased with `flock`, so
  two engines on one host never share one). Root ignores RLIMIT_NPROC and RLIMIT_NPROC
  counts every process of a uid, so a private uid makes the fork-bomb limit exact. It also
  makes cleanup exact: a daemon that double-forks and calls `setsid` leaves our process
  group but cannot change its uid, so after every run a helper running as that uid calls
  `kill(-1, SIGKILL)`, which the kernel applies to all of the uid's processes atomically
  with respect to fork. `PR_SET_NO_NEW_PRIVS` keeps setuid binaries from undoing the drop.
* As root, where the kernel allows: a new network namespace (only a down loopback: no
  network at all) and a new mount namespace in which the host is read-only, `/tmp` is a
  small private tmpfs holding the working directory `/tmp/sandbox` (nothing reaches the
  host's disk), `HIDDEN_PATHS` are covered by empty tmpfs (the interpreter's directories
  are bound back in) and `/proc` shows only the run's own processes. Both are probed once;
  `network_isolated()` and `filesystem_isolated()` report the outcome.

Without root only the rlimits, the fresh environment and the process group remain.
"""

from __future__ import annotations

import asyncio
import fcntl
import grp
import json
import math
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import attrs
from attrs import validators as v

from tools.sandbox.launcher import SETUP_FAILED  # its exit code when it could not build the sandbox

UID_BASE = 60000  # below systemd's DynamicUser range (61184..), inside a 16-bit userns map
UID_COUNT = 1024
LOCK_DIR = "/run/engine-sandbox-uids"
HIDDEN_PATHS = ("/root", "/home", "/run", "/var/tmp", "/dev/shm")
# The engine's own checkout (source, data, checkpoints beside it) is hidden too, unless it
# is installed inside the interpreter's prefix (then it is a library like any other).
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
SANDBOX_DIR = "/tmp/sandbox"  # the child's cwd when the mount namespace is available
_GIB, _MIB = 1 << 30, 1 << 20


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not an error of the sandboxed code)."""


@attrs.frozen
class SandboxLimits:
    """Per-run limits. `cpu_s=None` means `ceil(timeout_s) + 1` CPU seconds."""

    timeout_s: float = attrs.field(default=120.0, validator=v.gt(0))
    cpu_s: float | None = attrs.field(default=None, validator=v.optional(v.gt(0)))
    memory_bytes: int = attrs.field(default=4 * _GIB, validator=v.gt(0))  # RLIMIT_AS
    max_processes: int = attrs.field(default=64, validator=v.gt(0))  # threads count too
    max_file_bytes: int = attrs.field(default=16 * _MIB, validator=v.gt(0))
    max_open_files: int = attrs.field(default=64, validator=v.gt(8))
    output_bytes: int = attrs.field(default=64 * 1024, validator=v.ge(0))  # kept per stream
    disk_bytes: int = attrs.field(default=64 * _MIB, validator=v.gt(0))  # private /tmp size
    drain_bytes: int = attrs.field(default=256 * _MIB, validator=v.gt(0))  # output flood: kill

    def cpu_seconds(self) -> int:
        """The RLIMIT_CPU soft limit in whole seconds."""
        return math.ceil(self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1)


@attrs.frozen
class SandboxResult:
    """What a run produced. `returncode` is None when the sandbox killed the run (timeout,
    output flood, cancellation); negative when a signal (e.g. RLIMIT_CPU) ended it.
    `killed`: SIGKILL was needed, for the run itself or for processes it left behind.
    `started`/`ended` are `time.time()` stamps; `dropped` counts discarded output bytes."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    truncated: bool
    started: float
    ended: float
    killed: bool
    dropped: int = 0


@attrs.frozen
class _Capabilities:
    root: bool
    netns: bool
    mntns: bool
    uids: tuple[int, ...]
    hide: tuple[str, ...]
    expose: tuple[str, ...]


# Run by path (absolute: the cleanup helper starts in "/"); it ships as a module of this package.
LAUNCHER = str(Path(__file__).resolve().with_name("launcher.py"))
_caps: _Capabilities | None = None
_caps_lock = threading.Lock()
_slot_lock = threading.Lock()
_next_slot = 0


def _launcher_cmd(config: dict[str, Any]) -> list[str]:
    return [sys.executable, "-I", "-S", LAUNCHER, json.dumps(config)]


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _probe() -> _Capabilities:
    if not os.path.isfile(LAUNCHER):  # else every probe fails and the namespaces seem unavailable
        raise SandboxError(f"the sandbox launcher is missing: {LAUNCHER}")
    root = os.geteuid() == 0
    if not root:
        return _Capabilities(False, False, False, (), (), ())
    uids = tuple(u for u in range(UID_BASE, UID_BASE + UID_COUNT) if not _taken(u))
    if not uids:
        raise SandboxError(f"every uid in {UID_BASE}..{UID_BASE + UID_COUNT - 1} belongs to a user or group")
    hide = tuple(dict.fromkeys(os.path.realpath(p) for p in (*HIDDEN_PATHS, PROJECT_ROOT) if os.path.isdir(p)))
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    prefixes.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    hide = tuple(h for h in hide if not any(_under(h, p) for p in prefixes))
    # Under /tmp (a private tmpfs already) or under another hidden path, a path is hidden
    # anyway, and mounting over it would fail: the probe would then turn namespaces off.
    hide = tuple(h for h in hide if not _under(h, "/tmp") and not any(o != h and _under(h, o) for o in hide))
    needed = sorted(p for p in prefixes if any(_under(p, h) for h in hide))
    expose = tuple(p for p in needed if not any(q != p and _under(p, q) for q in needed))

    def works(netns: bool, mntns: bool) -> bool:
        cfg = _config(SandboxLimits(), uids[0], _Capabilities(True, netns, mntns, uids, hide, expose), probe=True)
        return subprocess.run(_launcher_cmd(cfg), check=False, env={}, capture_output=True, timeout=30).returncode == 0

    return _Capabilities(True, works(True, False), works(False, True), uids, hide, expose)


def _taken(uid: int) -> bool:
    """Whether a real user or group has this id: its processes and files are not ours."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def _capabilities() -> _Capabilities:
    global _caps
    with _caps_lock:
        if _caps is None:
            _caps = _probe()
        return _caps


def network_isolated() -> bool:
    """Whether runs get a network namespace of their own (no network at all). Probes once."""
    return _capabilities().netns


def filesystem_isolated() -> bool:
    """Whether runs see a read-only host with a private /tmp (mount namespace). Probes once."""
    return _capabilities().mntns


def _config(limits: SandboxLimits, uid: int | None, caps: _Capabilities, *, probe: bool = False,
            workdir: str = SANDBOX_DIR, script_src: str = "") -> dict[str, Any]:
    # RLIMIT_NPROC counts every thread of the uid. Set after setresuid: lowered before it,
    # leftovers of the uid would make the kernel refuse our exec (PF_NPROC_EXCEEDED).
    nproc = limits.max_processes
    if uid is None:  # without a uid of our own it must leave room for this user's others
        nproc += _tasks_of(os.getuid())
    return {
        "uid": uid, "netns": caps.netns, "mntns": caps.mntns, "hide": caps.hide, "expose": caps.expose, "probe": probe,
        "workdir": workdir, "script": os.path.join(workdir, "main.py"), "script_src": script_src,
        "disk": limits.disk_bytes, "NPROC": nproc, "FSIZE": limits.max_file_bytes, "NOFILE": limits.max_open_files,
        "CPU": limits.cpu_seconds(), "AS": limits.memory_bytes, "nonce": uuid.uuid4().hex,
    }


def _tasks_of(uid: int) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass  # gone meanwhile
    return count


def _child_env(home: str) -> dict[str, str]:
    """A minimal environment: locale, home and temp dir, one BLAS thread (threads count
    against RLIMIT_NPROC and the address-space limit), headless matplotlib."""
    env = {"HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")})
    env["MPLBACKEND"] = "Agg"
    return env


class _Lease(NamedTuple):
    """Exclusive use of one sandbox uid: an flock on a root-owned lock file, freed by closing `fd`."""

    uid: int
    fd: int


def _try_lease(uids: tuple[int, ...]) -> _Lease | None:
    global _next_slot
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(LOCK_DIR)
    if st.st_uid != 0 or st.st_mode & 0o022 or not os.path.isdir(LOCK_DIR) or os.path.islink(LOCK_DIR):
        raise SandboxError(f"{LOCK_DIR} must be a root-owned directory not writable by others")
    for _ in range(len(uids)):
        with _slot_lock:  # round robin, so a just-released uid (zombies still counted) rests
            uid, _next_slot = uids[_next_slot % len(uids)], _next_slot + 1
        fd = os.open(os.path.join(LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return _Lease(uid, fd)
        except BlockingIOError:
            os.close(fd)
    return None


async def _lease(uids: tuple[int, ...]) -> _Lease:
    while (lease := _try_lease(uids)) is None:  # all uids busy: more runs than UID_COUNT
        await asyncio.sleep(0.05)
    return lease


class _Collector(asyncio.SubprocessProtocol):
    """Takes the child's output as it arrives, so the child never blocks on a full pipe: keeps
    the first `keep` bytes of each stream, counts the rest, and flags a flood past `flood_at`.

    We use a protocol rather than `Process.wait()`: in 3.11 `wait()` also waits for the pipes
    to close, which a daemon that inherited stdout would delay until the timeout."""

    def __init__(self, keep: int, flood_at: int) -> None:
        loop = asyncio.get_running_loop()
        self.keep, self.flood_at, self.total, self.dropped = keep, flood_at, 0, 0
        self.kept = {1: bytearray(), 2: bytearray()}
        self.exited, self.flood, self.closed = loop.create_future(), loop.create_future(), loop.create_future()
        self._open = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes | bytearray) -> None:
        kept = self.kept[fd]
        room = max(0, self.keep - len(kept))
        kept += data[:room]
        self.dropped += len(data) - min(room, len(data))
        self.total += len(data)
        if self.total > self.flood_at and not self.flood.done():
            self.flood.set_result(None)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        if not self._open and not self.closed.done():
            self.closed.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


def _write_script(path: str, code: str, owner: int | None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    if owner is not None:
        for p in (os.path.dirname(path), path):
            os.chown(p, owner, owner)


def _killpg(pgid: int) -> bool:
    try:
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _kill_cmd(uid: int) -> list[str]:
    # The helper starts as root and drops to the uid itself: the uid may be unable to exec
    # the interpreter (e.g. one under /root) outside the sandbox's mount namespace.
    return _launcher_cmd({"kill": uid})


def _uid_has_processes(uid: int) -> bool:
    """Whether any process runs as `uid` (read from /proc/*/status, which the process cannot hide)."""
    wanted = str(uid)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if wanted in line.decode().split()[1:]:
                            return True
                        break
        except OSError:
            continue  # it exited while we looked
    return False


async def _kill_uid(uid: int) -> bool:
    """SIGKILL every process of `uid`, daemons that left our process group included.

    When /proc shows none, the helper (an interpreter start, ~30 ms) is skipped: only root
    can start a process as that uid, so none can appear once the last one is gone.
    """
    if not await asyncio.to_thread(_uid_has_processes, uid):
        return False
    helper = await asyncio.create_subprocess_exec(
        *_kill_cmd(uid), env={}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    rc = await helper.wait()
    if rc not in (0, 1):
        raise SandboxError(f"the cleanup helper for uid {uid} failed with exit code {rc}")
    return rc == 0


async def run_python(
    code: str, limits: SandboxLimits = SandboxLimits(), *, stdin: bytes | None = None
) -> SandboxResult:
    """Run `code` as a Python program in a fresh sandbox; returns with nothing of it left running."""
    caps = _caps if _caps is not None else await asyncio.to_thread(_capabilities)
    hostdir = tempfile.mkdtemp(prefix="sandbox-")
    lease: _Lease | None = None
    transport: asyncio.SubprocessTransport | None = None
    out: _Collector | None = None
    started, timed_out, ours = time.time(), False, False
    try:
        lease = await _lease(caps.uids) if caps.root else None
        uid = lease.uid if lease else None
        script = os.path.join(hostdir, "main.py")
        workdir = SANDBOX_DIR if caps.mntns else hostdir
        # Without a mount namespace the child works in the host dir: it must own it to write there.
        await asyncio.to_thread(_write_script, script, code, uid if uid is not None and not caps.mntns else None)
        cfg = _config(limits, uid, caps, workdir=workdir, script_src=script)
        started = time.time()
        transport, out = await asyncio.get_running_loop().subprocess_exec(
            lambda: _Collector(limits.output_bytes, limits.drain_bytes), *_launcher_cmd(cfg),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=_child_env(workdir), cwd=hostdir, start_new_session=True,
        )
        if stdin is not None:
            pipe = transport.get_pipe_transport(0)
            assert isinstance(pipe, asyncio.WriteTransport)
            pipe.write(stdin)  # buffered by the transport; a child that never reads just loses it
            pipe.write_eof()
        ends = [out.exited, out.flood]
        done, _ = await asyncio.wait(ends, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        timed_out = not done
    finally:
        # Runs on exit, timeout, flood, error and cancellation alike. The group kill is synchronous
        # so it happens even if we are cancelled again while awaiting the rest of the cleanup.
        if transport is not None and transport.get_returncode() is None:
            ours = _killpg(transport.get_pid())
        strays = await asyncio.shield(asyncio.ensure_future(_cleanup(transport, out, lease, hostdir)))
    assert transport is not None and out is not None
    rc, err = transport.get_returncode(), bytes(out.kept[2])
    if rc == SETUP_FAILED and err.startswith(cfg["nonce"].encode()):
        raise SandboxError(err.decode(errors="replace")[len(cfg["nonce"]) + 1:].strip())
    return SandboxResult(
        stdout=out.kept[1].decode(errors="replace"), stderr=err.decode(errors="replace"),
        returncode=None if ours else rc, timed_out=timed_out, truncated=out.dropped > 0,
        started=started, ended=time.time(), killed=ours or strays, dropped=out.dropped,
    )


async def _cleanup(transport: asyncio.SubprocessTransport | None, out: _Collector | None, lease: _Lease | None,
                   hostdir: str) -> bool:
    """Kill what the run left behind, reap it, close the pipes, free the uid and the dir.

    Returns whether stray processes had to be killed."""
    uid = lease.uid if lease else None
    strays = cancelled = False
    try:
        if uid is not None:
            strays = await _kill_uid(uid)
        elif transport is not None:
            strays = _killpg(transport.get_pid())  # best effort: without a uid, a setsid daemon escapes
        if transport is not None and out is not None:
            await asyncio.wait([out.exited], timeout=30)  # SIGKILLed: only a hung kernel call delays it
            # As root every writer is dead now and the pipes close at once; without root an
            # escaped daemon may hold them open, so we stop listening after a grace period.
            await asyncio.wait([out.closed], timeout=5 if uid is not None else 1)
    except asyncio.CancelledError:
        # Shielded work is cancelled only when the loop itself shuts down (asyncio.run's
        # teardown cancels every task): then block for the few ms a synchronous kill takes.
        cancelled = True
        if uid is not None:
            kill = _kill_cmd(uid)
            subprocess.run(kill, check=False, env={}, cwd="/", capture_output=True, timeout=30)  # noqa: ASYNC221
        raise
    finally:
        if transport is not None:
            transport.close()
        if lease is not None:
            os.close(lease.fd)  # drops the flock: the uid is free again
        if cancelled:
            shutil.rmtree(hostdir, ignore_errors=True)
        else:  # in a thread: without a mount namespace the child may have left many files here
            await asyncio.to_thread(shutil.rmtree, hostdir, True)
    return strays
