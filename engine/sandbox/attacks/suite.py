"""`python -m engine attacks`: hostile programs against the real code_interpreter sandbox.

Every attack is model-style code run by `engine.sandbox.runner.run_python` with the code
interpreter's limits, shortened (a few seconds of timeout, a small memory limit where memory
is the point). Whether it was contained is decided from what was observed - the errno the
program got, the host's process table, files and free disk space, the signals the engine
received - never from the configuration. The "how" column names the mechanism that the
observation points at, e.g. `network namespace: connect -> ENETUNREACH`.

The attacks live in `resources.py` (limits, processes, cleanup), `isolation.py` (files,
network, privileges, other processes), `kernel.py` (memory across processes, shared
memory, SysV, keyrings, uid reuse after a crash, a venv under /tmp), `layers.py` (what only
Landlock and seccomp hold without privileges, and that ordinary code still runs), `escapes.py`
(forged reports, files and queues that outlive a call, metadata through a descriptor, kernel
buffers), `leaks.py` (what a run could learn of the host or signal to another run) and `admitted.py`
(calls the allowlist admits with arguments it did not think of, and what the kernel shares beneath
every run: ioctl, a descriptor's signal owner, futexes, page tables, core dumps, scheduling, stdin) and `outside.py`
(the host's hugetlb pool, queued signals per user, a concurrent run's memory, the run's own /proc, a
work dir left full of litter); this module holds
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
import json
import time

import attrs

from engine.sandbox import runner as sandbox
from engine.sandbox.attacks.lab import ATTACKS, TIMEOUT_S, AttackFn, Lab, Outcome, Verdict, survivors


def all_attacks() -> list[tuple[str, AttackFn]]:
    """Every registered attack (importing the two attack modules registers them)."""
    # Imported in this order so the report starts with the attacks of tests/sandbox/test_sandbox.py.
    from engine.sandbox.attacks import resources  # noqa: F401, I001  (registers on import)
    from engine.sandbox.attacks import isolation  # noqa: F401
    from engine.sandbox.attacks import kernel  # noqa: F401
    from engine.sandbox.attacks import layers  # noqa: F401  (what Landlock and seccomp hold)
    from engine.sandbox.attacks import escapes  # noqa: F401  (found from outside the suite)
    from engine.sandbox.attacks import leaks  # noqa: F401
    from engine.sandbox.attacks import admitted  # noqa: F401  (what the allowlist admits, what the kernel shares)
    from engine.sandbox.attacks import outside  # noqa: F401  (what no cgroup or uid divides, a concurrent run)

    return list(ATTACKS)


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
    """A lab with the sandbox's default limits (the code interpreter's), the timeout shortened to `TIMEOUT_S`."""
    return Lab(sandbox.SandboxLimits(timeout_s=TIMEOUT_S))


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
        f"zygote {yes[caps['zygote']]}, Landlock ABI {caps['landlock'] or 'none'}, seccomp {yes[caps['seccomp']]}"
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
