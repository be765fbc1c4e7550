"""Run untrusted, model-written Python in an isolated, resource-bounded child of the zygote.

Layers (each one is there because a model will eventually try what it stops):

* A zygote per engine process (`zygote.py`, started by exec with an empty environment) keeps
  the runs' records; its forker (`forker.py`), forked before any request, forks a child per
  call that isolates itself (`child.py`) and runs the code without exec, so a call costs about
  a fork instead of three interpreter starts, and no run forks from a process that held another
  run's records. `zygote.py` says why what the child inherits is safe.
* Only the host speaks for the sandbox: the child's setup reports on a pipe the zygote reads and
  the model's code never holds; `SandboxError` comes from that report (or a dead zygote) alone,
  never from what the code prints, writes or exits with.
* An environment built from scratch: nothing of `os.environ` (API keys!) reaches the child.
* As root, a uid/gid of its own per concurrent run (`UID_BASE`.., leased with `flock`, so
  two engines on one host never share one). RLIMIT_NPROC then counts exactly the run's
  tasks, and cleanup is exact: after a run that may have left something a helper running as
  that uid calls `kill(-1, SIGKILL)` (atomic with respect to fork: double-forked daemons die
  too), clears the uid's keyrings, and, where runs share the host's IPC namespace or
  filesystem, removes its SysV objects and its files, then checks that nothing is left. A uid
  it cannot clean is quarantined: its lock file says why, and no engine leases it again. A
  lease whose cleanup never finished (the engine crashed) is cleaned before its next use, by
  any engine process on the host. `PR_SET_NO_NEW_PRIVS` keeps setuid binaries from undoing the drop.
* The whole run bounded: a cgroup per uid slot (v2, or the v1 memory and pids
  controllers) caps the memory of all its processes, threads, shared memory and tmpfs
  together, and its task count. Without cgroups, per-process limits are sized so that
  processes x address space stays within the run's memory budget. Either way the budget
  also counts what the kernel may hold for the run's descriptors (socket and pipe buffers:
  `_budget`). RLIMIT_AS also applies per process (a single greedy allocation gets
  MemoryError, not the OOM killer).
* As root, where the kernel allows: a mount namespace; the host is read-only, `/tmp` is a
  small private `nosuid` tmpfs holding the working directory `/tmp/sandbox`, `HIDDEN_PATHS`
  and the engine's checkout are covered by empty tmpfs, the interpreter's directories are
  bound back wherever they live, and `/proc` shows only the run's own processes. Network and
  IPC namespaces only where seccomp is missing (it refuses every socket but an unnamed pair,
  and all SysV and POSIX IPC). Each layer is probed once; `capabilities()` reports what the
  host gave.

* In every mode, last before the model's code: a Landlock ruleset and a default-deny seccomp
  allowlist (`confine.py`, `allowlist.py`), which need no privilege. Without root they are what
  holds files, the network, signals and the kernel's shared objects; as root they come on top
  of the above. `capabilities()["cannot_hold"]` lists what this host's mode cannot hold.

Without root: the rlimits, the fresh environment, the process-group kill, Landlock and seccomp.
"""

from __future__ import annotations

import asyncio
import fcntl
import grp
import logging
import math
import os
import pwd
import resource
import sys
import sysconfig
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import attrs
from attrs import validators as v

from engine.sandbox import client

log = logging.getLogger(__name__)

UID_BASE = 60000  # below systemd's DynamicUser range (61184..), inside a 16-bit userns map
UID_COUNT = 1024
LOCK_DIR = "/run/engine-sandbox-uids"
HIDDEN_PATHS = ("/root", "/home", "/run", "/var/tmp", "/dev/shm")
# The engine's own checkout (source, data, checkpoints beside it) is hidden too, unless it
# is installed inside the interpreter's prefix (then it is a library like any other).
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
SANDBOX_DIR = "/tmp/sandbox"  # the child's cwd when the mount namespace is available
CGROUP_NAME = "engine-sandbox"  # the parent of the per-uid cgroups, under the engine's own
_GIB, _MIB = 1 << 30, 1 << 20
MIN_PROCESS_BYTES = 256 * _MIB  # without cgroups: the least address space worth a process
MIN_FILES = 16  # descriptors a process keeps whatever the budget (stdio, imports, a few files)
KERNEL_SHARE = 4  # at most 1/KERNEL_SHARE of a run's memory is what the kernel holds for its descriptors
# Signals a run may have queued (RT signals, POSIX timers), counted per user: without a uid per run that
# count is the engine's user's, and a run that queued its whole limit would leave that user's own
# processes (the engine, a trainer) none. A run's limit far below the host's leaves them the rest.
RUN_SIGNALS = 1024
ENGINE_ROOM = 32  # without a uid per run: tasks of the user's RLIMIT_NPROC no run may take (the engine's own)


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not an error of the sandboxed code)."""


@attrs.frozen
class SandboxLimits:
    """Per-run limits. `cpu_s=None` means `ceil(timeout_s) + 1` CPU seconds. `memory_bytes`
    bounds the whole run (cgroup) and each process's growth (RLIMIT_AS)."""

    timeout_s: float = attrs.field(default=120.0, validator=v.gt(0))
    cpu_s: float | None = attrs.field(default=None, validator=v.optional(v.gt(0)))
    memory_bytes: int = attrs.field(default=4 * _GIB, validator=v.gt(0))
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
    """What the host gave, probed once per process."""

    root: bool
    netns: bool = False
    mntns: bool = False
    ipcns: bool = False
    cgroup: str = "rlimits"  # "v2" | "v1" | "rlimits"
    cgroup_parents: tuple[tuple[str, str], ...] = ()  # (kind, dir): v2 "unified", v1 "memory"/"pids"
    uids: tuple[int, ...] = ()
    hide: tuple[str, ...] = ()
    expose: tuple[str, ...] = ()


_caps: _Capabilities | None = None
_LAYERS_OFF: set[str] = set()  # private switch (tests): "landlock" / "seccomp" treated as absent
_caps_lock = threading.Lock()
_slot_lock = threading.Lock()
_next_slot = 0


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _outermost(paths: set[str]) -> tuple[str, ...]:
    return tuple(sorted(p for p in paths if not any(q != p and _under(p, q) for q in paths)))


def interpreter_paths() -> set[str]:
    """Real paths of everything the interpreter needs: prefixes, the executable's install,
    the standard library and site-packages (a venv links to its base interpreter)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    paths.update(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return {os.path.realpath(p) for p in paths if p and os.path.isdir(p)}


def _hidden_and_exposed() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Paths to cover with an empty tmpfs, and the interpreter's paths to bind back in."""
    needed = interpreter_paths()
    hide = {os.path.realpath(p) for p in (*HIDDEN_PATHS, PROJECT_ROOT) if os.path.isdir(p)}
    # Under /tmp (the private tmpfs) a path is hidden anyway; inside a prefix it is a library.
    hide = {h for h in hide if not _under(h, "/tmp") and not any(_under(h, p) for p in needed)}
    covered = ("/tmp", *hide)
    expose = {p for p in needed if any(_under(p, h) for h in covered)}
    return _outermost(hide), _outermost(expose)


def _taken(uid: int) -> bool:
    """Whether a real user or group has this id: its processes and files are not ours."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def _child_env(home: str) -> dict[str, str]:
    """A minimal environment: locale, home and temp dir, one BLAS thread (threads count
    against RLIMIT_NPROC and the address-space limit), headless matplotlib."""
    env = {"HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")})
    env["MPLBACKEND"] = "Agg"
    return env


def _zygote() -> client.ZygoteClient:
    try:
        return client.zygote(_child_env("/"))
    except client.ZygoteError as e:
        raise SandboxError(str(e)) from e


# --- cgroups -----------------------------------------------------------------------------

def _mountinfo() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every mount."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, _, opts = right.split()[:3]
            rows.append((left.split()[4], fstype, set(opts.split(","))))
    return rows


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    found = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                found[c] = path
    return found


def _cgroup_parents() -> tuple[str, tuple[tuple[str, str], ...]]:
    """Where per-run cgroups can go: ("v2", ...), ("v1", memory + pids), or ("rlimits", ())."""
    try:
        mounts, own = _mountinfo(), _own_cgroups()
    except OSError:
        return "rlimits", ()
    for point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            parent = _v2_parent(point, own[""])
            if parent is not None:
                return "v2", (("unified", parent),)
    v1 = []
    for controller in ("memory", "pids"):
        point = next((p for p, t, o in mounts if t == "cgroup" and controller in o), None)
        if point is None or controller not in own:
            return "rlimits", ()
        parent = os.path.join(point + own[controller], CGROUP_NAME)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError:
            return "rlimits", ()
        v1.append((controller, parent))
    return "v1", tuple(v1)


def _v2_parent(point: str, path: str) -> str | None:
    """A v2 cgroup with memory and pids enabled for its children: under ours when ours may
    have children (the root, or a delegated subtree), else beside ours (a cgroup holding
    processes cannot enable controllers for children: the "no internal processes" rule)."""
    mine = os.path.normpath(point + path)
    for base in (mine, os.path.dirname(mine) if _under(mine, point) and mine != point else None):
        if base is None:
            continue
        try:
            for cgroup in (base, os.path.join(base, CGROUP_NAME)):
                os.makedirs(cgroup, exist_ok=True)
                with open(os.path.join(cgroup, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory +pids")  # refused (EBUSY) where the cgroup holds processes
            return os.path.join(base, CGROUP_NAME)
        except OSError:
            continue
    return None


def _cgroup_settings(caps: _Capabilities, uid: int, budget: _Budget) -> list[list[Any]]:
    """Per-run `[dir, [[file, value], ...]]` for `child.join_cgroups` (the uid's slot cgroup)."""
    memory, tasks = budget.memory, budget.processes
    settings = {
        "unified": [["memory.max", memory], ["memory.swap.max", 0], ["pids.max", tasks]],
        # memsw must stay >= the limit at every step: lift it, set the limit, lower it.
        "memory": [["memory.memsw.limit_in_bytes", -1], ["memory.limit_in_bytes", memory],
                   ["memory.memsw.limit_in_bytes", memory]],
        "pids": [["pids.max", tasks]],
    }
    return [[os.path.join(parent, str(uid)), settings[kind]] for kind, parent in caps.cgroup_parents]


# --- capabilities ----------------------------------------------------------------------------

def _probe_config(caps: _Capabilities, workdir: str) -> dict[str, Any]:
    return _config(SandboxLimits(), None, caps, workdir=workdir, probe=True)


def _try_layer(z: client.ZygoteClient, caps: _Capabilities) -> str:
    """Fork a probe child that builds the sandbox `caps` describe and exits; "" when it could."""
    workdir = SANDBOX_DIR if caps.mntns else os.path.join("/tmp", f"sandbox-{z.proc.pid}-probe-{uuid.uuid4().hex}")
    cfg = dict(_probe_config(caps, workdir), netns=caps.netns, ipcns=caps.ipcns)  # the layer asked for, seccomp or not
    read, write = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    code = os.memfd_create("sandbox-probe", os.MFD_CLOEXEC)
    try:
        _, fut = z.submit(cfg, [null, null, write, code])
    finally:
        for fd in (null, write, code):
            os.close(fd)
    try:
        done = fut.result(timeout=60)
        with os.fdopen(read, "rb") as f:
            err = f.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - a probe that cannot finish means "unavailable"
        return f"{type(e).__name__}: {e}"
    if done["rc"] == 0 and not done["error"]:
        return ""
    return done["error"] or err.strip() or str(done)


def _probe() -> _Capabilities:
    z = _zygote()
    if os.geteuid() != 0:
        return _Capabilities(root=False)
    uids = tuple(u for u in range(UID_BASE, UID_BASE + UID_COUNT) if not _taken(u))
    if not uids:
        raise SandboxError(f"every uid in {UID_BASE}..{UID_BASE + UID_COUNT - 1} belongs to a user or group")
    hide, expose = _hidden_and_exposed()
    base = _Capabilities(root=True, uids=uids, hide=hide, expose=expose)
    netns = not _try_layer(z, attrs.evolve(base, netns=True))
    mntns = not _try_layer(z, attrs.evolve(base, mntns=True))
    ipcns = not _try_layer(z, attrs.evolve(base, ipcns=True))
    kind, parents = _cgroup_parents()
    if kind != "rlimits" and _try_layer(z, attrs.evolve(base, cgroup=kind, cgroup_parents=parents)):
        kind, parents = "rlimits", ()
    return attrs.evolve(base, netns=netns, mntns=mntns, ipcns=ipcns, cgroup=kind, cgroup_parents=parents)


def _capabilities() -> _Capabilities:
    global _caps
    with _caps_lock:
        if _caps is None:
            _caps = _probe()
        return _caps


def kernel_layers() -> dict[str, Any]:
    """The no-privilege layers runs get: {"landlock": ABI (0: none), "seccomp": bool}, as the
    zygote found them in the kernel, less what `_LAYERS_OFF` switches off."""
    z = client.current() or _zygote()
    found = z.info.get("layers", {})
    return {"landlock": 0 if "landlock" in _LAYERS_OFF else int(found.get("landlock", 0)),
            "seccomp": "seccomp" not in _LAYERS_OFF and bool(found.get("seccomp")),
            "arch": found.get("arch", "?")}


def mode(caps: _Capabilities) -> str:
    """Which of the three documented modes this host is (docs/sandbox-modes.md)."""
    if not caps.root:
        return "ordinary user"
    if caps.netns and caps.mntns:
        return "root with namespaces"
    return "root without namespaces (no CAP_SYS_ADMIN)"


MULTIPROCESSING = ("refused: its locks and pools need /dev/shm, which a run may not write (a shared tmpfs, "
                   "outside the run's budget); code gets PermissionError naming this; threads, "
                   "concurrent.futures.ThreadPoolExecutor and subprocess work")


def cannot_hold(caps: _Capabilities, layers: dict[str, Any]) -> list[str]:
    """What the sandbox cannot hold on this host, in words (see docs/sandbox-modes.md)."""
    gaps = [("signals between concurrent runs through a futex on a file page they all map (the interpreter's): "
             "the kernel keys it by the file; only separate machines hold it")]
    if not caps.mntns:
        gaps.append("total disk use of a run: no private tmpfs, RLIMIT_FSIZE bounds each file only")
        gaps.append("sizes and owners of files outside the work dir that the run's uid may look up: Landlock does "
                    "not mediate stat, only a mount namespace hides a path")
    if caps.cgroup == "rlimits":
        gaps.append("memory and tasks across a run's processes: per-process rlimits sized to the budget only; the "
                    "page tables behind a sparse address space (up to twice it) are counted by none: the runs are "
                    "the OOM killer's first choice")
    if not caps.root:
        gaps.append("RLIMIT_NPROC counts all of this user's processes: a run's processes share one budget "
                    "with the engine and the user's other runs")
        gaps.append("no uid per run: cleanup kills the run's process group (setsid/setpgid are kept in it)")
    if not layers["landlock"]:
        gaps.append("no Landlock: files, TCP and signals are held only by the uid and the namespaces")
    elif layers["landlock"] < 6:
        gaps.append(f"Landlock ABI {layers['landlock']} < 6: signals and abstract unix sockets not scoped")
    if not layers["seccomp"]:
        gaps.append("no seccomp filter: sockets, SysV IPC, io_uring, ptrace and namespaces are refused only "
                    "by the uid and the namespaces")
    return gaps


def _namespaces(caps: _Capabilities, seccomp: bool) -> tuple[bool, bool]:
    """(network, IPC) namespaces a run gets. Only where seccomp is missing: the filter already
    refuses every socket but an unnamed pair, and all SysV and POSIX IPC, so a namespace would
    add only its cost (creating and tearing down a network namespace is most of a millisecond)."""
    return caps.netns and not seccomp, caps.ipcns and not seccomp


def network_isolated() -> bool:
    """Whether runs have no network at all: the seccomp filter refuses every socket but an
    unnamed pair, or (without seccomp) a network namespace of their own. Probes once."""
    caps = _capabilities()
    return bool(kernel_layers()["seccomp"]) or caps.netns


def filesystem_isolated() -> bool:
    """Whether runs see a read-only host with a private /tmp (mount namespace). Probes once."""
    return _capabilities().mntns


def capabilities() -> dict[str, Any]:
    """What isolation the host gave (probes once): the `isolation` of `SandboxProbe`."""
    caps = _capabilities()
    z = client.current()
    layers = kernel_layers()
    netns, ipcns = _namespaces(caps, layers["seccomp"])
    return {
        "mode": mode(caps), "root": caps.root, "uid_per_run": bool(caps.uids), "netns": netns,
        "mntns": caps.mntns, "ipcns": ipcns, "cgroup": caps.cgroup,
        "landlock": layers["landlock"], "seccomp": layers["seccomp"], "cannot_hold": cannot_hold(caps, layers),
        "multiprocessing": MULTIPROCESSING, "zygote": z is not None,
        "preloaded": list(z.info.get("preloaded", [])) if z is not None else [],
        "python": sys.executable, "exposed": list(caps.expose), "quarantined": quarantined(caps.uids),
    }


# --- one run -----------------------------------------------------------------------------

def _tasks_of(uid: int) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass  # gone meanwhile
    return count


_per_fd: int | None = None


def kernel_bytes_per_fd() -> int:
    """The most kernel memory one descriptor of a run can hold: a unix socket at the default send
    buffer (the filter refuses SO_SNDBUF) plus one message past it, or a pipe at its default
    size (the filter refuses F_SETPIPE_SZ); the filter refuses sending descriptors, so none is
    held in flight past the descriptor limit."""
    global _per_fd
    if _per_fd is None:
        try:
            with open("/proc/sys/net/core/wmem_default") as f:
                wmem = int(f.read())
        except (OSError, ValueError):
            wmem = 212992
        _per_fd = max(wmem * 3 // 2 + 4096, 17 * 4096)
    return _per_fd


@attrs.frozen
class _Budget:
    """How a run's memory budget is spent: `processes` (RLIMIT_NPROC, and the cgroup's tasks),
    `files` per process (RLIMIT_NOFILE), `address_space` per process (RLIMIT_AS), `memory` the
    cgroup's limit on the run's pages, `kernel` what the kernel may hold for its descriptors
    (socket and pipe buffers: no cgroup counts unix socket buffers, no rlimit counts either)."""

    processes: int
    files: int
    address_space: int
    memory: int
    kernel: int


def _budget(limits: SandboxLimits, caps: _Capabilities, uid: int | None) -> _Budget:
    """Split `limits.memory_bytes` so that pages and kernel buffers together stay within it. At most
    1/KERNEL_SHARE goes to buffers; a small budget gets fewer descriptors, then fewer processes."""
    memory, per_fd = limits.memory_bytes, kernel_bytes_per_fd()
    if caps.cgroup != "rlimits" and uid is not None:  # the cgroup bounds the pages of all processes
        share = memory // KERNEL_SHARE
        files = min(limits.max_open_files, max(MIN_FILES, share // (limits.max_processes * per_fd)))
        processes = max(1, min(limits.max_processes, share // (files * per_fd)))
        kernel = processes * files * per_fd
        return _Budget(processes, files, memory - kernel, memory - kernel, kernel)
    # No cgroup: processes x (address space + buffers) <= budget.
    processes = max(1, min(limits.max_processes, memory // MIN_PROCESS_BYTES))
    each = memory // processes
    files = min(limits.max_open_files, max(MIN_FILES, each // KERNEL_SHARE // per_fd))
    return _Budget(processes, files, max(_MIB, each - files * per_fd), memory, processes * files * per_fd)


def _rlimits(limits: SandboxLimits, caps: _Capabilities, uid: int | None) -> dict[str, int]:
    budget = _budget(limits, caps, uid)
    nproc = budget.processes
    # RLIMIT_NPROC counts every task of the uid. Set after setresuid: lowered before it,
    # leftovers of the uid would make the kernel refuse the drop (PF_NPROC_EXCEEDED).
    if uid is None:  # without a uid of our own it must leave room for this user's others (and the supervisor)
        nproc += _tasks_of(os.getuid()) + 1
        # ... and never reach the engine's own limit: the kernel checks each fork against the forking
        # process's limit, so concurrent runs' fork bombs stop ENGINE_ROOM tasks short of it, and the
        # engine, its zygote and forker can still start a thread or a process.
        engine, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if engine != resource.RLIM_INFINITY:
            nproc = max(1, min(nproc, engine - ENGINE_ROOM))
    signals, _ = resource.getrlimit(resource.RLIMIT_SIGPENDING)
    if signals == resource.RLIM_INFINITY or signals > RUN_SIGNALS:
        signals = RUN_SIGNALS
    return {"NPROC": nproc, "FSIZE": limits.max_file_bytes, "NOFILE": budget.files,
            "CPU": limits.cpu_seconds(), "AS": budget.address_space, "SIGPENDING": signals}


def _config(limits: SandboxLimits, uid: int | None, caps: _Capabilities, *, workdir: str,
            probe: bool = False, dirty: bool = False) -> dict[str, Any]:
    seccomp = "seccomp" not in _LAYERS_OFF
    netns, ipcns = _namespaces(caps, seccomp and bool(kernel_layers()["seccomp"]))
    cgroups = _cgroup_settings(caps, uid if uid is not None else 0, _budget(limits, caps, uid)) \
        if caps.cgroup != "rlimits" else []
    return {
        "uid": uid, "netns": netns, "mntns": caps.mntns, "ipcns": ipcns, "hide": caps.hide,
        "accounts": [UID_BASE, UID_COUNT],
        "expose": caps.expose, "probe": probe, "dirty": dirty, "workdir": workdir, "disk": limits.disk_bytes,
        "cgroups": cgroups, "rlimits": _rlimits(limits, caps, uid), "env": _child_env(workdir),
        "landlock": "landlock" not in _LAYERS_OFF, "seccomp": seccomp,
    }


class _Lease(NamedTuple):
    """Exclusive use of one sandbox uid: an flock on a root-owned lock file, freed by closing
    `fd` (the run's supervisor and the zygote hold duplicates until its cleanup ends). The file
    is empty while nothing of a run is left, holds b"1" while the uid may hold something of a
    run (`dirty`: a crashed engine's run that was never cleaned up: cleaned before use), and
    b"Q <reason>" once the uid is quarantined: something of a run could not be removed, so the
    uid is never leased again (the host's operator removes the file once it is cleaned by hand)."""

    uid: int
    fd: int
    dirty: bool = False


_reported: set[int] = set()  # quarantined uids this process has logged


def _quarantine_seen(uid: int, reason: str, found: bool) -> None:
    """Log a quarantined uid once per process: loudly where the run that left it was ours."""
    if uid in _reported:
        return
    _reported.add(uid)
    (log.warning if not found else log.info)(
        "sandbox uid %d is quarantined and will not be leased again: %s (remove %s once cleaned by hand)",
        uid, reason, os.path.join(LOCK_DIR, str(uid)))


def quarantined(uids: tuple[int, ...]) -> int:
    """How many of `uids` are quarantined on this host (their lock files say so)."""
    count = 0
    for uid in uids:
        try:
            with open(os.path.join(LOCK_DIR, str(uid)), "rb") as f:
                count += f.read(1) == b"Q"
        except OSError:
            pass
    return count


def _try_lease(uids: tuple[int, ...]) -> _Lease | None:
    global _next_slot
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    st = os.lstat(LOCK_DIR)
    if st.st_uid != 0 or st.st_mode & 0o022 or not os.path.isdir(LOCK_DIR) or os.path.islink(LOCK_DIR):
        raise SandboxError(f"{LOCK_DIR} must be a root-owned directory not writable by others")
    barred = 0
    for _ in range(len(uids)):
        with _slot_lock:  # round robin, so a just-released uid rests
            uid, _next_slot = uids[_next_slot % len(uids)], _next_slot + 1
        fd = os.open(os.path.join(LOCK_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        state = os.pread(fd, 4096, 0)
        if state.startswith(b"Q"):
            os.close(fd)
            barred += 1
            _quarantine_seen(uid, state[1:].decode(errors="replace").strip(), found=True)
            continue
        os.pwrite(fd, b"1", 0)
        return _Lease(uid, fd, bool(state))
    if barred == len(uids):
        raise SandboxError(f"every sandbox uid ({UID_BASE}..{UID_BASE + UID_COUNT - 1}) is quarantined: "
                           f"something of a run could not be removed; see {LOCK_DIR}")
    return None


def _release(lease: _Lease, ran: bool) -> None:
    """Give the uid back. Once the run was handed to the zygote, its supervisor (or the zygote)
    marks the file clean or quarantined; before that nothing ran, so it is clean."""
    if not ran:
        os.ftruncate(lease.fd, 0)
    os.close(lease.fd)  # drops our hold on the flock; the supervisor's ends with its cleanup


async def _lease(uids: tuple[int, ...]) -> _Lease:
    while (lease := _try_lease(uids)) is None:  # all uids busy: more runs than UID_COUNT
        await asyncio.sleep(0.05)
    return lease


class _Retry(Exception):
    """The run never started: its uid held leftovers that could not be removed (quarantined: lease
    another), or its zygote had just died (start a new one)."""


class _Collector:
    """Takes the child's output as it arrives, so the child never blocks on a full pipe: keeps
    the first `keep` bytes of each stream, counts the rest, and flags a flood past `flood_at`."""

    def __init__(self, keep: int, flood_at: int) -> None:
        loop = asyncio.get_running_loop()
        self.keep, self.flood_at, self.total, self.dropped = keep, flood_at, 0, 0
        self.kept = {1: bytearray(), 2: bytearray()}
        self.flood, self.closed = loop.create_future(), loop.create_future()
        self._open = {1, 2}
        self.transports: list[asyncio.BaseTransport] = []

    def data(self, fd: int, data: bytes) -> None:
        """Keep what fits, count the rest."""
        kept = self.kept[fd]
        room = max(0, self.keep - len(kept))
        kept += data[:room]
        self.dropped += len(data) - min(room, len(data))
        self.total += len(data)
        if self.total > self.flood_at and not self.flood.done():
            self.flood.set_result(None)

    def lost(self, fd: int) -> None:
        """A stream reached EOF."""
        self._open.discard(fd)
        if not self._open and not self.closed.done():
            self.closed.set_result(None)

    async def attach(self, fd: int, raw: int) -> None:
        """Read pipe `raw` as stream `fd` (1 or 2) on the running loop."""
        collector = self

        class Stream(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                collector.data(fd, data)

            def eof_received(self) -> bool:
                return False

            def connection_lost(self, exc: Exception | None) -> None:
                collector.lost(fd)

        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            Stream, open(raw, "rb", buffering=0))  # noqa: SIM115, ASYNC230 - a pipe; the transport owns and closes it
        self.transports.append(transport)

    def close(self) -> None:
        """Stop listening (a daemon of a run without a uid may hold a pipe open)."""
        for transport in self.transports:
            transport.close()


def _memfd(name: str, data: bytes) -> int:
    """`data` in a sealed memfd: the run may read it, never write it, grow it or shrink it (its
    pages are the engine's, outside the run's budget where no cgroup counts them)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


async def run_python(
    code: str, limits: SandboxLimits = SandboxLimits(), *, stdin: bytes | None = None
) -> SandboxResult:
    """Run `code` as a Python program in a fresh sandbox; returns with nothing of it left running.

    Cancelling the awaiting task kills the whole run and waits (shielded) for its cleanup.
    Raises `SandboxError` only on what the host saw (the sandbox could not be set up, the zygote
    died): whatever the code prints, writes or exits with is its result."""
    caps = _caps if _caps is not None else await asyncio.to_thread(_capabilities)
    for _ in range(len(caps.uids) + 2):
        try:
            return await _run_once(code, limits, stdin, caps)
        except _Retry:
            continue
    raise SandboxError("no sandbox uid could be cleaned for this run, or no zygote would take it")


async def _run_once(code: str, limits: SandboxLimits, stdin: bytes | None, caps: _Capabilities) -> SandboxResult:
    retried_zygote = client.current() is None  # a zygote started now is not retried if it fails at once
    z = client.current() or await asyncio.to_thread(_zygote)
    lease = await _lease(caps.uids) if caps.root else None
    uid = lease.uid if lease else None
    # Named after the zygote, so that its forker finds every run's work dir should the zygote die.
    workdir = SANDBOX_DIR if caps.mntns else os.path.join("/tmp", f"sandbox-{z.proc.pid}-{uuid.uuid4().hex}")
    if uid is None:  # counting this user's tasks reads all of /proc: not on the event loop
        cfg = await asyncio.to_thread(_config, limits, uid, caps, workdir=workdir)
    else:
        cfg = _config(limits, uid, caps, workdir=workdir, dirty=bool(lease and lease.dirty))
    out = _Collector(limits.output_bytes, limits.drain_bytes)
    own: list[int] = []  # ours to close once sent (the zygote got copies)
    unread: list[int] = []  # read ends not handed to a transport yet
    try:
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        own.append(out_w)
        unread.append(out_r)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        own.append(err_w)
        unread.append(err_r)
        await out.attach(1, unread.pop(0))
        await out.attach(2, unread.pop(0))
        stdin_fd = _memfd("sandbox-stdin", stdin) if stdin is not None else os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        own.append(stdin_fd)
        own.append(_memfd("sandbox-code", code.encode("utf-8", errors="surrogateescape")))
        run_id, fut = z.submit(cfg, [stdin_fd, out_w, err_w, own[-1], *([lease.fd] if lease else [])],
                               on_done=(lambda d, held=lease: _release(held, True)) if lease else None)
    except BaseException as e:
        out.close()
        for fd in unread:
            os.close(fd)
        if lease is not None:
            _release(lease, False)
        if isinstance(e, client.ZygoteError):
            if z.dead and not retried_zygote:  # it died (or stopped taking runs) just before: a new one
                raise _Retry() from e
            raise SandboxError(str(e)) from e
        raise
    finally:
        for fd in own:
            os.close(fd)
    lease = None  # on_done owns it now
    done = asyncio.wrap_future(fut)
    started, timed_out, ours = time.time(), False, False
    try:
        finished, _ = await asyncio.wait([done, out.flood], timeout=limits.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        timed_out = not finished
    finally:
        # On timeout, flood, error and cancellation alike. The kill is sent synchronously, so it
        # happens even if we are cancelled again while awaiting the cleanup.
        if not done.done():
            z.kill(run_id)
            ours = True
        ended = await asyncio.shield(_drain(done, out, uid))
    result = done.result()
    if result.get("quarantine") and uid is not None:
        _quarantine_seen(uid, result["quarantine"], found=False)
    elif result.get("quarantine"):
        log.warning("the sandbox could not remove everything a run left: %s", result["quarantine"])
    if result.get("retry"):
        raise _Retry()
    if result["error"]:
        raise SandboxError(result["error"])
    return SandboxResult(
        stdout=out.kept[1].decode(errors="replace"), stderr=out.kept[2].decode(errors="replace"),
        returncode=None if ours else result["rc"], timed_out=timed_out, truncated=out.dropped > 0,
        started=started, ended=ended, killed=ours or result["strays"], dropped=out.dropped,
    )


async def _drain(done: asyncio.Future[Any], out: _Collector, uid: int | None) -> float:
    """Wait for the run and its cleanup, then for the pipes to close; returns the end time."""
    try:
        await done
        # As root every writer is dead now and the pipes close at once; without a uid an
        # escaped daemon may hold them open, so we stop listening after a grace period.
        await asyncio.wait([out.closed], timeout=5 if uid is not None else 1)
    finally:
        out.close()
    return time.time()
