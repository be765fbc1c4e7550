"""The engine's side of the zygote (`engine/sandbox/zygote.py`): start it, send it runs, hear back.

One zygote per engine process, started on first use and replaced every `RESTART_AFTER`
runs (its children share its hash seed and address layout). Requests go over a
SOCK_SEQPACKET socket pair, a run's stdio pipes and code memfd along with them as
SCM_RIGHTS; a reader thread takes the replies, so any event loop (or none) can wait for
a run, and a run's `on_done` (which frees its uid lease) happens even when the loop that
started it is gone.
"""

from __future__ import annotations

import array
import concurrent.futures
import itertools
import json
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ZYGOTE = str(Path(__file__).resolve().with_name("zygote.py"))
RESTART_AFTER = 4096  # runs per zygote
START_TIMEOUT_S = 60.0
# Modules most model code imports, loaded once in the zygote instead of once per call.
# numpy is worth it (its import costs a run real CPU time, a fork inherits it for free); sympy
# is not (a long start-up and a bigger process to fork for every call).
PRELOAD = ("json", "math", "re", "random", "collections", "itertools", "functools", "fractions", "decimal",
           "statistics", "datetime", "traceback", "linecache", "string", "heapq", "bisect", "numpy")


class ZygoteError(RuntimeError):
    """The zygote could not be started or died."""


Done = dict[str, Any]  # {"rc": int | None, "strays": bool, "error": str | None}


class ZygoteClient:
    """One running zygote: `submit` runs, `kill` them; thread-safe."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] | None = None) -> None:
        preload = PRELOAD if preload is None else preload
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - the zygote's stderr, kept for its life
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", ZYGOTE, json.dumps({"fd": theirs.fileno(), "preload": list(preload)})],
                env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                pass_fds=[theirs.fileno()], start_new_session=True,
            )
        finally:
            theirs.close()
        self.sock = ours
        # Room for thousands of queued requests, so a send never waits for a busy zygote
        # (it would block the engine's event loop); root may exceed the system's default cap.
        for option in (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF):
            try:
                if option is not None:
                    ours.setsockopt(socket.SOL_SOCKET, option, 8 << 20)
                    break
            except OSError:
                continue
        self.runs = 0
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[concurrent.futures.Future[Done], Callable[[Done], None] | None]] = {}
        self._dead: str | None = None
        self.info = self._await_ready()
        self._reader = threading.Thread(target=self._read, name="sandbox-zygote-reader", daemon=True)
        self._reader.start()

    def _await_ready(self) -> dict[str, Any]:
        self.sock.settimeout(START_TIMEOUT_S)
        try:
            data = self.sock.recv(1 << 16)
        except OSError as e:
            self.close()
            raise ZygoteError(f"the sandbox zygote did not start: {e}; {self._log_tail()}") from e
        finally:
            self.sock.settimeout(None)
        if not data:
            self.close()
            raise ZygoteError(f"the sandbox zygote exited at start-up: {self._log_tail()}")
        info = json.loads(data)
        if info.get("threads") != 1:
            self.close()
            raise ZygoteError(f"the sandbox zygote has {info.get('threads')} threads after preloading "
                              f"{info.get('preloaded')}: forking it would be unsafe")
        return info

    def _log_tail(self) -> str:
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").strip()
        return text.splitlines()[-1] if text else f"exit code {self.proc.returncode}"

    def submit(self, cfg: dict[str, Any], fds: list[int], on_done: Callable[[Done], None] | None = None
               ) -> tuple[int, concurrent.futures.Future[Done]]:
        """Send a run (its fds are duplicated into the zygote; the caller still closes its copies).
        `on_done` runs in the reader thread when the run and its cleanup are over."""
        run_id = next(self._ids)
        fut: concurrent.futures.Future[Done] = concurrent.futures.Future()
        with self._send_lock:
            if self._dead is not None:
                raise ZygoteError(self._dead)
            self._pending[run_id] = (fut, on_done)
            self.runs += 1
            try:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
                self.sock.sendmsg([json.dumps({"op": "run", "id": run_id, "cfg": cfg}).encode()], anc)
            except OSError as e:
                self._pending.pop(run_id, None)
                self._dead = f"the sandbox zygote is gone: {e}"  # the next call starts a new one
                raise ZygoteError(self._dead) from e
        return run_id, fut

    def kill(self, run_id: int) -> None:
        """SIGKILL the run's process group (the cleanup that follows kills the rest)."""
        with self._send_lock:
            if self._dead is None:
                try:
                    self.sock.send(json.dumps({"op": "kill", "id": run_id}).encode())
                except OSError:
                    pass  # gone: its runs die with it (PR_SET_PDEATHSIG)

    def pending(self) -> int:
        """Runs not finished yet."""
        return len(self._pending)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            with self._send_lock:
                fut, on_done = self._pending.pop(msg["id"], (None, None))
            self._deliver(fut, on_done, msg)
        with self._send_lock:
            self._dead = f"the sandbox zygote exited ({self._log_tail()})"
            left, self._pending = list(self._pending.values()), {}
        for fut, on_done in left:
            self._deliver(fut, on_done, {"rc": None, "strays": False, "error": self._dead})

    @staticmethod
    def _deliver(fut: concurrent.futures.Future[Done] | None, on_done: Callable[[Done], None] | None,
                 msg: Done) -> None:
        if on_done is not None:
            try:
                on_done(msg)
            except Exception:
                logging.getLogger(__name__).exception("sandbox run cleanup callback failed")
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def close(self) -> None:
        """Closing our end tells the zygote to kill its runs and exit."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    @property
    def dead(self) -> bool:
        """Whether the zygote has exited (or stopped taking runs)."""
        return self._dead is not None or self.proc.poll() is not None


_lock = threading.Lock()
_current: ZygoteClient | None = None


def zygote(env: dict[str, str]) -> ZygoteClient:
    """The process's zygote, started (blocking, so call it off the event loop) when there is
    none, it died, or it served `RESTART_AFTER` runs (the old one ends with its last run)."""
    global _current
    with _lock:
        if _current is None or _current.dead or _current.runs >= RESTART_AFTER:
            old, _current = _current, ZygoteClient(env)
            if old is not None:
                threading.Thread(target=_retire, args=(old,), daemon=True).start()
        return _current


def current() -> ZygoteClient | None:
    """The zygote if one is running and fresh (no start-up needed), else None."""
    z = _current
    return z if z is not None and not z.dead and z.runs < RESTART_AFTER else None


def _retire(old: ZygoteClient) -> None:
    while old.pending() and not old.dead:
        threading.Event().wait(0.5)
    old.close()


def shutdown() -> None:
    """Stop the zygote (tests; at exit the closed socket stops it anyway)."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
            _current = None
