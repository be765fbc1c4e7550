"""The zygote: a pre-started interpreter whose forker starts one supervised, sandboxed run per call.

Run by path as `sys.executable -I zygote.py <json>` by `engine.sandbox.client`, with an
empty environment (plus the child's few variables), `/` as its working directory, its own
session, and one end of a SOCK_SEQPACKET socket pair as its only link to the engine. It
imports `child.py`, `confine.py` (Landlock and seccomp) and `supervisor.py`, preloads some
modules, checks that it is single-threaded, forks the forker, says "ready", then serves.

Three kinds of process, so that no run forks from a process that held another run's records:
* the zygote keeps the records (each run's settings, its supervisor's socket, the uid lease it
  holds until cleanup ends), answers the engine, builds the template mount namespace once
  (`child.build_template`, kept alive by a holder process) and, should a supervisor die, cleans
  up after its run itself (a forked helper);
* the forker, forked before the first request, receives per call only the kind of sandbox (four
  flags, to pick the Landlock rights and BPF program it built once per kind) and one end of a
  socket pair, and forks a supervisor holding it;
* the supervisor (`supervisor.py`) reads its own run's settings and descriptors from that
  socket, forks the run, kills it on request, cleans up after it, and reports.
The code of a run and its stdio travel as file descriptors straight to its supervisor and its
run and are never read here.

Why what a run inherits from this warm interpreter is safe:
* It was started by exec with a fresh environment, never forked from the engine, so it holds
  nothing of the engine's: no environment (API keys), no engine memory.
* The run closes every descriptor but its three stdio pipes (and the code memfd, read first)
  before anything else: it cannot talk to its supervisor, the zygote or another run.
* It is single-threaded (checked after preloading), so a fork copies no lock held by another thread.
* Shared by all runs: the hash seed and the address layout of what was preloaded (the engine
  restarts the zygote every `client.RESTART_AFTER` runs), and `random`'s state, which Python
  reseeds in every forked child.

When the engine's end of the socket closes, the zygote kills every run, waits for their
supervisors to clean up, and exits; the forker exits with it. When the zygote itself dies,
each supervisor sees its socket close and kills and cleans up its run all the same.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import sys
import time
import types
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PR_SET_CHILD_SUBREAPER = 36
SHUTDOWN_S = 30.0  # the most the zygote waits for its runs' cleanups once the engine is gone


def _import_here(name: str) -> types.ModuleType:
    """`<name>.py` from this directory, without leaving the directory on `sys.path`."""
    sys.path.insert(0, HERE)
    try:
        return __import__(name)
    finally:
        sys.path.remove(HERE)
        sys.path_importer_cache.pop(HERE, None)


child = _import_here("child")
confine = _import_here("confine")  # Landlock and seccomp, the layers that need no privilege
supervisor = _import_here("supervisor")


def send(ctl: socket.socket, message: dict[str, Any]) -> None:
    """One message to the engine (a datagram of JSON)."""
    try:
        ctl.send(json.dumps(message).encode())
    except OSError:
        pass  # the engine is gone; shutdown follows on the next read


def kind_of(cfg: dict[str, Any]) -> list[bool]:
    """What the forker needs to know of a run: which layers, a mount namespace, a uid of its own."""
    return [bool(cfg.get("landlock", True)), bool(cfg.get("seccomp", True)), bool(cfg["mntns"]),
            cfg["uid"] is not None]


def forker(sock: socket.socket, layers: dict[str, Any]) -> None:  # pragma: no cover - its own process
    """The forker's loop: per request, fork a supervisor holding the socket end that came with it."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    prepared: dict[tuple[bool, ...], dict[str, Any]] = {}
    while True:
        try:
            data, fds = supervisor.recv_fds(sock, 4096)
        except InterruptedError:
            continue
        except OSError:
            data, fds = b"", []
        if not data:
            os._exit(0)  # the zygote is gone
        kind = tuple(json.loads(data)["kind"])
        if kind not in prepared:  # the BPF program and the Landlock rights: once per kind
            landlock, seccomp, mntns, own_uid = kind
            prepared[kind] = confine.prepare({"landlock": landlock, "seccomp": seccomp, "mntns": mntns,
                                              "uid": 0 if own_uid else None}, layers)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            supervisor.Supervisor(socket.socket(fileno=fds[0]), prepared[kind]).main()
        for fd in fds:
            os.close(fd)


class Zygote:
    """The serving loop: requests from the engine, reports of supervisors, exits of helpers."""

    def __init__(self, ctl: socket.socket, forker_sock: socket.socket) -> None:
        self.ctl, self.forker = ctl, forker_sock
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctl, selectors.EVENT_READ, "engine")
        self.sel.register(forker_sock, selectors.EVENT_READ, "forker")
        self.runs: dict[int, dict[str, Any]] = {}  # id -> run record
        self.helpers: dict[int, tuple[int, int]] = {}  # pid of a fallback cleanup -> (run id, its report pipe)
        # SIGCHLD wakes the selector. As a child subreaper we inherit orphans a dead supervisor
        # left and reap them at once, so no zombie lingers under an init that reaps slowly.
        child.libc().prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER)")
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wakeup fd is written
        self.sel.register(self.wake_r, selectors.EVENT_READ, "sigchld")
        self.templates: dict[str, int | None] = {}  # hide + expose -> the template mount namespace
        self.holders: list[int] = []  # the processes keeping the templates alive

    def template(self, cfg: dict[str, Any]) -> int | None:
        """A descriptor of the mount namespace runs like `cfg` start from, built on first use
        by a holder process that keeps it alive; None when it cannot be built (each run then
        builds its own from scratch)."""
        key = json.dumps([cfg["hide"], cfg["expose"], cfg.get("accounts")])
        if key not in self.templates:
            self.templates[key] = self.build_template(cfg)
        return self.templates[key]

    def build_template(self, cfg: dict[str, Any]) -> int | None:
        r, w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the holder
            try:
                signal.set_wakeup_fd(-1)
                self.ctl.detach()
                os.closerange(3, min(r, w))
                os.closerange(max(r, w) + 1, 1 << 20)
                child.libc().prctl(child.PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
                child.build_template(child.libc(), cfg)
                os.write(w, b"ok")
                os.close(w)
                while True:
                    signal.pause()
            except BaseException as e:  # noqa: BLE001 - reported to the zygote, which falls back
                os.write(w, f"{type(e).__name__}: {e}".encode())
            os._exit(1)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            said = f.read(4096)  # EOF once the holder reported (or died)
        if said != b"ok":
            return None
        self.holders.append(pid)
        return os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)

    def serve(self) -> None:
        """Serve until the engine closes its end (or the forker is gone: nothing could run)."""
        while True:
            for key, _ in self.sel.select():
                if key.data in ("engine", "forker"):
                    if not (key.data == "engine" and self.on_request()):
                        self.shutdown()
                        return
                elif key.data == "sigchld":
                    self.reap()
                else:
                    self.on_supervisor(key.data)

    def reap(self) -> None:
        """Reap every exited child; a fallback cleanup's end finishes its run, others are just gone."""
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.helpers:
                self.helped(pid, os.waitstatus_to_exitcode(status))

    def on_request(self) -> bool:
        try:
            data, fds = supervisor.recv_fds(self.ctl)
        except InterruptedError:
            return True
        if not data:
            return False
        msg = json.loads(data)
        if msg["op"] == "run":
            self.start(msg["id"], msg["cfg"], fds)
            return True
        for fd in fds:
            os.close(fd)
        run = self.runs.get(msg["id"])
        if msg["op"] == "kill" and run is not None:
            run["killed"] = True
            self.tell(run, {"op": "kill"})
        return True

    def start(self, run_id: int, cfg: dict[str, Any], fds: list[int]) -> None:
        """Hand a run to a new supervisor: its settings and descriptors on a socket of its own,
        the other end through the forker. The lease lock (a dup of the engine's flocked
        descriptor) is kept until the run is cleaned up, so a uid is never leased again while
        something of its run may be left, even when the engine died first."""
        names = list(supervisor.FDS[:len(fds)])
        run = {"id": run_id, "cfg": cfg, "killed": False, "pid": None, "sock": None, "t": [time.monotonic()],
               "hold": os.dup(fds[names.index("lease")]) if "lease" in names else None}
        self.runs[run_id] = run
        sent = list(fds)
        template = self.template(cfg) if cfg["mntns"] else None
        if template is not None:
            names.append("template")
            sent.append(template)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            supervisor.send_fds(ours, {"cfg": dict(cfg, fds=names)}, sent)
            supervisor.send_fds(self.forker, {"kind": kind_of(cfg)}, [theirs.fileno()])
        except OSError as e:
            ours.close()
            self.finish(run, {"rc": None, "strays": False, "error": f"the sandbox forker is gone: {e}"})
            return
        finally:
            theirs.close()
            for fd in fds:
                os.close(fd)
        run["sock"] = ours
        self.sel.register(ours, selectors.EVENT_READ, run_id)

    @staticmethod
    def tell(run: dict[str, Any], message: dict[str, Any]) -> None:
        if run["sock"] is not None:
            try:
                run["sock"].send(json.dumps(message).encode())
            except OSError:
                pass  # the supervisor is gone: its socket's end says so next

    def on_supervisor(self, run_id: int) -> None:
        run = self.runs[run_id]
        try:
            data = run["sock"].recv(1 << 16)
        except OSError:
            data = b""
        if not data:  # the supervisor died before its report: clean up after its run ourselves
            self.fallback(run)
            return
        msg = json.loads(data)
        if msg["event"] == "started":
            run["pid"] = msg["pid"]
        elif msg["event"] == "done":
            self.finish(run, msg)

    def close_sock(self, run: dict[str, Any]) -> None:
        if run["sock"] is not None:
            self.sel.unregister(run["sock"])
            run["sock"].close()
            run["sock"] = None

    def fallback(self, run: dict[str, Any]) -> None:
        """Fork a helper that kills and removes what the run left, as its supervisor would have."""
        self.close_sock(run)
        cfg = run["cfg"]
        said_r, said_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the helper
            code = child.CLEAN_LEFT
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                self.ctl.detach()
                workdir = None if cfg["mntns"] else cfg["workdir"]
                if cfg["uid"] is None:
                    code, problem = child.clean_group(run["pid"], workdir)
                else:
                    code, problem = child.clean_uid(cfg["uid"], workdir, True, True)
                os.write(said_w, problem.encode()[:supervisor.STATUS_LIMIT])
            except BaseException as e:  # noqa: BLE001 - reported as what is left
                os.write(said_w, f"{type(e).__name__}: {e}".encode()[:supervisor.STATUS_LIMIT])
            finally:
                os._exit(code)
        os.close(said_w)
        self.helpers[pid] = (run["id"], said_r)

    def helped(self, pid: int, rc: int) -> None:
        run_id, said_r = self.helpers.pop(pid)
        with os.fdopen(said_r, "rb") as f:
            problem = f.read().decode(errors="replace")
        if rc not in (0, child.CLEAN_STRAYS):
            problem = problem or f"the cleanup helper exited {rc}"
        run = self.runs[run_id]
        if run["hold"] is not None:
            try:
                if problem:
                    os.pwrite(run["hold"], b"Q " + problem.encode(), 0)
                else:
                    os.ftruncate(run["hold"], 0)
            except OSError:
                pass  # stays marked dirty: the next lessee cleans first
        self.finish(run, {"rc": None, "strays": True, "error": None, "quarantine": problem or None})

    def finish(self, run: dict[str, Any], report: dict[str, Any]) -> None:
        self.close_sock(run)
        if run["hold"] is not None:
            os.close(run["hold"])
        self.runs.pop(run["id"], None)
        report = {"error": None, "quarantine": None, "retry": False, **report}
        report["t"] = run["t"] + list(report.get("t") or [])  # received here, then the supervisor's stamps
        send(self.ctl, {"id": run["id"], "event": "done", **{k: report[k] for k in
             ("rc", "strays", "error", "quarantine", "retry", "t")}})

    def shutdown(self) -> None:
        """The engine is gone: kill every run, let the supervisors clean up, exit."""
        for run in list(self.runs.values()):
            self.tell(run, {"op": "kill"})
        deadline = time.monotonic() + SHUTDOWN_S
        for what in ("engine", "forker"):
            self.sel.unregister(self.ctl if what == "engine" else self.forker)
        while self.runs and time.monotonic() < deadline:
            for key, _ in self.sel.select(timeout=1):
                if key.data == "sigchld":
                    self.reap()
                else:
                    self.on_supervisor(key.data)
        self.forker.close()  # the forker exits
        for pid in self.holders:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.reap()  # the zombies of what was killed: not left to init


MP_REFUSED = ("multiprocessing is not available in this sandbox: its locks need /dev/shm, which a run may not "
              "write (shared memory outside the run's budget). Use threads, "
              "concurrent.futures.ThreadPoolExecutor or subprocess instead.")


class _ClearMultiprocessingError:
    """A meta path finder that, once `multiprocessing.synchronize` is loaded, makes its
    SemLock fail with `MP_REFUSED` instead of a bare EACCES/EROFS (every Lock, Queue and
    Pool creates one). Installed in the zygote, so a run pays nothing for it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "multiprocessing.synchronize":
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run_module(module)
            original = module.SemLock.__init__

            def init(self: Any, *args: Any, **kwargs: Any) -> None:
                try:
                    original(self, *args, **kwargs)
                except OSError as e:
                    raise PermissionError(e.errno, MP_REFUSED) from None

            module.SemLock.__init__ = init

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def sqlite_without_file_locks() -> bool:
    """Make SQLite's default VFS the one that locks with lock files beside the database instead
    of fcntl locks, which the seccomp filter refuses (a lock on a file every run can open is a
    signal between runs). Through SQLite's public C API on the library `_sqlite3` links; False
    where that library cannot be reached (sqlite3 then reports the refused lock)."""
    try:
        import _sqlite3

        lib = ctypes.CDLL(_sqlite3.__file__)
        lib.sqlite3_vfs_find.restype = ctypes.c_void_p
        lib.sqlite3_vfs_find.argtypes = [ctypes.c_char_p]
        lib.sqlite3_vfs_register.argtypes = [ctypes.c_void_p, ctypes.c_int]
        vfs = lib.sqlite3_vfs_find(b"unix-dotfile")
        return bool(vfs) and lib.sqlite3_vfs_register(vfs, 1) == 0
    except (ImportError, OSError, AttributeError):
        return False


def main() -> None:
    """Start-up: preload, check, fork the forker, say ready, serve."""
    start = json.loads(sys.argv[1])
    sys.dont_write_bytecode = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when we stop, by closing the socket
    ctl = socket.socket(fileno=start["fd"])
    child.seal_session_keyring(child.libc())
    preloaded, failed = [], []
    for name in start["preload"]:
        try:
            __import__(name)
            preloaded.append(name)
        except Exception:  # noqa: BLE001 - a missing optional module only costs its import later
            failed.append(name)
    sqlite = sqlite_without_file_locks()
    layers = confine.kernel_layers()
    sys.meta_path.insert(0, _ClearMultiprocessingError())
    threads = len(os.listdir("/proc/self/task"))
    ready = {"event": "ready", "pid": os.getpid(), "threads": threads, "preloaded": preloaded, "failed": failed,
             "layers": layers, "sqlite_lock_files": sqlite}
    if threads != 1:
        send(ctl, ready)
        return  # forking a threaded process could copy a held lock: the engine reports it
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.fork() == 0:  # the forker: a copy taken before any request, so it holds no run's record
        ctl.close()
        ours.close()
        forker(theirs, layers)
    theirs.close()
    send(ctl, ready)
    Zygote(ctl, ours).serve()


if __name__ == "__main__":
    main()
