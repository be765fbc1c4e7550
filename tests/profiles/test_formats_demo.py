"""`python -m engine run --profile chat --tool-parser NAME`: the demo in each family's format, end to end.

The embedded server replays the demo's turns written in that family's format; each sample must
end with the tool called and its answer rewarded. A run whose replies are in another format than
configured reads them as answers, and its summary counts them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.local.demos import demo_file

ROOT = Path(__file__).resolve().parents[2]
# Seven of the eleven the demo ships (every one passes; seven keep CI short): one per parser module
# and then some. The others: glm45, mistral, pythonic, deepseekv3.
FAMILIES = ["qwen3_coder", "glm47", "llama3", "deepseekv31", "kimi_k2", "gpt-oss", "minimax-m2"]


def _run(out: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "engine", "run", "--no-progress", "--profile", "chat", "--limit", "2",
                           "--output", str(out), *argv], capture_output=True, text=True, timeout=300, cwd=out.parent, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    d = tmp_path_factory.mktemp("formats")
    jobs = {name: (d / f"{name}.jsonl", ("--tool-parser", name)) for name in FAMILIES}
    jobs["hermes-reading-kimi"] = (d / "mixed.jsonl", ("--tool-parser", "hermes", "--replay",
                                                       demo_file("replay-chat-kimi_k2.jsonl")))
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = {k: pool.submit(_run, out, *argv) for k, (out, argv) in jobs.items()}
        return {k: (f.result(), jobs[k][0]) for k, f in done.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_demo_in_each_format_ends_with_the_tool_called(family: str, runs) -> None:
    got, out = runs[family]
    assert got.returncode == 0, got.stderr
    assert f"replay-chat-{family}.jsonl" in got.stdout + got.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        fsm = row["metadata"]["fsm"]
        assert row["status"] == "completed" and fsm["termination_reason"] == "answered"
        assert fsm["tool_stats"]["calls"] == 1 and not fsm["tool_stats"].get("errors")
        assert [t.get("tools") for t in fsm["turns"]][0] == ["code_interpreter"]
        assert row["reward"]["score"] == 1.0


def test_replies_in_another_format_are_answers_and_counted(runs) -> None:
    got, out = runs["hermes-reading-kimi"]
    assert got.returncode == 0, got.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(row["metadata"]["fsm"]["tool_stats"]["calls"] == 0 for row in rows)
    assert [t.get("foreign_format") for row in rows for t in row["metadata"]["fsm"]["turns"]] == ["kimi_k2", "kimi_k2"]
    assert all(row["metadata"]["fsm"]["termination_reason"] == "answered" for row in rows)
    assert "answers that look like calls of another format:" in got.stdout and "kimi_k2" in got.stdout
