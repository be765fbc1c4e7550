"""docs/environments.md, run as written: its environment file and YAML, its MCP server and YAML."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import respx
import yaml

from engine import envs, slime
from engine.local.sample import Sample
from engine.tools import mcp_servers
from tests.conftest import run
from tests.support.helpers import SAMPLING, ScriptedServer, make_args, tok, turn

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"
MODEL_URL = "http://sglang.test:30000/generate"


def files_of_the_doc() -> dict[str, str]:
    """Every code block marked `<!-- file: NAME -->` or whose first line is `# <file name>`, by that name."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```(?:python|yaml)\n(.*?)```", text, re.DOTALL)
    files = {m.group(1): body for body in blocks if (m := re.match(r"# ([\w.]+\.(?:py|yaml))\n", body))}
    marked = re.findall(r"<!-- file: ([\w.-]+) -->\n```\w*\n(.*?)```", text, re.DOTALL)
    return {**dict(marked), **files}


@pytest.fixture
def doc_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    files = files_of_the_doc()
    for name, body in files.items():
        (tmp_path / name).write_text(body, encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # the YAML names `python weather_server.py`, relative to where the job runs
    monkeypatch.syspath_prepend(str(tmp_path))  # and the module `guess_env`
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    yield files
    envs.unregister_environment("guess_the_number")
    mcp_servers.unregister_servers()
    sys.modules.pop("guess_env", None)


def generate(config: str, script: list, sample: Sample) -> Sample:
    settings = yaml.safe_load(Path(config).read_text())

    async def go() -> None:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(MODEL_URL).mock(side_effect=ScriptedServer(script))
            args = make_args(**settings)
            await slime.generate(args, sample, dict(SAMPLING))
            sample.reward = await slime.reward_func(args, sample)

    run(go())
    return sample


def test_the_docs_environment_is_under_60_lines_and_runs_as_written(doc_files: dict[str, str]):
    assert len(doc_files["guess_env.py"].splitlines()) < 60
    assert yaml.safe_load(doc_files["guess.yaml"])["engine_tools"] == []  # the page's "offering no tools"
    metadata = {"environment": {"name": "guess_the_number", "args": {"secret": 7}}}
    sample = generate("guess.yaml", [turn("Is it 5?"), turn("Then 8."), turn("It must be 7.")],
                      Sample(prompt=[{"role": "user", "content": "Guess my number."}], metadata=metadata))
    fsm = sample.metadata["fsm"]
    assert (sample.status.name, fsm["termination_reason"]) == ("COMPLETED", "environment_done")
    assert fsm["environment"] == {"name": "guess_the_number", "reason": "guessed in 3 tries", "success": True}
    assert [t["reward"] for t in fsm["turn_rewards"]] == [-0.1, -0.1, 1.0]
    assert "Higher." in sample.response and "Lower." in sample.response
    assert sample.reward["score"] == pytest.approx(0.8) and sample.reward["acc"] is True
    prompt = tok().decode(sample.tokens[: len(sample.tokens) - sample.response_length])
    assert "<tools>" not in prompt  # no tool offered


@pytest.mark.slow
def test_the_docs_input_lines_run_through_run_with_their_replay(doc_files: dict[str, str], tmp_path: Path):
    """The page's `run` block as `run` reads it: the input's metadata picks each sample's environment."""
    from engine.cli import main

    code = main(["run", "--config", "guess.yaml", "--input", "guess.jsonl", "--replay", "guess-replay.jsonl",
                 "--output", "guess-out.jsonl", "--no-progress"])
    assert code == 0
    out = [json.loads(line) for line in Path("guess-out.jsonl").read_text().splitlines()]
    reasons = [s["metadata"]["fsm"]["termination_reason"] for s in out]
    assert reasons == ["environment_done", "environment_done", "answered"]
    assert [s["reward"]["score"] for s in out] == pytest.approx([0.8, 0.9, 1.0])


@pytest.mark.slow
def test_the_docs_mcp_setup_runs_as_written(doc_files: dict[str, str]):
    pytest.importorskip("mcp", reason="the MCP SDK is not installed")
    ask = "<tool_call>\n" + json.dumps({"name": "temperature", "arguments": {"city": "Paris"}}) + "\n</tool_call>"
    sample = generate("weather.yaml", [turn(ask), turn("It is 18 degrees in Paris.")],
                      Sample(prompt=[{"role": "user", "content": "How warm is Paris today?"}]))
    fsm = sample.metadata["fsm"]
    assert sample.status.name == "COMPLETED", fsm.get("engine_error")
    assert ["TOOL_CALL", "dispatch", "TOOL_TEMPERATURE"] in [list(e) for e in fsm["trace"]]
    assert "<tool_response>\n18\n</tool_response>" in sample.response
    assert "Today's temperature in a city" in tok().decode(sample.tokens[: len(sample.tokens) - sample.response_length])
