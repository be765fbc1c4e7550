"""The engine imports and runs from slime's checkout layout, whatever sits beside the user's script.

slime's repository has a `tools/` folder at its root, where `train.py` runs; with the engine's tool
package at top level, that folder (with or without `__init__`) shadowed it. Here each layout is built
in a temporary directory with a script that imports `engine.slime` and calls real things, run in a
subprocess, once with the project as this interpreter has it (the README's editable install in CI)
and once from a plain install (`pip install --target`). A user's own package named `engine` truly
takes the name: `fsm_rollout_engine` (and the `fsm-rollout` script) then stops with one line naming it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import asyncio, sys, types
import engine.slime
from engine import tools
sample = types.SimpleNamespace(response="Answer: \\\\boxed{42}", label="42", metadata={})
score = asyncio.run(engine.slime.reward_func(None, sample))
print(engine.__file__)
print(score["score"], "code_interpreter" in tools.names(), engine.slime.log_rollout.__name__)
"""


def checkout(root: Path, *, tools_init: bool) -> Path:
    """slime's layout: `tools/` (a script folder, here with a `registry.py`) beside `train.py`."""
    root.mkdir(parents=True)
    (root / "tools").mkdir()
    (root / "tools" / "registry.py").write_text("raise SystemExit('slime checkout tools/registry.py was imported')\n")
    if tools_init:
        (root / "tools" / "__init__.py").write_text("")
    (root / "train.py").write_text(SCRIPT)
    return root


def run_script(where: Path, path_entries: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path_entries:
        env["PYTHONPATH"] = os.pathsep.join(path_entries)
    return subprocess.run([sys.executable, *args], cwd=where, env=env, capture_output=True, text=True, timeout=180)


def _as_tested() -> list[str]:
    """The project as the tests import it (PYTHONPATH when the checkout is not installed), and
    whatever else the caller's PYTHONPATH holds (slime's checkout, as slime users run)."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _engine_through(entries: list[str]) -> bool:
    """Whether a regular `engine` package is reached through these PYTHONPATH entries (not an install's finder)."""
    return any((Path(p) / "engine" / "__init__.py").is_file() for p in entries)


def slime_checkout(root: Path) -> Path:
    """THUDM/slime's top level as its checkout has it: packages `slime`, `slime_plugins`, `examples`;
    folders without `__init__` `tools/` (its scripts; here one probe) and `tests/`; `train.py`."""
    for package in ("slime", "slime_plugins", "examples"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    for folder in ("tools", "tests"):
        (root / folder).mkdir()
    (root / "tools" / "shadow_probe.py").write_text("OWNER = 'slime'\n")
    (root / "tests" / "test_cispo_loss.py").write_text("")
    (root / "train.py").write_text("")
    return root


WITH_SLIME = ["alone", "slime-on-pythonpath"]


@pytest.fixture(scope="module")
def plain_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain (non-editable) install of this checkout into a folder of its own."""
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not (target / "engine" / "__init__.py").is_file():
        # pip cannot build here without the network (an old setuptools, no `wheel`): lay out what a
        # wheel install puts on disk for Python to import, the packages and the module, by copying them.
        shutil.rmtree(target)
        shutil.copytree(ROOT / "engine", target / "engine", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(ROOT / "fsm_rollout_engine.py", target / "fsm_rollout_engine.py")
    return target


@pytest.mark.parametrize("tools_init", [False, True], ids=["tools-without-init", "tools-with-init"])
def test_slime_checkout_layout_with_the_project_as_installed(tmp_path: Path, tools_init: bool) -> None:
    root = checkout(tmp_path / "slime", tools_init=tools_init)
    done = run_script(root, _as_tested(), "train.py")
    assert done.returncode == 0, done.stderr
    where, result = done.stdout.strip().splitlines()[-2:]
    assert Path(where).resolve().parent == ROOT / "engine"
    assert result == "1.0 True log_rollout"


@pytest.mark.slow
@pytest.mark.parametrize("tools_init", [False, True], ids=["tools-without-init", "tools-with-init"])
def test_slime_checkout_layout_with_a_plain_install(tmp_path: Path, plain_install: Path, tools_init: bool) -> None:
    root = checkout(tmp_path / "slime", tools_init=tools_init)
    done = run_script(root, [str(plain_install)], "train.py")
    assert done.returncode == 0, done.stderr
    where, result = done.stdout.strip().splitlines()[-2:]
    assert Path(where).resolve().parent == (plain_install / "engine").resolve()
    assert result == "1.0 True log_rollout"
    unique = run_script(root, [str(plain_install)], "-c", "import fsm_rollout_engine as f; print(f.generate.__module__)")
    assert unique.returncode == 0 and unique.stdout.strip() == "engine.slime", unique.stderr


def _users_engine(root: Path, *, init: bool) -> Path:
    root.mkdir(parents=True)
    (root / "engine").mkdir()
    if init:
        (root / "engine" / "__init__.py").write_text("MINE = True\n")
    return root


@pytest.mark.parametrize("with_slime", WITH_SLIME)
@pytest.mark.parametrize("init", [True, False], ids=["package", "folder"])
def test_a_users_own_engine_package_stops_the_import_with_one_line_naming_it(tmp_path: Path, init: bool,
                                                                             with_slime: str) -> None:
    root = _users_engine(tmp_path / "work", init=init)
    entries = [str(slime_checkout(tmp_path / "slime"))] if with_slime != "alone" else []
    entries += _as_tested()
    done = run_script(root, entries, "-c", "import fsm_rollout_engine; print(fsm_rollout_engine.generate.__module__)")
    if not init and _engine_through(entries):
        # A folder without `__init__` is only a namespace portion: a regular package found later on
        # sys.path (here through PYTHONPATH) wins. Through an editable install's finder it does not.
        assert done.returncode == 0 and done.stdout.strip() == "engine.slime", done.stderr
        return
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"fsm_rollout_engine.EngineShadowed: fsm-rollout-engine: the name 'engine' is taken by "
                    f"{(root / 'engine').resolve()} (not this engine's {ROOT / 'engine'}); "
                    "rename that package or run from another directory")


def test_the_console_script_entry_point_says_so_too(tmp_path: Path) -> None:
    root = _users_engine(tmp_path / "work", init=True)
    code = "import sys; sys.argv = ['fsm-rollout', '--version']; import fsm_rollout_engine; fsm_rollout_engine.main()"
    done = run_script(root, [str(root), *_as_tested()], "-c", code)
    assert done.returncode == 1 and "the name 'engine' is taken by" in done.stderr.strip().splitlines()[-1]
    fine = run_script(tmp_path, _as_tested(), "-c", code)
    assert fine.returncode == 0 and fine.stdout.startswith("fsm-rollout "), fine.stderr


@pytest.mark.parametrize("slime_first", [True, False], ids=["slime-first", "project-first"])
def test_with_slimes_checkout_on_pythonpath_the_projects_tools_folder_shadows_nothing(tmp_path: Path,
                                                                                      slime_first: bool) -> None:
    """Run from this checkout (its `tools/` and `tests/` on sys.path) with slime's on PYTHONPATH, as a
    maintainer does: `engine` is this project's, slime's scripts under `tools.` are still slime's."""
    slime = str(slime_checkout(tmp_path / "slime"))
    entries = [slime, *_as_tested()] if slime_first else [*_as_tested(), slime]
    code = ("import importlib.util as u, engine.slime, tools.shadow_probe as c; "
            "print(engine.__file__); print(c.OWNER, u.find_spec('tools.shadow_probe').origin)")
    done = run_script(ROOT, entries, "-c", code)
    assert done.returncode == 0, done.stderr
    where, owner = done.stdout.strip().splitlines()[-2:]
    assert Path(where).resolve().parent == ROOT / "engine"
    assert owner == f"slime {Path(slime) / 'tools' / 'shadow_probe.py'}"
