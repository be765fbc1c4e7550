"""Secrets stay out of the context: a fake key given to MCP servers by name (a stdio server's env,
an HTTP server's header) reaches the server, and appears in no sample, log line or dump, also
when the server crashes, refuses or cannot start."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import respx
import yaml

pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'fsm-rollout-engine[mcp]')")

from engine import slime  # noqa: E402
from engine.local.sample import Sample  # noqa: E402
from engine.tools import mcp_servers  # noqa: E402
from tests.conftest import run  # noqa: E402
from tests.support.helpers import SAMPLING, ScriptedServer, make_args, turn  # noqa: E402
from tests.support.mcp_http import http_mcp_server  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVER_PY = ROOT / "tests" / "support" / "mcp_server.py"
SECRET = "sk-fake-0123456789abcdef"  # what a leak would show
MODEL_URL = "http://sglang.test:30000/generate"


@pytest.fixture(autouse=True)
def forget_servers() -> Any:
    yield
    mcp_servers.unregister_servers()


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_a_key_passed_in_env_reaches_the_server_and_no_sample_log_or_output_of_run(tmp_path: Path) -> None:
    prompts = {"Measure the key.": [call("key_length"), "Done."],
               "Fail politely.": [call("fail", reason="nope"), "Done."],
               "Crash the server.": [call("crash"), "Never asked."]}  # last: one sample at a time
    (tmp_path / "replay.jsonl").write_text("".join(json.dumps({"prompt": p, "turns": t}) + "\n" for p, t in prompts.items()))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "engine_profile": "chat",
        "engine_mcp_servers": [{"name": "vault", "command": [sys.executable, str(SERVER_PY)], "env": {"API_KEY": "${FSM_TEST_KEY}"}}],
    }))
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "engine", "run", "--config", str(tmp_path / "job.yaml"), "--replay", str(tmp_path / "replay.jsonl"),
         "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--no-progress", "--concurrency", "1", "-v"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, "FSM_TEST_KEY": SECRET})
    rows = {json.loads(line)["prompt"]: json.loads(line) for line in out.read_text().splitlines()}
    assert len(rows) == 3, done.stdout + done.stderr
    measured = rows["Measure the key."]
    assert f"<tool_response>\n{len(SECRET)}\n</tool_response>" in measured["response"]  # the server got it
    crashed = rows["Crash the server."]["metadata"]["fsm"]
    assert crashed["termination_reason"] == "tool_unavailable"
    assert crashed["engine_error"] == "tool crash cannot work: MCP server 'vault' exited with status 3"
    assert "cannot do that: nope" in rows["Fail politely."]["response"]
    assert "INFO" in done.stderr  # -v: the log at INFO was written, and read here
    for what, text in (("samples", out.read_text()), ("stdout", done.stdout), ("stderr", done.stderr)):
        assert SECRET not in text, what
        assert str(SERVER_PY) not in text, what  # nor the server's command line


def test_a_header_from_the_jobs_environment_opens_an_http_server_and_is_never_shown(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FSM_TEST_TOKEN", SECRET)
    with http_mcp_server("--prefix", "s_", "--token-env", "FSM_TEST_TOKEN") as url:
        entry = {"name": "search", "url": url, "headers": {"Authorization": "Bearer ${FSM_TEST_TOKEN}"}}
        sample = Sample(prompt=[{"role": "user", "content": "Add."}])
        script = [turn(call("s_add", a=2, b=2)), turn(call("s_fail", reason="refused")), turn("4.")]
        with caplog.at_level(logging.DEBUG):
            run(_generate(make_args(engine_profile="chat", engine_mcp_servers=[entry]), sample, script))
        fsm = sample.metadata["fsm"]
        assert sample.status.name == "COMPLETED", fsm
        assert "<tool_response>\n4\n</tool_response>" in sample.response
        assert "cannot do that: refused" in sample.response
        # without the header the server refuses: a setup error that names the server, not the token
        mcp_servers.unregister_servers()
        refused = Sample(prompt=[{"role": "user", "content": "Add."}])
        with caplog.at_level(logging.DEBUG):
            run(_generate(make_args(engine_profile="chat", engine_mcp_servers=[{"name": "search", "url": url}]), refused, []))
        assert refused.metadata["fsm"]["termination_reason"] == "engine_setup_failed"
        assert "MCP server 'search' could not start" in refused.metadata["fsm"]["engine_error"]
    for dumped in (json.dumps(sample.to_dict()), json.dumps(refused.to_dict()), caplog.text):
        assert SECRET not in dumped


def test_a_variable_the_job_does_not_set_is_named_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSM_TEST_UNSET", raising=False)
    sample = Sample(prompt=[{"role": "user", "content": "Hi."}])
    entry = {"name": "vault", "command": [sys.executable, str(SERVER_PY)], "env": ["FSM_TEST_UNSET"]}
    run(_generate(make_args(engine_profile="chat", engine_mcp_servers=[entry]), sample, []))
    fsm = sample.metadata["fsm"]
    assert fsm["termination_reason"] == "engine_setup_failed"
    assert "MCP server 'vault': its env or headers name FSM_TEST_UNSET, which the job's environment does not set" in fsm["engine_error"]


async def _generate(args: Any, sample: Sample, script: list) -> None:
    with respx.mock(assert_all_called=False) as mock:
        mock.post(MODEL_URL).mock(side_effect=ScriptedServer(script))
        await slime.generate(args, sample, dict(SAMPLING))
