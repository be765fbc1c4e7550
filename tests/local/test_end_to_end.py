"""End to end over real loopback HTTP: the embedded server, the engine, the real sandbox, the CLI."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import slime
from engine.cli import build_parser
from engine.local.demos import demo_file
from engine.run import main_run, read_prompts
from engine.local.server import BackgroundServer, ServerSettings
from tests.conftest import run
from tests.support.helpers import SAMPLING, make_args, tok
from engine.local.sample import Sample

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(ServerSettings(port=0, replay_path=demo_file("replay.jsonl"), context_length=4096)) as s:
        yield s


def test_demo_through_slime_generate_on_loopback(server: BackgroundServer) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    args = make_args(sglang_router_ip=host, sglang_router_port=int(port), rollout_max_context_len=4096)
    rows = [json.loads(line) for line in open(demo_file("prompts.jsonl"))]
    samples = [Sample(index=i, prompt=r["prompt"], label=r["label"], session_id=f"s{i}") for i, r in enumerate(rows)]

    async def go() -> None:
        import asyncio

        await asyncio.gather(*(slime.generate(args, s, dict(SAMPLING)) for s in samples))
        for s in samples:
            s.reward = await slime.reward_func(args, s)

    run(go())
    by_prompt = {s.prompt: s for s in samples}
    for s in samples:
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        assert s.response == tok().decode(s.tokens[len(s.tokens) - s.response_length :])
        assert len(s.tokens) <= 4096
        assert all(lp <= 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m)
    assert Counter(s.status.name for s in samples) == {"COMPLETED": 19, "TRUNCATED": 1}
    trimmed = by_prompt["Print the first 10000 digits of the number 1/7."]
    assert trimmed.metadata["fsm"]["termination_reason"] == "observation_over_budget"
    assert len(trimmed.tokens) == 4096
    assert by_prompt["What is 17 * 23?"].reward["score"] == 1.0
    assert "Output:\n391" in by_prompt["What is 17 * 23?"].response  # the real sandbox ran the code
    assert by_prompt["What is 13 * 14?"].reward["score"] < 0
    assert by_prompt["What is 123 + 456?"].metadata["fsm"]["tool_stats"]["errors"] == {"malformed_call": 1}
    assert by_prompt["What is the 10th triangular number divided by 5?"].metadata["fsm"]["tool_stats"]["errors"] == {"crash": 1}
    assert "NameError" in by_prompt["What is the 10th triangular number divided by 5?"].response


def cli(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", "--no-progress", *argv])


def test_run_command_writes_samples_and_summary(server: BackgroundServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "samples.jsonl"
    assert main_run(cli("--server", server.url, "--output", str(out), "--limit", "4")) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4 and not (tmp_path / "samples.jsonl.partial").exists()
    assert {"tokens", "response", "loss_mask", "rollout_log_probs", "status", "metadata", "reward"} <= set(lines[0])
    assert all(line["metadata"]["fsm"]["trace"][0] == ["RESET", "start", "BUDGET_CHECK"] for line in lines)
    printed = capsys.readouterr().out
    assert "termination reason" in printed and "samples: 4" in printed


def test_bad_input_lines_and_overlong_prompts_are_recorded_per_sample(server: BackgroundServer, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"prompt": "What is 1 + 1?", "label": "2"}) + "\n"
        + "{not json\n"
        + json.dumps({"no_prompt": 1}) + "\n"
        + json.dumps({"prompt": "word " * 5000, "label": "x"}) + "\n"
    )
    out = tmp_path / "o.jsonl"
    assert main_run(cli("--server", server.url, "--input", str(src), "--output", str(out))) == 0
    got = {line["index"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert got[0]["status"] == "completed"
    assert got[1]["status"] == got[2]["status"] == "failed"
    assert got[1]["metadata"]["fsm"]["termination_reason"] == "bad_input_line"
    assert got[3]["status"] == "truncated" and got[3]["metadata"]["fsm"]["termination_reason"] == "prompt_over_budget"


def test_a_missing_input_says_so_when_the_output_file_already_exists(tmp_path: Path, monkeypatch, capsys) -> None:
    # The README's first command leaves samples.jsonl (the default output) in the working directory.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "samples.jsonl").write_text("")
    assert main_run(cli("--input", str(tmp_path / "nope.jsonl"), "--server", "http://127.0.0.1:9")) == 2
    assert "no such input file" in capsys.readouterr().err


def test_missing_file_and_unreachable_server_say_so(tmp_path: Path, capsys) -> None:
    assert main_run(cli("--input", str(tmp_path / "nope.jsonl"), "--server", "http://127.0.0.1:9")) == 2
    assert "no such input file" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "x"}) + "\n")
    assert main_run(cli("--input", str(src), "--server", "http://127.0.0.1:9", "--output", str(tmp_path / "o"))) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_demo_prompts_parse() -> None:
    assert len(read_prompts(demo_file("prompts.jsonl"))) == 20


def test_ctrl_c_keeps_what_finished_and_never_leaves_half_a_file(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "samples.jsonl"
    partial = tmp_path / "samples.jsonl.partial"
    proc = subprocess.Popen([sys.executable, "-m", "engine", "run", "--output", str(out), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and partial.read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    printed, _ = proc.communicate(timeout=90)
    assert proc.returncode in (130, 0), printed  # 0: it finished before the signal landed
    assert out.exists() and not partial.exists()
    lines = out.read_text().splitlines()
    assert 1 <= len(lines) <= 20
    assert all(json.loads(line)["status"] in ("completed", "truncated", "aborted", "failed") for line in lines)
    if proc.returncode == 130:
        assert "interrupted" in printed
    assert "wall: nan" not in printed
    if "samples: " in printed:  # a summary was printed: it measured the time
        assert re.search(r"wall: \d+\.\d s", printed), printed
