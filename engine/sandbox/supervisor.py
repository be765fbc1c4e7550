"""One run's supervisor, and the run itself: the two processes the zygote's forker starts per call.

The zygote (`zygote.py`) keeps the records of every run; the runs never fork from it. At
start-up it forks the forker, a copy of itself taken before any request, which never receives
a run's settings: per call it forks a supervisor and hands it one end of a socket pair whose
other end the zygote holds. The supervisor reads its own run's settings and descriptors from
that socket, forks the run, and answers for it:

* the run's setup (`become_run`) reports on a pipe the model's code never holds: "ok" just
  before the first instruction of that code, or the error that stopped it. Only this, seen by
  the supervisor, can make the engine say the sandbox is broken; what the code prints, writes
  or exits with is its result, whatever it looks like;
* `kill` from the zygote (a timeout, a cancel) kills the run's process group; the supervisor
  is its parent, so it signals a pid it has not reaped yet, never a recycled one;
* when the run exits, the supervisor kills what it left and removes its files (or, with a uid
  of the run's own, forks a helper that does it as that uid), checks that nothing is left, and
  marks the uid's lease: clean, or quarantined (never leased again) with the reason;
* when the zygote dies (its end of the socket closes), the supervisor kills the run and
  cleans up all the same, so a run never outlives its supervisor. The run itself dies with
  the supervisor (PR_SET_PDEATHSIG); orphans of the run are reparented to the supervisor (a
  child subreaper), which reaps them.

Messages to the zygote, one datagram of JSON each: {"event": "started", "pid": n} once the run
is forked, then {"event": "done", "rc", "strays", "error", "quarantine", "retry", "t"}.
Standard library only; loaded by path in the zygote, like `child.py` and `confine.py`.
"""

from __future__ import annotations

import array
import json
import os
import selectors
import signal
import socket
import sys
import time
import types
from typing import Any, NoReturn

if __package__:  # imported as engine.sandbox.supervisor (tests, the engine)
    from engine.sandbox import child, confine
else:  # loaded by path in the zygote
    import child  # type: ignore[no-redef]
    import confine  # type: ignore[no-redef]

PR_SET_CHILD_SUBREAPER = 36
FDS = ("stdin", "stdout", "stderr", "code", "lease", "template")  # what a run's descriptors may be, in order
MAX_FDS = len(FDS)
STATUS_LIMIT = 4096  # bytes of a setup error kept


def recv_fds(sock: socket.socket, size: int = 1 << 20) -> tuple[bytes, list[int]]:
    """One datagram and the descriptors that came with it."""
    data, anc, _, _ = sock.recvmsg(size, socket.CMSG_SPACE(MAX_FDS * 4))
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(memoryview(payload).cast("i"))
    return data, fds


def send_fds(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    """One datagram of JSON, with descriptors."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([json.dumps(message).encode()], anc)


class Supervisor:
    """One run, from the socket the forker handed over to the report of its end."""

    def __init__(self, sock: socket.socket, prepared: dict[str, Any]) -> None:
        self.sock = sock
        self.prepared = prepared  # the Landlock rights and the BPF program, decided by the forker
        self.cfg: dict[str, Any] = {}
        self.fds: dict[str, int] = {}
        self.pid: int | None = None  # the run, until reaped
        self.group: int | None = None  # the run's process group (its pid: the run calls setsid)
        self.rc: int | None = None
        self.killed = False
        self.orphaned = False  # the zygote is gone: nobody to report to
        self.t = [time.monotonic()]

    def main(self) -> NoReturn:
        """Everything the supervisor does; exits the process."""
        code = 0
        try:
            self.serve()
        except BaseException as e:  # noqa: BLE001 - the zygote falls back on its own cleanup
            os.write(2, f"sandbox supervisor: {type(e).__name__}: {e}\n".encode())
            code = 1
        os._exit(code)

    def serve(self) -> None:
        data, fds = recv_fds(self.sock)
        if not data:
            return  # the zygote went away before sending the run
        self.cfg = json.loads(data)["cfg"]
        self.fds = dict(zip(self.cfg["fds"], fds))
        child.libc().prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER)")
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wakeup fd is written
        if self.cfg.get("dirty"):  # a lease a crashed engine left: clean before use
            rc, problem = self.clean(first=True)
            if rc == child.CLEAN_LEFT:
                self.mark(problem)
                self.report(rc=None, strays=True, quarantine=problem, retry=True)
                return
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        self.poll_requests()
        if not self.killed:
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the run
                os.close(status_r)
                become_run(self.cfg, self.fds, status_w, self.prepared)
            self.pid = self.group = pid
            self.send({"event": "started", "pid": pid})
        os.close(status_w)
        for name in ("stdin", "stdout", "stderr", "code", "template"):
            if name in self.fds:
                os.close(self.fds.pop(name))
        if self.pid is not None:
            self.watch()
        self.t.append(time.monotonic())
        setup = self.read_status(status_r)
        rc, problem = self.clean(first=False)
        self.mark(problem)
        self.t.append(time.monotonic())
        self.report(rc=None if self.killed else self.rc, strays=rc in (child.CLEAN_STRAYS, child.CLEAN_LEFT),
                    quarantine=problem or None, error=setup)

    def send(self, message: dict[str, Any]) -> None:
        if self.orphaned:
            return
        try:
            self.sock.send(json.dumps(message).encode())
        except OSError:
            self.orphaned = True

    def report(self, **fields: Any) -> None:
        self.send({"event": "done", "error": None, "quarantine": None, "retry": False, "t": self.t, **fields})

    def poll_requests(self, timeout: float = 0) -> None:
        """Take what the zygote sent: a kill, or its end closing (the zygote died: kill all the same)."""
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        try:
            while sel.select(timeout):
                try:
                    data = self.sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    self.orphaned = True
                    self.kill()
                    return
                if json.loads(data).get("op") == "kill":
                    self.kill()
                timeout = 0
        finally:
            sel.close()

    def kill(self) -> None:
        self.killed = True
        if self.pid is not None:  # not reaped yet: the pid (and its group) is still the run's
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass

    def watch(self) -> None:
        """Until the run exits: requests from the zygote, and every child that exits (the run, or
        an orphan of it reparented to us)."""
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, "zygote")
        sel.register(self.wake_r, selectors.EVENT_READ, "child")
        try:
            while self.pid is not None:
                for key, _ in sel.select():
                    if key.data == "zygote" and not self.orphaned:
                        self.poll_requests()
                        if self.orphaned:
                            sel.unregister(self.sock)
                    elif key.data == "child":
                        self.reap()
        finally:
            sel.close()

    def reap(self) -> bool:
        """Reap every exited child; whether any is left."""
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.pid:
                self.rc, self.pid = os.waitstatus_to_exitcode(status), None

    @staticmethod
    def read_status(fd: int) -> str | None:
        """The run's setup report: None once it got to the model's code (or was killed on the way),
        else what stopped it."""
        try:
            said = os.read(fd, STATUS_LIMIT)
        finally:
            os.close(fd)
        if said == b"ok" or not said:
            return None  # not a word: it was killed (by us, or its memory limit) before it was ready
        return said.decode(errors="replace")

    def clean(self, first: bool) -> tuple[int, str]:
        """Kill what the run left and remove its files; (exit code as `child.clean_uid`'s, what is left)."""
        cfg = self.cfg
        uid, workdir = cfg["uid"], None if cfg["mntns"] else cfg["workdir"]
        if uid is None:
            rc, problem = child.clean_group(self.group, workdir, self.reap)
            strays = self.kill_orphans()
            return (child.CLEAN_STRAYS if strays and rc == 0 else rc), problem
        if not first and not self.needs_helper():
            self.kill_orphans()
            return 0, ""
        return self.helper(uid, workdir, shared_ipc=first or not cfg["ipcns"], shared_fs=first or not cfg["mntns"])

    def kill_orphans(self) -> bool:
        """SIGKILL every child still ours (orphans of the run reparented to us) and reap them."""
        found = False
        deadline = time.monotonic() + 5
        while self.reap() and time.monotonic() < deadline:
            for pid in _children():
                found = True
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.002)
        return found

    def needs_helper(self) -> bool:
        """Whether a run with a uid of its own may have left anything: processes, keys, shared IPC objects, files."""
        cfg = self.cfg
        if not cfg["cgroups"] or child.cgroups_busy(cfg["cgroups"]) or child.key_state(cfg["uid"]) != "":
            return True
        if cfg["mntns"] and cfg["ipcns"]:
            return False
        layers = self.prepared
        if not (layers.get("abi") and layers.get("bpf") is not None):
            return True  # SysV objects or files in shared directories may be left
        # seccomp refused SysV, queues and keys, Landlock every write outside the work dir, and no
        # process of the uid is left: only the work dir on the host remains, without a mount namespace.
        return not cfg["mntns"] and bool(child.remove_tree(cfg["workdir"]))

    def helper(self, uid: int, workdir: str | None, shared_ipc: bool, shared_fs: bool) -> tuple[int, str]:
        """Fork a helper that cleans as `uid` (`child.clean_uid`); its exit code and what it left."""
        said_r, said_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the helper
            code = child.CLEAN_LEFT
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                code, problem = child.clean_uid(uid, workdir, shared_ipc, shared_fs)
                os.write(said_w, problem.encode()[:STATUS_LIMIT])
            except BaseException as e:  # noqa: BLE001 - reported as what is left
                os.write(said_w, f"the cleanup helper failed: {type(e).__name__}: {e}".encode()[:STATUS_LIMIT])
            finally:
                os._exit(code)
        os.close(said_w)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return child.CLEAN_LEFT, "the cleanup helper vanished"
        with os.fdopen(said_r, "rb") as f:
            problem = f.read(STATUS_LIMIT).decode(errors="replace")
        self.kill_orphans()  # the uid's processes the helper killed were reparented to us: reap them
        rc = os.waitstatus_to_exitcode(status)
        if rc not in (0, child.CLEAN_STRAYS, child.CLEAN_LEFT):
            return child.CLEAN_LEFT, problem or f"the cleanup helper exited {rc}"
        return rc, problem

    def mark(self, problem: str) -> None:
        """The uid's lease file: empty once nothing of the run is left, else quarantined with the reason."""
        lease = self.fds.get("lease")
        if lease is None:
            return
        try:
            if problem:
                os.pwrite(lease, b"Q " + problem.encode()[:STATUS_LIMIT], 0)
            else:
                os.ftruncate(lease, 0)
        except OSError:
            pass  # the file stays marked dirty: the next lessee cleans first


def _children() -> list[int]:
    """This process's children, from /proc (the orphans it adopted included)."""
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                found += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return found


def become_run(cfg: dict[str, Any], fds: dict[str, int], status: int,
               prepared: dict[str, Any]) -> NoReturn:  # pragma: no cover - runs in the run's process
    """Turn this forked process into the run: stdio, the sandbox (`child.enter`), its limits,
    Landlock and seccomp last, "ok" on `status`, then the model's code. A failure is written to
    `status` (never to the run's own output) and exits `child.SETUP_FAILED`."""
    try:
        for name, target in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
            os.dup2(fds[name], target)
        with os.fdopen(fds["code"], "rb") as f:
            code = f.read()
        signal.set_wakeup_fd(-1)  # else a signal would write into whatever file gets its number
        keep = sorted(fd for fd in (status, fds.get("template")) if fd is not None)
        low = 3
        for fd in keep:  # only stdio, the status pipe and the template namespace remain: no way back
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 20)
        cfg = dict(cfg, template=fds.get("template"))
        held: list[tuple[int, int, str]] = []
        child.enter(cfg, sys.path, lambda: held.extend(confine.hold(prepared)))
        script = os.path.join(cfg["workdir"], "main.py")
        if not cfg["probe"]:
            with open(script, "wb") as f:  # tracebacks show its lines, as for any script
                f.write(code)
        os.environ.clear()
        os.environ.update(cfg["env"])
        child.set_limits(cfg)
        confine.apply(prepared, held, cfg["workdir"])  # last: Landlock, then seccomp
        child.set_file_limit(cfg)
        if cfg["probe"]:
            os.write(status, b"ok")
            os._exit(0)
        os.write(status, b"ok")
        os.close(status)  # the model's code never holds it
    except BaseException as e:  # noqa: BLE001 - whatever failed, the supervisor must hear of it
        try:
            os.write(status, f"{type(e).__name__}: {e}".encode(errors="replace")[:STATUS_LIMIT])
        finally:
            os._exit(child.SETUP_FAILED)
    run_program(code, script)


def run_program(code: bytes, script: str) -> NoReturn:  # pragma: no cover - runs in the run's process
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


def _finish(rc: int, atexit: Any) -> int:  # pragma: no cover - runs in the run's process
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
