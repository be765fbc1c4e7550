"""What a new user tripped on in `run`, each as they met it (a subprocess of the real command):
a tool parser that does not match the model's format, the sandbox mode never said, a run
stopped by SIGTERM (Slurm, Kubernetes, `timeout`) leaving only OUTPUT.partial.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from engine.local.demos import demo_file
from engine.trace.summary import warnings

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_answers_in_another_format_than_the_parser_reads_are_warned_and_the_sandbox_mode_said(tmp_path: Path) -> None:
    """A GLM model's calls under the hermes parser: every call reads as an answer, no tool runs."""
    done = subprocess.run([sys.executable, "-m", "engine", "run", "--no-progress", "--limit", "8", "--profile", "chat",
                           "--tool-parser", "hermes", "--replay", demo_file("replay-chat-glm47.jsonl")],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr, done.stderr
    warned = [line for line in done.stdout.splitlines() if line.startswith("warning:") and "glm47 tool call" in line]
    assert len(warned) == 1, done.stdout
    assert "which the configured tool parser does not read" in warned[0] and "--tool-parser glm47" in warned[0]
    said = [line for line in done.stderr.splitlines() if line.startswith("sandbox: ")]
    assert len(said) == 1 and "(docs/sandbox-modes.md)" in said[0], done.stderr
    from engine.sandbox import probe_sync

    assert said[0].startswith(f"sandbox: {probe_sync().isolation['mode']}, with ")


def test_a_stray_answer_in_another_format_is_not_a_warning() -> None:
    summary = {"samples": 20, "foreign_format_answers": Counter({"glm47": 4}), "tool_calls": {"sum": 0},
               "tool_errors": Counter(), "per_tool": Counter()}
    assert warnings(summary) == []
    summary["foreign_format_answers"] = Counter({"glm47": 5})
    assert len(warnings(summary)) == 1


def test_sigterm_keeps_what_finished_writes_the_output_and_exits_143(tmp_path: Path) -> None:
    out = tmp_path / "samples.jsonl"
    partial = tmp_path / "samples.jsonl.partial"
    run = subprocess.Popen([sys.executable, "-m", "engine", "run", "--no-progress", "--n-samples-per-prompt", "16",
                            "--concurrency", "4", "--output", str(out)], cwd=tmp_path, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and run.poll() is None:
            if partial.exists() and partial.read_text(encoding="utf-8").count("\n") >= 2:
                break
            time.sleep(0.2)
        assert run.poll() is None, "the run ended before it could be stopped: " + run.communicate()[1][-2000:]
        run.send_signal(signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "terminated (SIGTERM): keeping the samples that finished" in stderr
    assert not partial.exists()
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert 2 <= len(rows) < 320  # what finished, not the whole batch
    assert [r["index"] for r in rows] == sorted(r["index"] for r in rows)
    assert f"wrote {len(rows)} sample(s) to {out} (terminated by SIGTERM: the rest were not run)" in stdout


def test_agent_runs_the_engine_agent_its_config_names_not_the_demo_s(tmp_path: Path) -> None:
    """`agent --config agent.yaml` with `engine_agent` set: that agent runs (it was the demo's, silently)."""
    (tmp_path / "agent.yaml").write_text('engine_profile: chat\nengine_agent: "my_agents:solve"\n', encoding="utf-8")
    (tmp_path / "my_agents.py").write_text(
        "import openai\n\n\n"
        "async def solve(base_url, api_key, sample):\n"
        "    client = openai.AsyncOpenAI(base_url=base_url + '/v1', api_key=api_key)\n"
        "    await client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': sample.prompt}])\n"
        "    await client.close()\n"
        "    return {'score': 0.5, 'by': 'my_agents'}\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "engine", "agent", "--config", "agent.yaml", "--limit", "1",
                           "--no-progress", "--output", "out.jsonl"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    sample = json.loads((tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()[0])
    fsm = sample["metadata"]["fsm"]
    assert fsm["agent"]["result"] == {"score": 0.5, "by": "my_agents"}, fsm["agent"]
    assert len(fsm["turns"]) == 1  # the one call solve makes; the demo's agent would have made several


def test_the_demo_agent_without_the_openai_sdk_is_one_line(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """`pip install -e '.[local]'` (the README's first line) has no openai SDK: `agent` said each sample crashed."""
    import importlib.util

    from engine.cli import build_parser
    from engine.run import EXIT_FAILED, main_agent

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openai" else found(name, *a))
    ns = build_parser("python -m engine").parse_args(["agent", "--no-progress", "--output", str(tmp_path / "o.jsonl")])
    assert main_agent(ns) == EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "openai SDK" in err[0] and "pip install -e '.[agent]'" in err[0]
    assert not (tmp_path / "o.jsonl").exists()


def test_prompts_the_replay_does_not_know_are_warned_about(tmp_path: Path) -> None:
    """One's own prompts on the embedded server without a replay of them: the tiny model's noise looked
    like a broken harness; one line says why and what teaches it."""
    (tmp_path / "mine.jsonl").write_text(json.dumps({"prompt": "Name three rivers of Peru."}) + "\n"
                                         + json.dumps({"prompt": "What is 17 * 23?"}) + "\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "engine", "run", "--no-progress", "--input", "mine.jsonl",
                           "--max-new-tokens", "4", "--tools", "", "--output", "out.jsonl"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    warned = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1, done.stderr
    assert warned[0].startswith("warning: 1 of 2 prompts hold no prompt of the replay script replay.jsonl")
    assert "--replay FILE" in warned[0]
    demo = subprocess.run([sys.executable, "-m", "engine", "run", "--no-progress", "--limit", "2", "--tools", "",
                           "--max-new-tokens", "4", "--output", "demo.jsonl"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert "replay script" not in demo.stderr, demo.stderr


def test_an_agent_that_cannot_start_is_one_line_before_any_sample(tmp_path: Path) -> None:
    """A module that is not there, a function it lacks, a program not installed: each sample crashed alike."""
    (tmp_path / "agents_here.py").write_text("async def solve(base_url, api_key, sample):\n    return 1\n", encoding="utf-8")
    for agent, said in (("no_such_agents:solve", "no_such_agents:solve: ModuleNotFoundError: No module named 'no_such_agents'"),
                        ("agents_here:solv", "agents_here:solv: AttributeError:"),
                        ("no-such-harness --task {prompt}", "no-such-harness: no such program")):
        done = subprocess.run([sys.executable, "-m", "engine", "agent", "--agent", agent, "--limit", "1", "--no-progress",
                               "--output", "out.jsonl"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip().splitlines() == [done.stderr.strip()] and said in done.stderr, done.stderr
        assert done.stderr.startswith("error: --agent: ") and not (tmp_path / "out.jsonl").exists()
