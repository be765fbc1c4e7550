"""The attack suite in the three modes an engine runs in, one column each.

`python -m engine.sandbox.attacks.modes [--json] [--report PATH] [--mode M ...]`, as root: runs
`python -m engine attacks --json` once per mode in a process of its own and prints one table
with a column per mode (exit 1 when an attack outside the mode's `EXPECTED_GAPS` got through):

* `root`: root with namespaces, as the engine runs here;
* `no-sys-admin`: root without CAP_SYS_ADMIN (what a default Docker or Kubernetes container
  gives), by `setpriv --bounding-set=-sys_admin`;
* `user`: an ordinary user (nobody), by `setpriv --reuid/--regid --clear-groups`. That user
  may not read the checkout (a clone under /root), so the `engine` package is copied to a
  world-readable directory under /tmp and run from there, with a venv of that user's own (as a
  cluster user has: the user owns its interpreter's site-packages) made from this interpreter,
  or, when that user cannot execute it (a pyenv install under a 0700 /root), from a system
  interpreter of the same version. The venv holds links to this install's numpy, sympy and
  mpmath, so sandboxed code imports them as it would as root; the engine's own dependencies
  come from this one's site-packages on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from engine.sandbox.attacks.lab import PROJECT

NOBODY = 65534
MODES = {
    "root": ("root with namespaces", []),
    "no-sys-admin": ("root without CAP_SYS_ADMIN", ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"]),
    "user": ("ordinary user", ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]),
}
# What no unprivileged mechanism holds (docs/sandbox-modes.md): expected to get through. A futex on
# a file page every run maps is keyed by the file: nothing short of separate machines holds it.
FUTEX = "a futex woken across runs through a shared file page"
EXPECTED_GAPS = {
    "root": {FUTEX},
    "no-sys-admin": {"fill the disk", "size and owner of a hidden file (stat)", FUTEX},
    "user": {"fill the disk", "size and owner of a hidden file (stat)", FUTEX, "page tables of a sparse address space"},
}
TIMEOUT_S = 600
SANDBOX_PACKAGES = ("numpy", "numpy.libs", "sympy", "mpmath")  # what the suite's code imports in the sandbox


def _can_run(prefix: list[str], python: str, env: dict[str, str]) -> bool:
    """Whether `python`, started as the zygote is (by its `sys.executable`), runs for that user."""
    check = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import attrs'], check=True)"
    try:
        return subprocess.run([*prefix, python, "-c", check], capture_output=True, timeout=60, env=env,
                              check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(paths[k] for k in ("purelib", "platlib") if os.path.isdir(paths[k])))


def _link_tree(source: Path, target: Path) -> None:
    """`target` as a copy of `source` whose files are hard links (a copy where links cannot go)."""
    try:
        shutil.copytree(source, target, copy_function=os.link, ignore=shutil.ignore_patterns("__pycache__"))
    except (OSError, shutil.Error):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))


def _user_venv(work: Path, python: str) -> Path:
    """A venv owned by the ordinary user, with this install's packages the suite imports in the sandbox."""
    venv = work / "venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120,
                   capture_output=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    for name in SANDBOX_PACKAGES:
        found = next((Path(d) / name for d in _site_dirs() if (Path(d) / name).is_dir()), None)
        if found is not None:
            _link_tree(found, site / name)
    # The user owns its venv's directories (not the linked files, which are this install's).
    for path in (venv, *venv.rglob("*")):
        if path.is_symlink() or path.is_dir() or path.stat().st_nlink == 1:
            os.lchown(path, NOBODY, NOBODY)
    return venv


def _user_setup(work: Path) -> tuple[list[str], dict[str, str]]:
    """A world-readable copy of the project and a venv of the ordinary user's own."""
    copy = work / "project"
    shutil.copytree(PROJECT / "engine", copy / "engine", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("README.md", "pyproject.toml"):
        if (PROJECT / name).is_file():
            shutil.copy(PROJECT / name, copy / name)
    for path in (work, *work.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    prefix = MODES["user"][1]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8",
           "PYTHONPATH": os.pathsep.join([str(copy), *_site_dirs()])}
    python = sys.executable
    if not _can_run(prefix, python, env):
        same = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}", path="/usr/local/bin:/usr/bin:/bin")
        if same is None or not _can_run(prefix, same, env):
            raise RuntimeError(f"user {NOBODY} can execute neither {sys.executable} nor a system python"
                               f"{sys.version_info[0]}.{sys.version_info[1]}")
        python = same
    venv = _user_venv(work, python)
    return [*prefix, str(venv / "bin" / "python")], env


def mode_command(mode: str, work: Path) -> tuple[list[str], dict[str, str], str]:
    """(argv up to and including the interpreter, environment, working directory) that run
    Python in `mode` (a key of `MODES`); `work` is a scratch directory for the user's copy."""
    if os.geteuid() != 0:
        raise RuntimeError("the three modes are started from root")
    if mode == "user":
        argv, env = _user_setup(work)
        return argv, env, str(work / "project")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH")}
    return [*MODES[mode][1], sys.executable], env, str(PROJECT)


def run_mode(mode: str) -> dict[str, Any]:
    """The suite's JSON report in `mode` (a key of `MODES`), from a process of its own."""
    with tempfile.TemporaryDirectory(prefix="fsm-attacks-") as tmp:
        argv, env, cwd = mode_command(mode, Path(tmp))
        done = subprocess.run([*argv, "-m", "engine", "attacks", "--json"], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S, check=False)
    try:
        report = json.loads(done.stdout[done.stdout.index("{"):])
    except ValueError as e:
        raise RuntimeError(f"the suite in mode {mode} printed no report (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[-600:]}") from e
    report["mode"] = mode
    return report


def render(reports: dict[str, dict[str, Any]]) -> str:
    """One Markdown table: an attack per row, a column per mode ("yes", or "NO: how")."""
    names = list(dict.fromkeys(a["attack"] for r in reports.values() for a in r["attacks"]))
    heads = ["attack", *(MODES[m][0] for m in reports)]
    rows = []
    for name in names:
        cells = [name]
        for r in reports.values():
            row = next((a for a in r["attacks"] if a["attack"] == name), None)
            cells.append("-" if row is None else "yes" if row["contained"] else f"NO: {row['how'][:60]}")
        rows.append(cells)
    rows.append(["contained", *(f"{r['contained']}/{r['total']}" for r in reports.values())])
    rows = [[c.replace("|", "\\|") for c in row] for row in [heads, *rows]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(heads))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def unexpected(reports: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Per mode, the attacks that got through without being an expected gap of that mode."""
    found = {m: [a["attack"] for a in r["attacks"] if not a["contained"] and a["attack"] not in EXPECTED_GAPS[m]]
             for m, r in reports.items()}
    return {m: bad for m, bad in found.items() if bad}


def main(argv: list[str] | None = None) -> int:
    """Run the suite in each mode, print the table (or JSON); 1 on an unexpected gap."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", action="append", choices=list(MODES), help="default: all three")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--report", metavar="PATH", help="also write the JSON report there (tests/sandbox/"
                        "test_attacks.py judges it instead of running the suite again: FSM_ATTACKS_REPORT)")
    ns = parser.parse_args(argv)
    try:
        reports = {m: run_mode(m) for m in ns.mode or list(MODES)}
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"attacks in three modes: {e}", file=sys.stderr)
        return 2
    bad = unexpected(reports)
    if ns.report:
        Path(ns.report).write_text(json.dumps({"reports": reports, "unexpected": bad}, indent=2))
    if ns.json:
        print(json.dumps({"reports": reports, "unexpected": bad}, indent=2))
    else:
        for m, r in reports.items():
            print(f"{MODES[m][0]}: {r['sandbox']}")
        print(render(reports))
        for m, names in bad.items():
            print(f"NOT CONTAINED in mode {m}: {', '.join(names)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
