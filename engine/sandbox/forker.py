"""The forker: the process every run forks from, and its parent; and what a run does to become one.

The zygote (`zygote.py`) keeps the records of every run. Runs never fork from it: at start-up,
before any request, it forks the forker, which never receives a run's settings. Per call the
zygote writes the run's settings and descriptors into one end of a fresh socket pair, and hands
the forker only the other end, a counter and four flags (which Landlock rights and BPF program,
built once per kind here). The forker forks the run, which reads its own settings from that
socket (`become_run`); the forker tells the zygote the run's pid, kills its process group when
the zygote asks (the forker is its parent, so it signals a pid it has not reaped yet, never a
recycled one), and reports its exit status. It knows its children's pids and nothing else.
A fork that fails (EAGAIN: an ordinary user's runs hold every process RLIMIT_NPROC allows that
user) is tried again every `RETRY_S` until it succeeds or the zygote cancels the run (its
timeout): the run waits for room as for a busy CPU, and the forker stays, with every other run.

It is a child subreaper: whatever a run leaves (a daemon that double-forked) is reparented to
it and reaped at once. When the zygote dies, its end of the socket closes, and the forker kills
every process beneath it (all that is left of every run) and removes the runs' work dirs on the
host (named after the zygote's pid), so no run outlives its supervisor; each run in turn dies with
the forker (PR_SET_PDEATHSIG), and the zygote cleans up after every run should the forker die.

The run's setup reports on a pipe the zygote holds and the model's code never does: "ok" just
before the first instruction of that code, or the error that stopped it. Only that, seen by the
zygote, can make the engine say the sandbox is broken; what the code prints, writes or exits
with is its result, whatever it looks like.

Standard library only; loaded by path in the zygote, like `child.py` and `confine.py`.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys
import time
import types
from typing import Any, NoReturn

if __package__:  # imported as engine.sandbox.forker (tests, the engine)
    from engine.sandbox import child, confine
else:  # loaded by path in the zygote
    import child  # type: ignore[no-redef]
    import confine  # type: ignore[no-redef]

PR_SET_CHILD_SUBREAPER = 36
MAX_FDS = 8
STATUS_LIMIT = 4096  # bytes of a setup error kept
WORKDIR_PREFIX = "sandbox-"  # a run's work dir on the host: /tmp/sandbox-<zygote pid>-<random>
KILL_ALL_S = 10.0  # the most the forker spends killing what is left once the zygote is gone
RETRY_S = 0.02  # between tries of a fork that failed


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


class Forker:
    """The forker's loop: fork runs, kill them on request, reap them (and their orphans), report."""

    def __init__(self, sock: socket.socket, layers: dict[str, Any]) -> None:
        self.sock = sock
        self.layers = layers
        self.prepared: dict[tuple[bool, ...], dict[str, Any]] = {}
        self.runs: set[int] = set()  # pids of runs not reaped yet
        self.waiting: dict[int, tuple[dict[str, Any], int]] = {}  # run id -> (its request, its socket): not forked yet
        self.zygote = os.getppid()

    def serve(self) -> NoReturn:  # pragma: no cover - its own process
        child.libc().prctl(PR_SET_CHILD_SUBREAPER, 1, "prctl(PR_SET_CHILD_SUBREAPER)")
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wakeup fd is written
        poll = select.poll()
        poll.register(self.sock, select.POLLIN)
        poll.register(wake_r, select.POLLIN)
        while True:
            try:
                ready = [fd for fd, _ in poll.poll(int(RETRY_S * 1000) if self.waiting else None)]
            except InterruptedError:
                continue
            for msg, end in list(self.waiting.values()):
                self.fork_run(msg, end)
            if wake_r in ready:
                self.reap(wake_r)
            if self.sock.fileno() in ready and not self.on_request():
                self.kill_everything()
                os._exit(0)

    def on_request(self) -> bool:
        try:
            data, fds = recv_fds(self.sock, 4096)
        except InterruptedError:
            return True
        except OSError:
            data, fds = b"", []
        if not data:
            return False  # the zygote is gone
        msg = json.loads(data)
        if msg["op"] == "run":
            self.fork_run(msg, fds[0])
        elif msg["op"] == "cancel" and msg["id"] in self.waiting:  # killed before it could be forked
            os.close(self.waiting.pop(msg["id"])[1])
            self.tell({"event": "cancelled", "id": msg["id"]})
        elif msg["op"] == "kill" and msg["pid"] in self.runs:  # not reaped yet: the pid is still the run's
            try:
                os.killpg(msg["pid"], signal.SIGKILL)
            except OSError:
                pass
        return True

    def fork_run(self, msg: dict[str, Any], end: int) -> None:
        kind = tuple(msg["kind"])
        if kind not in self.prepared:  # the BPF program and the Landlock rights: once per kind
            landlock, seccomp, mntns, own_uid = kind
            self.prepared[kind] = confine.prepare({"landlock": landlock, "seccomp": seccomp, "mntns": mntns,
                                                   "uid": 0 if own_uid else None}, self.layers)
        try:
            pid = os.fork()
        except OSError:  # no room for a process now: tried again on the next turn of the loop
            self.waiting[msg["id"]] = (msg, end)
            return
        if pid == 0:  # pragma: no cover - the run
            become_run(end, self.prepared[kind])
        self.waiting.pop(msg["id"], None)
        os.close(end)
        self.runs.add(pid)
        self.tell({"event": "started", "id": msg["id"], "pid": pid})

    def tell(self, message: dict[str, Any]) -> None:
        try:
            self.sock.send(json.dumps(message).encode())
        except OSError:
            pass  # the zygote is gone: the next read says so

    def reap(self, wake: int) -> None:
        """Reap every exited child: a run's exit is reported, an orphan of one is just gone."""
        for pid, rc in child.reaped(wake):
            if pid in self.runs:
                self.runs.discard(pid)
                self.tell({"event": "exited", "pid": pid, "rc": rc})

    def kill_everything(self) -> None:  # pragma: no cover - its own process
        """The zygote is gone: SIGKILL every process beneath us (as a subreaper every orphan of a run
        comes back to us) until none is left, then remove the runs' work dirs on the host."""
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        deadline = time.monotonic() + KILL_ALL_S
        while time.monotonic() < deadline:
            children = set(_children()) | self.runs  # the runs themselves even without /proc's children lists
            if not children:
                break
            for pid in children:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            try:
                while (pid := os.waitpid(-1, os.WNOHANG)[0]) != 0:
                    self.runs.discard(pid)
            except ChildProcessError:
                break
            time.sleep(0.005)
        stem = f"{WORKDIR_PREFIX}{self.zygote}-"
        try:
            names = [n for n in os.listdir("/tmp") if n.startswith(stem)]
        except OSError:
            names = []
        alive = bool(set(_children()) | self.runs)  # none: the trees are finite, removed whole
        for name in names:
            child.remove_tree(os.path.join("/tmp", name), 60.0 if alive else None)


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


def become_run(end: int, prepared: dict[str, Any]) -> NoReturn:  # pragma: no cover - the run's process
    """Turn this forked process into the run: its settings and descriptors from `end`, stdio, the
    sandbox (`child.enter`), its limits, Landlock and seccomp last, "ok" on its status pipe, then the
    model's code. A failure is written to the status pipe (never to the run's own output) and exits
    `child.SETUP_FAILED`; one before the pipe arrived kills the run silently (the zygote says so)."""
    signal.set_wakeup_fd(-1)  # else a signal would write into whatever file gets its number
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        sock = socket.socket(fileno=end)
        data, got = recv_fds(sock)
        sock.close()
        cfg = json.loads(data)["cfg"]
        fds = dict(zip(cfg["fds"], got))
        status = fds["status"]
    except BaseException:  # noqa: BLE001 - nothing to report on: the zygote sees the exit
        os._exit(child.SETUP_FAILED)
    try:
        for name, target in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
            os.dup2(fds[name], target)
        with os.fdopen(fds["code"], "rb") as f:
            code = f.read()
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
    except BaseException as e:  # noqa: BLE001 - whatever failed, the zygote must hear of it
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
