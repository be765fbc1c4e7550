"""`python -m engine attacks`: hostile programs against the real code_interpreter sandbox.

Every attack is model-style code run by `tools.sandbox.runner.run_python` with the code
interpreter's limits, shortened (a few seconds of timeout, a small memory limit where memory
is the point). Whether it was contained is decided from what was observed - the errno the
program got, the host's process table, files and free disk space, the signals the engine
received - never from the configuration. The "how" column names the mechanism that the
observation points at, e.g. `network namespace: connect -> ENETUNREACH`.

The attacks live in `resources.py` (limits, processes, cleanup), `isolation.py` (files,
network, privileges, other processes) and `kernel.py` (memory across processes, shared
memory, SysV, keyrings, uid reuse after a crash, a venv under /tmp); this module holds
what they share (`Lab`, `attack`), the runner and the report. After each attack, no
process of a sandbox uid that attack's runs used may be alive: a survivor marks the attack
not contained whatever else was seen.

Attacks that could hurt the host when the sandbox is weaker than expected (signalling
other processes, filling a disk, forking) are bounded or first probe harmlessly (e.g.
`kill(pid, 0)`), so running the suite on a host without root is safe, only less contained.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import fcntl
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import attrs

from tools.code_interpreter import current_limits
from tools.sandbox import runner as sandbox
from tools.sandbox.runner import SandboxLimits, SandboxResult, run_python

PROJECT = Path(__file__).resolve().parents[3]  # the checkout (or site-packages) holding `tools`
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


def all_attacks() -> list[tuple[str, AttackFn]]:
    """Every registered attack (importing the two attack modules registers them)."""
    # Imported in this order so the report starts with the attacks of tests/tools/test_sandbox.py.
    from tools.sandbox.attacks import resources  # noqa: F401, I001  (registers on import)
    from tools.sandbox.attacks import isolation  # noqa: F401
    from tools.sandbox.attacks import kernel  # noqa: F401

    return list(ATTACKS)


def errname(code: int | None) -> str:
    return errno.errorcode.get(code or 0, str(code))


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


async def run_attack(lab: Lab, name: str, fn: AttackFn) -> Outcome:
    """One attack, its survivors check, and its time; a harness error is not containment."""
    lab.recent = set()
    t0 = time.monotonic()
    try:
        verdict = await fn(lab)
    except Exception as e:  # noqa: BLE001 - reported as a row, the other attacks still run
        verdict = Verdict(False, "not observed: the attack itself failed", f"{type(e).__name__}: {e}"[:120])
    left = {uid: pids for uid in sorted(lab.recent) if (pids := survivors(uid))}
    if left:
        where = ", ".join(f"uid {uid}: pids {pids[:5]}" for uid, pids in left.items())
        verdict = Verdict(False, "processes outlived the run", f"{where}; {verdict.evidence}")
    return Outcome(name, verdict.contained, verdict.how, verdict.evidence, round(time.monotonic() - t0, 2))


def default_lab() -> Lab:
    """A lab with the code interpreter's limits, the timeout shortened to `TIMEOUT_S`."""
    return Lab(attrs.evolve(current_limits(), timeout_s=TIMEOUT_S))


async def run_suite(names: list[str] | None = None, lab: Lab | None = None) -> list[Outcome]:
    """Run the attacks (all, or those named) one after another; returns one row each.

    Sequential, so a fork bomb or a disk fill never skews another attack's observations."""
    lab = lab or default_lab()
    chosen = [(n, fn) for n, fn in all_attacks() if names is None or n in names]
    return [await run_attack(lab, name, fn) for name, fn in chosen]


def describe_sandbox(lab: Lab) -> str:
    """One line on the layers in use: a uid per run if the runs reported one, and what the
    sandbox's probe found (namespaces, cgroup kind, zygote)."""
    caps = sandbox.capabilities()
    yes = {True: "yes", False: "no"}
    return (
        f"uid per run {yes[bool(lab.uids)]}, network namespace {yes[caps['netns']]}, "
        f"mount namespace {yes[caps['mntns']]}, IPC namespace {yes[caps['ipcns']]}, "
        f"memory and tasks per run: {'cgroup ' + caps['cgroup'] if caps['cgroup'] != 'rlimits' else 'rlimits'}, "
        f"zygote {yes[caps['zygote']]}"
    )


def render_table(outcomes: list[Outcome]) -> str:
    """A Markdown table (aligned, so it reads in a terminal and pastes into a README)."""
    rows = [("attack", "contained", "how", "evidence")]
    rows += [(o.attack, "yes" if o.contained else "NO", o.how, o.evidence) for o in outcomes]
    rows = [tuple(cell.replace("|", "\\|") for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]

    def line(row: tuple[str, ...]) -> str:
        return "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |"

    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows[1:])])


def exit_code(outcomes: list[Outcome]) -> int:
    """0 when every attack was contained, else 1."""
    return 0 if outcomes and all(o.contained for o in outcomes) else 1


def main_attacks(ns: argparse.Namespace) -> int:
    """`python -m engine attacks [--json]`: run every attack, print the table (or JSON)."""
    lab = default_lab()
    outcomes = asyncio.run(run_suite(lab=lab))
    contained = sum(o.contained for o in outcomes)
    if getattr(ns, "json", False):
        print(json.dumps({
            "sandbox": describe_sandbox(lab), "contained": contained, "total": len(outcomes),
            "attacks": [attrs.asdict(o) for o in outcomes],
        }, indent=2))
    else:
        print(f"sandbox: {describe_sandbox(lab)}")
        print(render_table(outcomes))
        print(f"{contained}/{len(outcomes)} attacks contained")
    return exit_code(outcomes)
