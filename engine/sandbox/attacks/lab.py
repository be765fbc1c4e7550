"""The attack lab: what an attack program is made of, how it is run and how its verdict is judged.

Shared by the attack modules (`resources`, `isolation`, `kernel`), which register their attacks
with `@attack`, and by `suite`, which imports them and runs them all. The attack programs run
through the real sandbox and report facts (`PRELUDE`'s `report`); the verdicts are decided from
outside the sandbox (host process table, files, signals received).
"""

from __future__ import annotations

import fcntl
import json
import os
import sysconfig
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import attrs

from engine.sandbox import runner as sandbox
from engine.sandbox.runner import SandboxLimits, SandboxResult, run_python

PROJECT = Path(__file__).resolve().parents[3]  # the checkout (or site-packages) holding `engine`
TIMEOUT_S = 5.0  # per attack run, unless the attack needs another


class Verdict(NamedTuple):
    """What an attack function concludes from its observations."""

    contained: bool
    how: str  # the mechanism that stopped it, or why it was not stopped
    evidence: str  # the short observation behind the verdict


@attrs.frozen
class Outcome:
    """One row of the report."""

    attack: str
    contained: bool
    how: str
    evidence: str
    seconds: float


class Run(NamedTuple):
    """A sandbox run and the facts its program reported (see `PRELUDE`)."""

    result: SandboxResult
    facts: dict[str, Any]
    limits: SandboxLimits


# Put in front of every attack program: `report(**facts)` prints one flushed JSON line the
# parent parses, so facts reported before a kill or an output cut still arrive; `err(e)`,
# `attempt(fn, *args)` and `libc(name, *args)` turn a failure into its errno name.
PRELUDE = '''\
import ctypes as _ctypes, errno as _errno, json as _json, os as _os, sys as _sys

def report(**facts):
    _sys.stdout.write("@@" + _json.dumps(facts) + "\\n")
    _sys.stdout.flush()

def err(e):
    return _errno.errorcode.get(getattr(e, "errno", None) or 0, type(e).__name__)

def attempt(fn, *args):
    try:
        fn(*args)
        return "ok"
    except OSError as e:
        return err(e)

def libc(name, *args):
    fn = getattr(_ctypes.CDLL(None, use_errno=True), name)
    return "ok" if fn(*args) == 0 else _errno.errorcode.get(_ctypes.get_errno(), "?")

report(uid=_os.getuid(), pid=_os.getpid())
'''


def facts_of(stdout: str) -> dict[str, Any]:
    """The merged `report(...)` lines of a run's stdout."""
    facts: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith("@@"):
            try:
                facts.update(json.loads(line[2:]))
            except ValueError:
                pass  # a line the output cap cut in half
    return facts


@attrs.define
class Lab:
    """What attacks share: the limits, the engine's identity, the sandbox uids seen."""

    base: SandboxLimits
    engine_pid: int = attrs.field(factory=os.getpid)
    uids: set[int] = attrs.field(factory=set)  # every sandbox uid any run reported
    recent: set[int] = attrs.field(factory=set)  # the current attack's

    async def run(self, code: str, *, stdin: bytes | None = None, **limits: Any) -> Run:
        """Run `PRELUDE + code` in the sandbox with `base` limits changed by `limits`."""
        chosen = attrs.evolve(self.base, **limits)
        result = await run_python(PRELUDE + code, chosen, stdin=stdin)
        facts = facts_of(result.stdout)
        if isinstance(facts.get("uid"), int) and facts["uid"] != os.getuid():
            self.uids.add(facts["uid"])
            self.recent.add(facts["uid"])
        return Run(result, facts, chosen)


AttackFn = Callable[[Lab], Awaitable[Verdict]]
ATTACKS: list[tuple[str, AttackFn]] = []


def attack(name: str) -> Callable[[AttackFn], AttackFn]:
    """Register an attack under `name`; the report lists them in registration order."""

    def register(fn: AttackFn) -> AttackFn:
        ATTACKS.append((name, fn))
        return fn

    return register


def site_file(stem: str) -> str:
    """A new one-byte file of the engine's own user where a run may read it (its interpreter's
    site-packages, which an ordinary user owns): only the sandbox stands between the run and it.
    Raises OSError where the engine's user may not write there (`SITE` names the place)."""
    path = os.path.join(SITE, f"{stem}-{uuid.uuid4().hex[:8]}.txt")
    with open(path, "w") as f:
        f.write("x")
    os.chmod(path, 0o644)
    return path


SITE = sysconfig.get_paths()["purelib"]


def alive(pid: int) -> bool:
    """Whether `pid` is a live (non-zombie) process on the host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def processes(uid: int | None = None, comm_prefix: str | None = None) -> list[int]:
    """Live host processes of `uid` and/or whose name (comm) starts with `comm_prefix`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue  # gone meanwhile
        if fields.get("State", "Z").split()[0] == "Z":
            continue
        if uid is not None and int(fields["Uid"].split()[0]) != uid:
            continue
        if comm_prefix is not None and not fields.get("Name", "").strip().startswith(comm_prefix):
            continue
        found.append(int(name))
    return found


# Prepended to an attack's code: the run names itself `tag`, so the host finds it (`processes`).
NAMED = "import ctypes, os\nlibc('prctl', 15, b'{tag}', 0, 0, 0)  # PR_SET_NAME: how the engine finds it\n"


def status_field(pid: int, field: str) -> str:
    """One field of the host's /proc/<pid>/status ("SigQ", "Name", ...)."""
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith(field + ":"))


def survivors(uid: int) -> list[int]:
    """Live processes of sandbox `uid`, counted while holding its lease lock when possible,
    so a later run of another engine that leased the same uid is not mistaken for ours."""
    lock = os.path.join(sandbox.LOCK_DIR, str(uid))
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return processes(uid)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # busy for long: count anyway
                time.sleep(0.05)
        return processes(uid)
    finally:
        os.close(fd)  # drops the lock, if we got it
