"""A format added from outside the engine (`register_tool_parser`, `register_profile`) works everywhere:
slime's args, the YAML, the CLI, `diagram`; docs/formats.md's example is the module used here."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import respx

from engine import slime
from engine.local.sample import Sample
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, turn

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.support.plugins.shout_format"
CALL = 'Let me compute.\nCALL code_interpreter {"code": "print(6 * 7)"}'


def _engine(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "engine", *argv], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def _rollout(**settings: object) -> Sample:
    server = ScriptedServer([turn(CALL), turn("It printed 42.\nAnswer: \\boxed{42}")])
    sample = Sample(prompt="What is 6 * 7?", label="42")
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(make_args(engine_tool_modules=MODULE, **settings), sample, dict(SAMPLING)))
    return sample


def test_a_registered_tool_parser_is_named_in_slime_s_args() -> None:
    sample = _rollout(engine_profile="chat", engine_tool_parser="shout")
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.COMPLETED, fsm
    assert fsm["tool_stats"]["calls"] == 1 and list(fsm["turns"][0]["tools"]) == ["code_interpreter"]
    assert "42" in sample.response


def test_a_registered_profile_is_named_in_slime_s_args() -> None:
    sample = _rollout(engine_profile="shout-chat")
    assert sample.status == Sample.Status.COMPLETED and sample.metadata["fsm"]["profile"] == "shout-chat"
    assert sample.metadata["fsm"]["tool_stats"]["calls"] == 1


def test_an_unknown_parser_under_slime_fails_every_sample_with_one_log_line(caplog) -> None:
    slime._setup_errors.clear()
    with caplog.at_level(logging.ERROR, logger="engine.slime"):
        samples = [_rollout(engine_profile="chat", engine_tool_parser="no-such-format") for _ in range(2)]
    assert all(s.status == Sample.Status.FAILED for s in samples)
    assert {s.metadata["fsm"]["termination_reason"] for s in samples} == {"engine_setup_failed"}
    lines = [r.getMessage() for r in caplog.records if "no-such-format" in r.getMessage()]
    assert len(lines) == 1 and "known are" in lines[0] and "hermes" in lines[0]


def test_yaml_and_cli_name_the_module_the_profile_and_the_parser(tmp_path: Path) -> None:
    replay = tmp_path / "replay.jsonl"
    replay.write_text(json.dumps({"prompt": "What is 17 * 23?", "turns": [
        'Let me compute.\nCALL code_interpreter {"code": "print(17 * 23)"}', "It printed 391.\nAnswer: \\boxed{391}"]}) + "\n")
    config = tmp_path / "engine.yaml"
    config.write_text(f"engine_tool_modules: {MODULE}\nengine_profile: chat\n")
    got = _engine("run", "--no-progress", "--config", str(config), "--tool-parser", "shout", "--replay", str(replay),
                  "--limit", "1", "--output", str(tmp_path / "out.jsonl"), cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert row["status"] == "completed" and row["metadata"]["fsm"]["tool_stats"]["calls"] == 1
    assert row["reward"]["score"] == 1.0
    bad = _engine("run", "--no-progress", "--tool-module", MODULE, "--profile", "chat", "--tool-parser", "shuot",
                  "--output", str(tmp_path / "bad.jsonl"), cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--tool-parser: unknown tool parser 'shuot': known are" in bad.stderr and "shout" in bad.stderr


def test_diagram_imports_the_format_module_and_the_machine_is_unchanged(tmp_path: Path) -> None:
    got = _engine("diagram", "--tool-module", MODULE, "--check", "--out", str(ROOT / "diagrams"), cwd=tmp_path)
    assert got.returncode == 0, got.stderr  # a format adds no state: the shipped diagrams stay current


def test_the_docs_example_is_this_module() -> None:
    doc = (ROOT / "docs" / "formats.md").read_text()
    example = re.search(r"```python\n(.*?)```", doc, re.DOTALL)
    assert example is not None
    source = (ROOT / "tests" / "support" / "plugins" / "shout_format.py").read_text()
    assert example.group(1).strip() in source
