"""The zygote: a pre-started interpreter whose forker starts one sandboxed run per call.

Run by path as `sys.executable -I zygote.py <json>` by `engine.sandbox.client`, with an
empty environment (plus the child's few variables), `/` as its working directory, its own
session, and one end of a SOCK_SEQPACKET socket pair as its only link to the engine. It
imports `child.py`, `confine.py` (Landlock and seccomp) and `forker.py`, preloads some
modules, checks that it is single-threaded, forks the forker, says "ready", then serves.

Two processes, so that no run forks from a process that held another run's records:
* the zygote keeps the records (each run's settings, its setup pipe, the uid lease it holds until
  cleanup ends), answers the engine, builds the template mount namespace once
  (`child.build_template`, kept alive by a holder process), and after each run that may have left
  something forks a cleanup helper (`child.clean_uid`, `child.clean_group`);
* the forker (`forker.py`), forked before the first request, receives per call only a counter, four
  flags and one end of a socket pair holding the run's settings, forks the run (which reads them),
  and is its parent: it kills it on request, reaps it and its orphans, reports its exit, and when
  the zygote dies kills every run and removes their work dirs.
The code of a run and its stdio travel as file descriptors straight to the run and are never
read here; its setup reports on a pipe only this process reads.

Why what a run inherits from this warm interpreter is safe:
* It was started by exec with a fresh environment, never forked from the engine, so it holds
  nothing of the engine's: no environment (API keys), no engine memory.
* The run closes every descriptor but its three stdio pipes (and the code memfd, read first)
  before anything else: it cannot talk to the forker, the zygote or another run.
* It is single-threaded (checked after preloading), so a fork copies no lock held by another thread.
* Shared by all runs: the hash seed and the address layout of what was preloaded (the engine
  restarts the zygote every `client.RESTART_AFTER` runs), and `random`'s state, which Python
  reseeds in every forked child.

When the engine's end of the socket closes, the zygote kills every run, cleans up after them,
and exits; the forker exits with it.
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
forker = _import_here("forker")


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


class Zygote:
    """The serving loop: requests from the engine, reports of the forker, exits of helpers."""

    def __init__(self, ctl: socket.socket, fork_sock: socket.socket, layers: dict[str, Any]) -> None:
        self.ctl, self.forker = ctl, fork_sock
        self.layers = layers  # what the kernel offers (confine.kernel_layers)
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctl, selectors.EVENT_READ, "engine")
        self.sel.register(fork_sock, selectors.EVENT_READ, "forker")
        self.runs: dict[int, dict[str, Any]] = {}  # id -> run record
        self.by_pid: dict[int, int] = {}  # a run's pid (until it exited) -> its id
        self.waiting: dict[int, tuple[int, str, int | None]] = {}  # helper pid -> (run id, "pre" | "clean", pipe)
        # SIGCHLD wakes the selector. As a child subreaper we inherit orphans the forker left should
        # it die, and reap them at once, so no zombie lingers under an init that reaps slowly.
        child.libc().prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER)")
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wakeup fd is written
        self.sel.register(self.wake_r, selectors.EVENT_READ, "sigchld")
        self.templates: dict[str, int | None] = {}  # hide + expose -> the template mount namespace
        self.holders: list[int] = []  # the processes keeping the templates alive
        self.unforked: list[tuple[dict[str, Any], bool]] = []  # cleanups whose helper could not be forked yet

    def template(self, cfg: dict[str, Any]) -> int | None:
        """A descriptor of the mount namespace runs like `cfg` start from, built on first use
        by a holder process that keeps it alive; None when it cannot be built (each run then
        builds its own from scratch)."""
        key = json.dumps([cfg["hide"], cfg["expose"], cfg["accounts"]])
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
            self.retry_helpers()
            for key, _ in self.sel.select(forker.RETRY_S if self.unforked else None):
                if key.data == "engine":
                    if not self.on_request():
                        self.shutdown()
                        return
                elif key.data == "forker":
                    if not self.on_forker():
                        self.shutdown(forker_gone=True)
                        return
                else:
                    self.reap()

    def reap(self) -> None:
        """Reap every exited child; helpers move their runs on, orphans are just gone."""
        for pid, rc in child.reaped(self.wake_r):
            if pid in self.waiting:
                self.helped(pid, rc)

    def on_request(self) -> bool:
        try:
            data, fds = forker.recv_fds(self.ctl)
        except InterruptedError:
            return True
        if not data:
            return False
        msg = json.loads(data)
        if msg["op"] == "run":
            # The lease lock (a dup of the engine's flocked descriptor) is held until the run is
            # cleaned up, so a uid is never leased again while something of its run may be left,
            # even when the engine died first.
            run = {"id": msg["id"], "cfg": msg["cfg"], "fds": fds[:4], "hold": fds[4] if len(fds) > 4 else None,
                   "killed": False, "pid": None, "pgid": None, "status": None, "strays": False, "rc": None,
                   "t": [time.monotonic()]}
            self.runs[msg["id"]] = run
            if msg["cfg"].get("dirty"):  # a lease a crashed engine left: clean before use
                self.start_clean(run, first=True)
            else:
                self.start_run(run)
            return True
        for fd in fds:
            os.close(fd)
        run = self.runs.get(msg["id"])
        if msg["op"] == "kill" and run is not None:
            run["killed"] = True
            if run["pid"] is not None:
                self.tell_forker({"op": "kill", "pid": run["pid"]})
            elif run["status"] is not None:  # handed to the forker, not forked yet (no room for a process)
                self.tell_forker({"op": "cancel", "id": run["id"]})
        return True

    def tell_forker(self, message: dict[str, Any], fds: list[int] | None = None) -> bool:
        try:
            forker.send_fds(self.forker, message, fds or [])
            return True
        except OSError:
            return False

    def start_run(self, run: dict[str, Any]) -> None:
        """Write the run's settings and descriptors into a fresh socket and hand the other end to the forker."""
        if run["killed"]:
            self.finish(run, -signal.SIGKILL, False)
            return
        cfg = run["cfg"]
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        run["status"] = status_r
        names, sent = ["stdin", "stdout", "stderr", "code", "status"], [*run["fds"], status_w]
        template = self.template(cfg) if cfg["mntns"] else None
        if template is not None:
            names.append("template")
            sent.append(template)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            forker.send_fds(ours, {"cfg": dict(cfg, fds=names)}, sent)
            sent_ok = self.tell_forker({"op": "run", "id": run["id"], "kind": kind_of(cfg)}, [theirs.fileno()])
        except OSError:
            sent_ok = False
        finally:
            ours.close()  # what it holds waits in the socket for the run
            theirs.close()
            os.close(status_w)
            self.close_fds(run)
        if not sent_ok:
            self.finish(run, None, False, "the sandbox's forker is gone")

    def close_fds(self, run: dict[str, Any]) -> None:
        for fd in run["fds"]:
            os.close(fd)
        run["fds"] = []

    def on_forker(self) -> bool:
        try:
            data = self.forker.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            return False
        msg = json.loads(data)
        if msg["event"] == "started":
            run = self.runs.get(msg["id"])
            if run is not None:
                run["pid"], run["pgid"] = msg["pid"], msg["pid"]  # the run calls setsid: its pid is its group
                run["t"].append(time.monotonic())
                self.by_pid[msg["pid"]] = run["id"]
                if run["killed"]:
                    self.tell_forker({"op": "kill", "pid": msg["pid"]})
        elif msg["event"] == "cancelled":  # never forked: nothing of it ran, nothing to clean
            run = self.runs.get(msg["id"])
            if run is not None:
                self.finish(run, None, False)
        elif msg["event"] == "exited":
            run_id = self.by_pid.pop(msg["pid"], None)
            if run_id is not None:
                self.on_exit(self.runs[run_id], msg["rc"])
        return True

    def on_exit(self, run: dict[str, Any], rc: int) -> None:
        run["t"].append(time.monotonic())
        run["rc"], run["pid"] = rc, None  # reaped: its pid may be anyone's now, never signal it again
        if run["cfg"]["uid"] is None:  # reaped: a group member left keeps the pgid taken
            run["strays"] = self.killpg(run["pgid"])
        self.start_clean(run)

    def setup_error(self, run: dict[str, Any]) -> str | None:
        """What the run's setup said on its pipe: None once it got to the model's code, else why not."""
        fd, run["status"] = run["status"], None
        if fd is None:
            return None
        try:
            said = os.read(fd, forker.STATUS_LIMIT)
        except OSError:
            said = b""
        finally:
            os.close(fd)
        if said == b"ok":
            return None
        if not said:  # not a word: killed before it was ready (by us, or it died: say which)
            return None if run["killed"] else f"the sandbox's run died while it was set up (exit {run['rc']})"
        return said.decode(errors="replace")

    def needs_clean(self, run: dict[str, Any]) -> bool:
        """Whether the run may have left anything: processes, keys, shared IPC objects, files."""
        cfg = run["cfg"]
        if cfg["uid"] is None:  # its process group may be dying still, its working directory on the host
            return run["strays"] or not cfg["mntns"] and not self.remove_plain_workdir(cfg["workdir"], os.getuid())
        if not cfg["cgroups"] or child.cgroups_busy(cfg["cgroups"]) or child.key_state(cfg["uid"]) != "":
            return True
        if cfg["mntns"] and cfg["ipcns"]:
            return False
        if not (cfg.get("landlock", True) and cfg.get("seccomp", True) and self.layers["landlock"]
                and self.layers["seccomp"]):
            return True  # SysV objects or files in shared directories may be left
        # seccomp refused SysV, queues and keys, Landlock every write outside the work dir, and no
        # process of the uid is left: only the work dir on the host remains, without a mount namespace.
        return not cfg["mntns"] and not self.remove_plain_workdir(cfg["workdir"], cfg["uid"])

    @staticmethod
    def remove_plain_workdir(workdir: str, uid: int) -> bool:
        """Remove a work dir holding nothing but the program (the common case), without a
        fork; False when it holds more (the cleanup helper removes it)."""
        try:
            st = os.lstat(workdir)
            names = os.listdir(workdir)
            if not (os.path.isdir(workdir) and not os.path.islink(workdir) and st.st_uid == uid) or \
                    not set(names) <= {"main.py"}:
                return False
            for name in names:
                os.unlink(os.path.join(workdir, name))  # a symlink is removed, never followed
            os.rmdir(workdir)
            return True
        except OSError:
            return False

    def start_clean(self, run: dict[str, Any], first: bool = False) -> None:
        if not first and not self.needs_clean(run):
            self.finish(run, run["rc"], run["strays"])
            return
        self.fork_helper(run, first)

    def retry_helpers(self) -> None:
        """Fork the cleanup helpers that found no room for a process before."""
        waiting, self.unforked = self.unforked, []
        for run, first in waiting:
            self.fork_helper(run, first)

    def fork_helper(self, run: dict[str, Any], first: bool) -> None:
        """The cleanup helper of `run`; where no process can be forked now (EAGAIN: an ordinary
        user's runs hold every process its RLIMIT_NPROC allows, or a container's pids limit is
        reached) it is tried again every `forker.RETRY_S`, the run's result waiting for it."""
        cfg = run["cfg"]
        uid, workdir = cfg["uid"], None if cfg["mntns"] else cfg["workdir"]
        said_r, said_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError:
            os.close(said_r)
            os.close(said_w)
            self.unforked.append((run, first))
            return
        if pid == 0:  # pragma: no cover - the helper
            code = child.CLEAN_LEFT
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                self.ctl.detach()
                self.forker.detach()
                if uid is None:
                    code, problem = child.clean_group(run["pgid"], workdir)
                else:
                    # A crashed engine's run (first) may have used any mode: clean everything.
                    code, problem = child.clean_uid(uid, workdir, first or not cfg["ipcns"], first or not cfg["mntns"])
                os.write(said_w, problem.encode()[:forker.STATUS_LIMIT])
            except BaseException as e:  # noqa: BLE001 - reported as what is left
                os.write(said_w, f"the cleanup helper failed: {type(e).__name__}: {e}".encode()[:forker.STATUS_LIMIT])
            finally:
                os._exit(code)
        os.close(said_w)
        self.waiting[pid] = (run["id"], "pre" if first else "clean", said_r)

    def helped(self, pid: int, rc: int) -> None:
        run_id, what, said_r = self.waiting.pop(pid)
        with os.fdopen(said_r, "rb") as f:
            problem = f.read().decode(errors="replace")
        if rc not in (0, child.CLEAN_STRAYS):
            problem = problem or f"the cleanup helper exited {rc}"
        run = self.runs[run_id]
        if what == "pre":
            if problem:  # the leftovers of a crashed engine's run stay: never use this uid again
                self.mark(run, problem)
                self.finish(run, None, True, quarantine=problem, retry=True)
            else:
                self.start_run(run)
            return
        self.finish(run, run["rc"], run["strays"] or rc == child.CLEAN_STRAYS or bool(problem), quarantine=problem)

    @staticmethod
    def mark(run: dict[str, Any], problem: str) -> None:
        """The uid's lease file: empty once nothing of the run is left, else quarantined with the reason."""
        if run["hold"] is None:
            return
        try:
            if problem:
                os.pwrite(run["hold"], b"Q " + problem.encode()[:forker.STATUS_LIMIT], 0)
            else:
                os.ftruncate(run["hold"], 0)
        except OSError:
            pass  # stays marked dirty: the next lessee cleans first

    def finish(self, run: dict[str, Any], rc: int | None, strays: bool, error: str | None = None,
               quarantine: str = "", retry: bool = False) -> None:
        error = error or run.get("error") or self.setup_error(run)
        if not retry:
            self.mark(run, quarantine)
        self.close_fds(run)
        if run["hold"] is not None:
            os.close(run["hold"])
        self.runs.pop(run["id"], None)
        run["t"].append(time.monotonic())  # received, started, exited, cleaned up (CLOCK_MONOTONIC)
        send(self.ctl, {"id": run["id"], "event": "done", "rc": rc, "strays": strays, "error": error,
                        "quarantine": quarantine or None, "retry": retry, "t": run["t"]})

    @staticmethod
    def killpg(pgid: int | None) -> bool:
        if pgid is None:
            return False
        try:
            os.killpg(pgid, signal.SIGKILL)
            return True
        except OSError:
            return False

    def cleaning(self) -> set[int]:
        """Runs a helper is cleaning up after (or before) now, or is about to."""
        return {run_id for run_id, _, _ in self.waiting.values()} | {run["id"] for run, _ in self.unforked}

    def shutdown(self, forker_gone: bool = False) -> None:
        """The engine (or the forker) is gone: kill every run, clean up after it, exit."""
        for run in list(self.runs.values()):
            run["killed"] = True
            if run["pid"] is None:
                continue
            if forker_gone:  # it died with the forker (PR_SET_PDEATHSIG): clean up after it
                self.by_pid.pop(run["pid"], None)
                run.update(pid=None, strays=True, error="the sandbox's forker died during the run")
                self.start_clean(run)
            else:
                self.tell_forker({"op": "kill", "pid": run["pid"]})
        deadline = time.monotonic() + SHUTDOWN_S
        self.sel.unregister(self.ctl)
        try:  # no new run: the engine's next one fails at once and goes to a new zygote
            self.ctl.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        if forker_gone:
            self.sel.unregister(self.forker)
        while self.runs and time.monotonic() < deadline:
            if forker_gone:  # a run not started (nor being cleaned) never will be
                for run in [r for r in self.runs.values() if r["id"] not in self.cleaning()]:
                    self.finish(run, None, False, "the sandbox's forker is gone")
            self.retry_helpers()
            for key, _ in self.sel.select(timeout=forker.RETRY_S if self.unforked else 1):
                if key.data == "sigchld":
                    self.reap()
                elif key.data == "forker" and not self.on_forker():
                    self.sel.unregister(self.forker)
                    forker_gone = True
        self.forker.close()  # the forker kills whatever is left and exits
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
        forker.Forker(theirs, layers).serve()
    theirs.close()
    send(ctl, ready)
    Zygote(ctl, ours, layers).serve()


if __name__ == "__main__":
    main()
