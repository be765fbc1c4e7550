"""A plugin's own settings (tests/support/plugins/stamp.py): declared beside the tool under its own
prefix, read from slime's args, from `run --config` and from `run`'s flags, checked as the engine's
own are, and handed to the tool's `setup`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import respx

import engine.logs
import engine.settings.core
from engine import slime, tools
from engine.cli import build_parser, load_run_plugins
from engine.local.sample import Sample
from engine.run import settings_args
from engine.settings import EngineConfig, SettingsError
from engine.settings.declare import declared_keys
from engine.settings.page import settings_page
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, turn

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "tests.support.plugins.stamp"


@pytest.fixture(autouse=True)
def stamp() -> object:
    """The plugin imported (its tool and settings registered) for the test, its tool unregistered after."""
    engine.logs.forget()
    engine.settings.core._from_args_cache.clear()
    import tests.support.plugins.stamp as module

    tools.register(module.Stamp(), replace=True)
    yield module
    tools.registry.unregister("stamp")


def test_from_slimes_args_a_plugins_settings_reach_its_setup_and_its_calls(stamp: object,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    call = "<tool_call>" + json.dumps({"name": "stamp", "arguments": {"document": "contract"}}) + "</tool_call>"
    server = ScriptedServer([turn(call), turn("Done.\nAnswer: \\boxed{1}")])
    sample = Sample(prompt="Stamp the contract.")
    args = make_args(engine_tool_modules=PLUGIN, engine_stamp_text="APPROVED", engine_stamp_repeat="2")
    with caplog.at_level(logging.WARNING), respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(args, sample, dict(SAMPLING)))
    assert sample.status == Sample.Status.COMPLETED, sample.metadata["fsm"]
    assert "<interpreter>\nAPPROVED APPROVED: contract\n</interpreter>" in sample.response
    assert not [r for r in caplog.records if "unknown" in r.getMessage()]  # a declared key is read, not warned about
    own = EngineConfig.from_args(args).plugin(stamp.StampSettings)  # type: ignore[attr-defined]
    assert (own.text, own.repeat) == ("APPROVED", 2)


def test_an_undeclared_key_under_a_plugins_prefix_is_warned_about_with_the_closest_key(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.settings"):
        EngineConfig.from_args(make_args(engine_tool_modules=PLUGIN, engine_stamp_txt="x", engine_stamp_text="y"))
    assert [r.getMessage() for r in caplog.records] == [
        "unknown engine setting engine_stamp_txt (ignored); did you mean engine_stamp_text?"]


def test_a_plugins_settings_are_checked_as_the_engines_are(stamp: object) -> None:
    settings_class = stamp.StampSettings  # type: ignore[attr-defined]
    with pytest.raises(SettingsError, match=r"^engine_stamp_repeat must be a whole number from 1 to 10, got 0$"):
        settings_class(repeat=0)
    with pytest.raises(SettingsError, match=r"^engine_stamp_repeat must be a whole number from 1 to 10, got 11$"):
        EngineConfig.from_args(make_args(engine_tool_modules=PLUGIN, engine_stamp_repeat=11))
    given = EngineConfig(plugin_settings=[settings_class(text="by hand")])  # a config built without slime
    assert given.plugin(settings_class).text == "by hand" and EngineConfig().plugin(settings_class) == settings_class()
    with pytest.raises(SettingsError, match=r"plugin_settings must hold instances of plugins' settings classes, got 'x'"):
        EngineConfig(plugin_settings=["x"])
    assert {"engine_stamp_text", "engine_stamp_repeat"} <= declared_keys()


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return str(path)


def test_from_run_config_and_its_flags_a_plugins_settings_are_read_the_flag_winning(stamp: object, tmp_path: Path) -> None:
    config = _yaml(tmp_path, f"engine_tool_modules: [{PLUGIN}]\nengine_stamp_text: from the file\nengine_stamp_repeat: 3\n")
    settings_class = stamp.StampSettings  # type: ignore[attr-defined]
    for argv, expected in ((["run", "--config", config], settings_class(text="from the file", repeat=3)),
                           (["run", "--config", config, "--stamp-text", "from the flag"],
                            settings_class(text="from the flag", repeat=3))):
        assert load_run_plugins(argv) is None
        cfg = EngineConfig.from_args(settings_args(build_parser().parse_args(argv)))
        assert cfg.plugin(settings_class) == expected


def _engine(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "engine", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


def test_run_offers_a_plugins_flags_once_its_module_is_named(tmp_path: Path) -> None:
    """A fresh process, as a user starts it: `--tool-module` brings the plugin's flags, with help and checks."""
    shown = _engine("run", "--tool-module", PLUGIN, "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "The stamp tool (a test plugin with settings of its own):" in text
    assert "--stamp-text TEXT what the tool stamps every document with [engine_stamp_text] (default: stamped)" in text
    refused = _engine("run", "--no-progress", "--tool-module", PLUGIN, "--stamp-repeat", "0",
                      "--output", str(tmp_path / "o.jsonl"), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "argument --stamp-repeat: must be a whole number from 1 to 10, got '0' (see python -m engine run --help)")
    unknown = _engine("run", "--no-progress", "--stamp-text", "x", cwd=tmp_path)  # no module named: no such flag
    assert unknown.returncode == 2 and "unrecognized arguments: --stamp-text x" in unknown.stderr
    bad = _yaml(tmp_path, f"engine_tool_modules: [{PLUGIN}]\nengine_stamp_repeat: 0\n")
    from_yaml = _engine("run", "--no-progress", "--config", bad, "--output", str(tmp_path / "o.jsonl"), cwd=tmp_path)
    assert from_yaml.returncode == 2 and from_yaml.stderr.strip() == (
        f"error: engine_stamp_repeat in {bad}: must be a whole number from 1 to 10, got 0")
    assert not list(tmp_path.glob("o.jsonl*"))  # refused before anything started


def test_the_settings_page_shows_a_plugins_table_when_asked(stamp: object) -> None:
    page = settings_page([PLUGIN])
    assert "## The stamp tool (a test plugin with settings of its own)" in page
    assert "| `engine_stamp_repeat` | a whole number from 1 to 10 | 1 | `--stamp-repeat` | how many stamps a document gets |" in page
    assert "engine_stamp" not in settings_page()  # the checked-in page holds the shipped plugins only
