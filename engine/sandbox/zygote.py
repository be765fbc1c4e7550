"""The zygote: a pre-started interpreter that forks one sandboxed child per call.

Run by path as `sys.executable -I zygote.py <json>` by `engine.sandbox.client`, with an
empty environment (plus the child's few variables), `/` as its working directory, its own
session, and one end of a SOCK_SEQPACKET socket pair as its only link to the engine. It
imports `child.py` and `confine.py` (Landlock and seccomp: it decides each ruleset and builds
each BPF program once, every child installs them last), preloads some modules, checks that it
is single-threaded, says "ready", then serves: `run` (fork a child that becomes the sandbox and runs the code
without exec: it costs a fork, not an interpreter start; the read-only view of the host
comes from a template mount namespace built once, see `child.build_template`), `kill`
(SIGKILL a run's process group), and, after a run that may have left something, a forked cleanup helper
(`child.clean_uid`). It reaps its own children (and, as a child subreaper, the runs'
orphans), and signals a run only until it reaped it, so a pid it signals is never recycled. When the engine's end of the socket
closes, it kills every run, cleans up, and exits.

Why what a child inherits from this warm parent is safe:
* It was started by exec with a fresh environment, never forked from the engine, so it
  holds nothing of the engine's: no environment (API keys), no engine memory, no open
  files but its socket. Its memory holds the modules it preloaded and the small JSON
  requests of earlier runs (uids, paths, limits: nothing secret); the code of a run and
  its stdio travel as file descriptors straight to that run's child and are never read
  here.
* The child closes every descriptor but its three stdio pipes (and the code memfd,
  read first) before anything else: it cannot talk to the zygote or reach another run.
* It is single-threaded (checked after preloading), so the fork copies no lock held by
  another thread.
* Shared by all children: the hash seed and the address layout of what was preloaded
  (the engine restarts the zygote every `client.RESTART_AFTER` runs), and `random`'s
  state, which Python reseeds in every forked child.
"""

from __future__ import annotations

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
MAX_FDS = 5  # stdin, stdout, stderr, code, and the uid lease lock (held until cleaned up)


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


def send(ctl: socket.socket, message: dict[str, Any]) -> None:
    """One message to the engine (a datagram of JSON)."""
    try:
        ctl.send(json.dumps(message).encode())
    except OSError:
        pass  # the engine is gone; shutdown follows on the next read


def run_program(code: bytes, script: str) -> None:  # pragma: no cover - runs in the child
    """Run `code` as `python -I -B script` would, in this process; never returns."""
    import atexit
    import builtins
    import io

    sys.dont_write_bytecode = True
    sys.argv = [script]
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   encoding="utf-8")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                   encoding="utf-8", errors="backslashreplace", line_buffering=True)
    main = types.ModuleType("__main__")
    main.__dict__.update({"__file__": script, "__builtins__": builtins, "__cached__": None})
    sys.modules["__main__"] = main
    rc = 0
    try:
        exec(compile(code, script, "exec"), main.__dict__)  # noqa: S102 - this is the sandbox
    except SystemExit as e:
        rc = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - printed as the interpreter would
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # drop this frame
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        rc = 1
    rc = _finish(rc, atexit)
    os._exit(rc)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _finish(rc: int, atexit: Any) -> int:  # pragma: no cover - runs in the child
    """What interpreter shutdown would do: join threads, run atexit, flush stdio."""
    threading = sys.modules.get("threading")
    try:
        if threading is not None:
            threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except SystemExit as e:
        rc = _exit_code(e)
    except BaseException:  # noqa: BLE001, S110 - an atexit handler failed: python prints nothing more either
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken pipe: nothing left to say
            rc = rc or 120
    return rc


class Zygote:
    """The serving loop: requests from the engine, exits of runs and helpers."""

    def __init__(self, ctl: socket.socket, layers: dict[str, Any]) -> None:
        self.ctl = ctl
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctl, selectors.EVENT_READ, None)
        self.runs: dict[int, dict[str, Any]] = {}  # id -> run record
        self.waiting: dict[int, tuple[int, str]] = {}  # pid -> (run id, "run" | "pre" | "clean")
        # SIGCHLD wakes the selector. As a child subreaper we inherit every orphan of the runs
        # (a killed daemon's zombie parent, ...) and reap it at once, so no zombie of a uid
        # lingers under an init that reaps slowly, counting against the uid's next lessee.
        child.libc().prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER)")
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wakeup fd is written
        self.sel.register(self.wake_r, selectors.EVENT_READ, "sigchld")
        self.templates: dict[str, int | None] = {}  # hide + expose -> the template mount namespace
        self.layers = layers  # what the kernel offers (confine.kernel_layers)
        self.prepared: dict[str, dict[str, Any]] = {}  # the layers per kind of run, built once
        self.holders: list[int] = []  # the processes keeping the templates alive

    def template(self, cfg: dict[str, Any]) -> int | None:
        """A descriptor of the mount namespace runs like `cfg` start from, built on first use
        by a holder process that keeps it alive; None when it cannot be built (each run then
        builds its own from scratch)."""
        key = json.dumps([cfg["hide"], cfg["expose"]])
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
        """Serve until the engine closes its end."""
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    if not self.on_request():
                        self.shutdown()
                        return
                else:
                    self.reap()

    def reap(self) -> None:
        """Reap every exited child; runs and helpers move on, orphans are just gone."""
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
            if pid in self.waiting:
                self.on_exit(pid, os.waitstatus_to_exitcode(status))

    def on_request(self) -> bool:
        try:
            data, anc, _, _ = self.ctl.recvmsg(1 << 20, socket.CMSG_SPACE(MAX_FDS * 4))
        except InterruptedError:
            return True
        if not data:
            return False
        fds: list[int] = []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(payload).cast("i"))
        msg = json.loads(data)
        if msg["op"] == "run":
            # The lease lock (a dup of the engine's flocked descriptor) is held until the run is
            # cleaned up, so a uid is never leased again while we may still kill(-1) as it,
            # even when the engine died first.
            run = {"id": msg["id"], "cfg": msg["cfg"], "fds": fds[:4], "hold": fds[4:], "killed": False,
                   "pid": None, "strays": False, "rc": None, "t": [time.monotonic()]}
            self.runs[msg["id"]] = run
            if msg["cfg"].get("dirty"):  # a lease a crashed engine left: clean before use
                self.start_clean(run, first=True)
            else:
                self.start_run(run)
        elif msg["op"] == "kill":
            run = self.runs.get(msg["id"])
            if run is not None:
                run["killed"] = True
                if run["pid"] is not None:
                    self.killpg(run["pid"])  # not reaped yet: the pid is still this run's
        for fd in fds if msg["op"] != "run" else ():
            os.close(fd)
        return True

    def watch(self, pid: int, run_id: int, what: str) -> None:
        self.waiting[pid] = (run_id, what)

    def start_run(self, run: dict[str, Any]) -> None:
        if run["killed"]:
            self.finish(run, -signal.SIGKILL, False)
            return
        template = self.template(run["cfg"]) if run["cfg"]["mntns"] else None
        if template is not None:
            run["cfg"] = dict(run["cfg"], template=template)
        cfg = run["cfg"]
        key = json.dumps([cfg.get(k) for k in ("landlock", "seccomp", "mntns")] + [cfg["uid"] is None])
        if key not in self.prepared:  # the BPF program and the Landlock rights: once, not per run
            self.prepared[key] = confine.prepare(cfg, self.layers)
        run["layers"] = self.prepared[key]
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            self.become_run(run)
        self.close_fds(run)
        run["pid"] = pid
        self.watch(pid, run["id"], "run")

    def close_fds(self, run: dict[str, Any]) -> None:
        for fd in run["fds"]:
            os.close(fd)
        run["fds"] = []

    def become_run(self, run: dict[str, Any]) -> None:  # pragma: no cover - the child
        cfg = run["cfg"]
        try:
            stdin, stdout, stderr, code_fd = run["fds"]
            for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
                os.dup2(fd, target)
            with os.fdopen(code_fd, "rb") as f:
                code = f.read()
            signal.set_wakeup_fd(-1)  # else a signal would write into whatever file gets its number
            self.ctl.detach()  # closed just below: the object must not close a reused number
            keep = cfg.get("template")  # a mount namespace: enter() joins it, then closes it
            os.closerange(3, keep if keep is not None else 1 << 20)  # only stdio remains: no way back
            if keep is not None:
                os.closerange(keep + 1, 1 << 20)
            held: list[tuple[int, int, str]] = []
            child.enter(cfg, sys.path, lambda: held.extend(confine.hold(run["layers"])))
            script = os.path.join(cfg["workdir"], "main.py")
            if not cfg["probe"]:
                with open(script, "wb") as f:  # tracebacks show its lines, as for any script
                    f.write(code)
            os.environ.clear()
            os.environ.update(cfg["env"])
            child.set_limits(cfg)
            confine.apply(run["layers"], held, cfg["workdir"])  # last: Landlock, then seccomp
            if cfg["probe"]:
                os._exit(0)
        except BaseException as e:  # noqa: BLE001 - whatever failed, the engine must hear of it
            os.write(2, f"{cfg['nonce']} {type(e).__name__}: {e}\n".encode())
            os._exit(child.SETUP_FAILED)
        run_program(code, script)

    def needs_clean(self, run: dict[str, Any]) -> bool:
        """Whether the run may have left anything: processes, keys, shared IPC objects, files."""
        cfg = run["cfg"]
        if cfg["uid"] is None:
            return True  # its process group may be dying still, its working directory on the host
        if not cfg["cgroups"] or child.cgroups_busy(cfg["cgroups"]) or child.key_state(cfg["uid"]) != "":
            return True
        if cfg["mntns"] and cfg["ipcns"]:
            return False
        layers = run.get("layers") or {}
        if not (layers.get("abi") and layers.get("bpf") is not None):
            return True  # SysV objects or files in shared directories may be left
        # seccomp refused SysV and keys, Landlock every write outside the work dir, and no process
        # of the uid is left: only the work dir on the host remains, when there is no mount namespace.
        return not cfg["mntns"] and not self.remove_plain_workdir(cfg["workdir"], cfg["uid"])

    @staticmethod
    def remove_plain_workdir(workdir: str, uid: int) -> bool:
        """Remove a work dir holding nothing but the program (the common case), without a
        fork; False when it holds more (the cleanup helper removes it as the uid)."""
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
        cfg = run["cfg"]
        uid, workdir = cfg["uid"], None if cfg["mntns"] else cfg["workdir"]
        if not first and not self.needs_clean(run):
            self.finish(run, run["rc"], False)
            return
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the helper
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                self.ctl.detach()
                os.closerange(3, 1 << 20)
                if uid is None:
                    code = child.clean_group(run.get("pgid"), workdir)
                else:
                    # A crashed engine's run (first) may have used any mode: clean everything.
                    code = child.clean_uid(uid, workdir, first or not cfg["ipcns"], first or not cfg["mntns"])
            finally:
                os._exit(code)
        self.watch(pid, run["id"], "pre" if first else "clean")

    def on_exit(self, pid: int, rc: int) -> None:
        run_id, what = self.waiting.pop(pid)
        run = self.runs[run_id]
        if what == "run":
            run["t"].append(time.monotonic())
            run["rc"], run["pid"] = rc, None  # reaped: its pid may be anyone's now, never signal it again
            strays = False
            if run["cfg"]["uid"] is None:  # reaped: a group member left keeps the pgid taken
                strays = self.killpg(pid)
            run["strays"], run["pgid"] = strays, pid
            self.start_clean(run)
        elif what == "pre":
            self.start_run(run)
        else:
            self.finish(run, run["rc"], run["strays"] or rc == child.CLEAN_STRAYS,
                        None if rc in (0, child.CLEAN_STRAYS) else f"the cleanup helper exited {rc}")

    def finish(self, run: dict[str, Any], rc: int | None, strays: bool, error: str | None = None) -> None:
        self.close_fds(run)
        for fd in run["hold"]:
            os.close(fd)
        self.runs.pop(run["id"], None)
        run["t"].append(time.monotonic())  # received, run exited, cleaned up (CLOCK_MONOTONIC)
        send(self.ctl, {"id": run["id"], "event": "done", "rc": rc, "strays": strays, "error": error, "t": run["t"]})

    @staticmethod
    def killpg(pid: int) -> bool:
        try:
            os.killpg(pid, signal.SIGKILL)
            return True
        except OSError:
            return False

    def shutdown(self) -> None:
        """The engine is gone: kill every run, clean up after it, exit."""
        for run in list(self.runs.values()):
            if run["pid"] is not None:
                self.killpg(run["pid"])
        while self.waiting:
            for key, _ in self.sel.select(timeout=10):
                if key.data is not None:
                    self.reap()
        for pid in self.holders:
            self.killpg(pid) or os.kill(pid, signal.SIGKILL)
        self.reap()  # the zombies of what the helpers killed: not left to init


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


def main() -> None:
    """Start-up: preload, check, say ready, serve."""
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
    layers = confine.kernel_layers()
    sys.meta_path.insert(0, _ClearMultiprocessingError())
    threads = len(os.listdir("/proc/self/task"))
    send(ctl, {"event": "ready", "pid": os.getpid(), "threads": threads, "preloaded": preloaded, "failed": failed,
               "layers": layers})
    if threads != 1:
        return  # forking a threaded process could copy a held lock: the engine reports it
    Zygote(ctl, layers).serve()


if __name__ == "__main__":
    main()
