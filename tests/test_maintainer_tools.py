"""The top-level `tools/` folder: maintainers' scripts, run here, and never part of the wheel.

Each script is run as a maintainer runs it (`tools/regenerate.sh --check` on this tree and on a
copy with a stale drawing; `tools/attack_modes.sh --help`). The folder is not a package and
setuptools' discovery, as pyproject.toml configures it, leaves it out, so it cannot shadow the
`tools/` folder of slime's checkout (tests/test_shadowing.py runs that layout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def _run(script: Path, *args: str, cwd: Path = ROOT, pythonpath: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_folder_is_scripts_each_described_never_a_package() -> None:
    scripts = sorted(p.name for p in TOOLS.iterdir() if p.name != "README.md" and not p.name.startswith("."))
    assert scripts and not (TOOLS / "__init__.py").exists()
    readme = (TOOLS / "README.md").read_text(encoding="utf-8")
    for name in scripts:
        path = TOOLS / name
        assert f"`tools/{name}" in readme, f"tools/README.md does not describe {name}"
        assert os.access(path, os.X_OK) and path.read_text(encoding="utf-8").startswith("#!"), name


def test_the_wheel_leaves_the_folder_out() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "engine" in packages and "engine.machine" in packages
    assert not [p for p in packages if p.split(".")[0] in ("tools", "tests")]


def test_regenerate_checks_this_tree_and_mends_a_stale_copy(tmp_path: Path) -> None:
    done = _run(TOOLS / "regenerate.sh", "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    copy = tmp_path / "checkout"
    for part in ("engine", "tools", "diagrams", "docs"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "README.md", copy / "README.md")
    mmd = copy / "diagrams" / "machine.mmd"
    mmd.write_text(mmd.read_text(encoding="utf-8") + "%% stale\n", encoding="utf-8")
    stale = _run(copy / "tools" / "regenerate.sh", "--check", cwd=tmp_path, pythonpath=copy)
    assert stale.returncode == 1 and "machine.mmd" in stale.stdout + stale.stderr
    assert "%% stale" in mmd.read_text(encoding="utf-8")  # --check writes nothing
    assert _run(copy / "tools" / "regenerate.sh", cwd=tmp_path, pythonpath=copy).returncode == 0
    assert (mmd.read_bytes() == (ROOT / "diagrams" / "machine.mmd").read_bytes())
    assert _run(copy / "tools" / "regenerate.sh", "--check", cwd=tmp_path, pythonpath=copy).returncode == 0
    assert _run(copy / "tools" / "regenerate.sh", "--bogus", pythonpath=copy).returncode == 2


def test_attack_modes_runs_the_suites_own_runner() -> None:
    done = _run(TOOLS / "attack_modes.sh", "--help")
    assert done.returncode == 0, done.stderr
    assert "--mode {root,no-sys-admin,user}" in done.stdout and "--json" in done.stdout
