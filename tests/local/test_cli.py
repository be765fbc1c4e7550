"""The command line as a new user meets it, run as a subprocess: bad input is one line and exit 2
before anything starts; a dead tool stops the job; failing tools are named; help, version, -v.

The bad-input cases run together (a few at a time) in one fixture, so the file stays fast:
none of them may start the embedded server, and none may leave a file behind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest

from engine.cli import build_parser, program_name
from engine.settings import EngineConfig
from engine.local.demos import demo_file
from engine.run import settings_args

ROOT = Path(__file__).resolve().parents[2]
SERVER_STARTS = "starting the embedded server"


@attrs.frozen
class Outcome:
    code: int
    out: str
    err: str
    files: tuple[str, ...]  # what the run left in its directory


def engine(*argv: str, cwd: Path, timeout: float = 180) -> Outcome:
    """`python -m engine ARGV` from the repository root (so this checkout is imported), in `cwd`'s files."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    before = set(os.listdir(cwd))
    done = subprocess.run([sys.executable, "-m", "engine", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    left = tuple(sorted(set(os.listdir(cwd)) - before))
    return Outcome(done.returncode, done.stdout, done.stderr, left)


# -- every bad input: one line, exit 2, nothing started, nothing written ------------------------------


def _cases(d: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, text the one stderr line must hold). Files are made in `d`."""
    (d / "empty.jsonl").write_text("")
    (d / "junk.jsonl").write_text("{not json\n[1, 2]\n")
    (d / "prompts.jsonl").write_text(json.dumps({"prompt": "What is 1 + 1?", "label": "2"}) + "\n")
    (d / "notok").mkdir()
    (d / "notok" / "README").write_text("no tokenizer here\n")
    (d / "bad.yaml").write_text("engine_max_turns: [unclosed\n")
    (d / "zero_turns.yaml").write_text("engine_max_turns: 0\n")
    (d / "list.yaml").write_text("- engine_max_turns\n")
    (d / "outdir").mkdir()
    p = str(d / "prompts.jsonl")
    out = ["--output", str(d / "o.jsonl")]
    return {
        "max_context_negative": (["--max-context", "-5", *out], "argument --max-context: must be a whole number from 1 to 1000000000"),
        "max_turns_zero": (["--max-turns", "0", *out], "argument --max-turns: must be a whole number from 1 to 100000"),
        "concurrency_negative": (["--concurrency", "-3", *out], "argument --concurrency: must be a whole number >= 1"),
        "limit_zero": (["--limit", "0", *out], "argument --limit: must be a whole number >= 1"),
        "limit_negative": (["--limit", "-1", *out], "argument --limit: must be a whole number >= 1"),
        "temperature_negative": (["--temperature", "-1", *out], "argument --temperature: must be a number from 0 to 1000"),
        "top_p_zero": (["--top-p", "0", *out], "argument --top-p: must be a number > 0 and <= 1"),
        "top_p_nan": (["--top-p", "nan", *out], "argument --top-p: must be a number > 0 and <= 1"),
        "unknown_option": (["--bogus", *out], "unrecognized arguments: --bogus"),
        "unknown_profile": (["--profile", "xml", *out], "--profile xml: unknown profile 'xml': registered are chat, retool"),
        "unknown_tool_parser": (["--profile", "chat", "--tool-parser", "xml", *out], "--tool-parser: unknown tool parser 'xml': known are "),
        "unknown_reasoning_parser": (["--profile", "chat", "--reasoning-parser", "xml", *out],
                                     "--reasoning-parser: unknown reasoning parser 'xml': known are "),
        "reasoning_parser_for_retool": (["--reasoning-parser", "qwen3", *out],
                                        "--reasoning-parser: the retool profile reads its own reasoning format; engine_reasoning_parser is for chat"),
        "output_dir_missing": (["--output", str(d / "nowhere" / "o.jsonl")], "does not exist"),
        "output_is_a_directory": (["--output", str(d / "outdir")], "is a directory"),
        "output_unwritable": (["--output", "/proc/fsm-rollout-test.jsonl"], "--output /proc/fsm-rollout-test.jsonl: cannot write in /proc"),
        "output_is_the_input": (["--input", p, "--output", p], "is the input file"),
        "server_not_a_url": (["--server", "localhost:30000", *out], "--server: must be an http:// or https:// URL"),
        "input_is_a_directory": (["--input", str(d / "outdir"), *out], "not a file"),
        "input_missing": (["--input", str(d / "nope.jsonl"), *out], "no such input file"),
        "input_empty": (["--input", str(d / "empty.jsonl"), *out], "holds no prompts"),
        "input_all_junk": (["--input", str(d / "junk.jsonl"), *out], "no line is a prompt (line 1:"),
        "tokenizer_missing": (["--input", p, "--tokenizer", str(d / "nope"), *out], "--tokenizer"),
        "tokenizer_without_files": (["--input", p, "--tokenizer", str(d / "notok"), *out], "cannot load a tokenizer there"),
        "config_missing": (["--config", str(d / "nope.yaml"), *out], "--config: cannot read"),
        "config_not_yaml": (["--config", str(d / "bad.yaml"), *out], "is not valid YAML"),
        "config_not_a_mapping": (["--config", str(d / "list.yaml"), *out], "must hold a mapping"),
        "config_bad_value": (["--config", str(d / "zero_turns.yaml"), *out],
                             "engine_max_turns in " + str(d / "zero_turns.yaml") + ": must be a whole number from 1"),
        "budgets_inconsistent": (["--max-context", "100", "--max-new-tokens", "500", *out], "--max-new-tokens 500 is more than --max-context 100"),
        "unknown_demo": (["--demo", "longer", *out], "argument --demo: invalid choice: 'longer'"),
        "demo_with_its_own_config": (["--demo", "long", "--config", str(d / "zero_turns.yaml"), *out],
                                     "--config: --demo long runs with its own settings ("),
        "replay_with_server": (["--server", "http://127.0.0.1:9", "--replay", p, *out], "--replay: only the embedded server"),
        "unknown_tool": (["--input", p, "--tools", "nope", *out], "--tools: no tool named 'nope' (registered: code_interpreter"),
        "tool_module_missing": (["--input", p, "--tool-module", "no_such_module_xyz", *out],
                                "--tool-module no_such_module_xyz: cannot import it (ModuleNotFoundError"),
    }


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Outcome, str]]:
    d = tmp_path_factory.mktemp("bad")
    cases = _cases(d)

    def one(item: tuple[str, tuple[list[str], str]]) -> tuple[str, tuple[Outcome, str]]:
        name, (argv, expected) = item
        work = d / f"run-{name}"
        work.mkdir()
        return name, (engine("run", "--no-progress", *argv, cwd=work), expected)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(one, cases.items()))


def _case_names() -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return sorted(_cases(Path(d)))


@pytest.mark.parametrize("name", _case_names())
def test_bad_input_is_one_line_exit_2_before_anything_starts(bad_runs: dict[str, tuple[Outcome, str]], name: str) -> None:
    outcome, expected = bad_runs[name]
    lines = outcome.err.strip().splitlines()
    assert outcome.code == 2, outcome.err
    assert len(lines) == 1, outcome.err
    assert "error" in lines[0] and expected in lines[0], lines[0]
    assert "Traceback" not in outcome.err + outcome.out
    assert SERVER_STARTS not in outcome.err
    assert outcome.files == ()  # no output, no .partial, no probe file left


def test_unknown_engine_key_is_warned_with_the_closest_key(tmp_path: Path) -> None:
    (tmp_path / "typo.yaml").write_text("engine_max_turnz: 3\n")
    got = engine("run", "--config", str(tmp_path / "typo.yaml"), "--input", str(tmp_path / "nope.jsonl"), cwd=tmp_path)
    assert got.code == 2 and "no such input file" in got.err
    assert "unknown engine setting engine_max_turnz (ignored); did you mean engine_max_turns?" in got.err


# -- tools that cannot work ------------------------------------------------------------------------


def test_a_sandbox_that_cannot_start_stops_the_run_before_rolling_out(tmp_path: Path) -> None:
    from tests.support.broken_tools import REASON

    got = engine("run", "--no-progress", "--tool-module", "tests.support.plugins.dead_sandbox", cwd=tmp_path)
    assert got.code == 1
    assert got.err.strip() == f"error: tool code_interpreter cannot work: {REASON}; nothing was rolled out"
    assert SERVER_STARTS not in got.err and got.files == ()


def test_the_summary_of_a_run_with_failing_tools_names_the_error(tmp_path: Path) -> None:
    from tests.support.broken_tools import TEXT

    got = engine("run", "--no-progress", "--limit", "3", "--tool-module", "tests.support.plugins.failing_sandbox",
                 cwd=tmp_path)
    assert got.code == 1, got.err  # every call failed: not a success, whatever the statuses say
    assert "error: every tool call failed (3 of 3: sandbox 3)" in got.err
    assert f"       3  {TEXT}" in got.out  # the most common error text, with its count
    assert f"warning: 3 of 3 calls of code_interpreter failed with 'sandbox': {TEXT}" in got.out
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert "Traceback" not in got.err


def test_a_run_offering_only_a_tool_the_model_never_calls_warns_and_exits_1(tmp_path: Path) -> None:
    """The demo with only the user's `calculator` offered: every call the model makes names
    code_interpreter and is answered 'unknown tool'. Those are calls, and every one failed."""
    (tmp_path / "calc.py").write_text(
        "from engine import tools\n\n\n@tools.tool\nasync def calculator(expression: str) -> str:\n"
        "    \"\"\"Evaluate an arithmetic expression.\"\"\"\n    return str(eval(expression, {}, {}))\n")
    env_path = os.pathsep.join([str(tmp_path), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": env_path}
    done = subprocess.run([sys.executable, "-m", "engine", "run", "--no-progress", "--tool-module", "calc",
                           "--tools", "calculator"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error: every tool call failed (20 of 20: unknown_tool 19, malformed_call 1)" in done.stderr
    assert "warning: 19 of 19 calls of code_interpreter failed with 'unknown_tool': the tool is not offered" in done.stdout
    tool_calls_row = next(line for line in done.stdout.splitlines() if line.startswith("tool_calls"))
    assert tool_calls_row.split()[-1] == "20"  # the 19 calls of code_interpreter and one malformed call
    assert "Traceback" not in done.stderr


# -- a working run: the chat demo, GRPO groups, rows in input order, trace --text -------------------------


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Outcome, Path]:
    d = tmp_path_factory.mktemp("chat")
    got = engine("run", "--no-progress", "--profile", "chat", "--limit", "3", "--n-samples-per-prompt", "2",
                 "--concurrency", "6", cwd=d)
    return got, d / "samples.jsonl"


def test_chat_demo_rolls_out_groups_with_tool_calls_in_input_order(chat_run: tuple[Outcome, Path]) -> None:
    got, out = chat_run
    assert got.code == 0, got.err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(6))
    assert [r["group_index"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert len({r["session_id"] for r in rows}) == 6
    prompts = [json.loads(line)["prompt"] for line in Path(demo_file("prompts.jsonl")).read_text().splitlines()][:3]
    assert [r["prompt"] for r in rows] == [p for p in prompts for _ in range(2)]
    for r in rows:
        assert r["status"] == "completed" and r["metadata"]["fsm"]["profile"] == "chat"
        assert r["metadata"]["fsm"]["tool_stats"]["calls"] == 1 and r["reward"]["score"] == 1.0
        assert "<tool_call>" in r["response"] and "<tool_response>" in r["response"]


def test_trace_prints_turn_text_and_tool_calls_with_their_output(chat_run: tuple[Outcome, Path]) -> None:
    _, out = chat_run
    got = engine("trace", str(out), "--sample", "1", "--text", "--out", str(out.parent / "path.mmd"), cwd=out.parent)
    assert got.code == 0, got.err
    assert got.out.startswith("sample index 1 (position 1 in the file): status COMPLETED")
    assert '-> call code_interpreter: {"code": "print(17 * 23)"}' in got.out
    assert "<- observation" in got.out and "Output:\n    391" in got.out
    assert "Answer: \\boxed{391}" in got.out


def test_trace_refuses_a_prompts_file_and_a_missing_index(chat_run: tuple[Outcome, Path], tmp_path: Path) -> None:
    got = engine("trace", demo_file("prompts.jsonl"), "-v", cwd=tmp_path)  # -v after the subcommand is fine
    assert got.code == 2 and len(got.err.strip().splitlines()) == 1
    assert "holds no engine traces" in got.err and "PENDING" not in got.out
    _, out = chat_run
    got = engine("trace", str(out), "--sample", "99", cwd=tmp_path)
    assert got.code == 2 and "--sample 99: no sample has index 99 (the file holds 6 samples, indexes 0 to 5" in got.err
    got = engine("flow", demo_file("prompts.jsonl"), cwd=tmp_path)
    assert got.code == 2 and "holds no engine traces" in got.err


# -- help, version, names, serve --------------------------------------------------------------------


def test_help_documents_every_option_with_its_default() -> None:
    parser = build_parser("fsm-rollout")
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    text = " ".join(subparsers.choices["run"].format_help().split())  # unwrapped
    for shown in ("(default: samples.jsonl)", "(default: 16)", "(default: 512)", "(default: retool)", "(default: 64)"):
        assert shown in text
    assert "(default: 2000)" in " ".join(subparsers.choices["soak"].format_help().split())


def test_version_and_the_scripts_own_name(tmp_path: Path) -> None:
    got = engine("--version", cwd=tmp_path)
    assert got.code == 0 and got.out.startswith("python -m engine ") and got.out.split()[-1][0].isdigit()
    assert program_name("/venv/bin/fsm-rollout") == "fsm-rollout"
    assert program_name(str(ROOT / "engine" / "__main__.py")) == "python -m engine"
    assert build_parser("fsm-rollout").format_usage().startswith("usage: fsm-rollout ")


def test_serve_says_where_it_listens(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", "0"], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        line = proc.stderr.readline() if proc.stderr else ""
        assert "listening on http://127.0.0.1:" in line, line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- --config reads what slime reads ------------------------------------------------------------------


def test_config_gives_the_settings_slime_would_read(tmp_path: Path) -> None:
    import yaml

    data: dict[str, Any] = {
        "engine_profile": "chat", "engine_max_turns": 5, "engine_max_tool_calls": 7, "engine_tool_timeout": 30,
        "engine_tools": ["code_interpreter"], "engine_tool_modules": "tests.support.plugins.word_count",
        "engine_max_response_len": 2048, "engine_retry_attempts": 2, "engine_retry_deadline": 30,
        "sglang_server_concurrency": 8, "rollout_max_context_len": 8192, "partial_rollout": True,
        "engine_server_url": "http://10.0.0.1:30000",
    }
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(data))
    slime_args = argparse.Namespace()
    for key, value in (yaml.safe_load(path.read_text()) or {}).items():  # what slime does with --custom-config-path
        setattr(slime_args, key, value)
    from_slime = EngineConfig.from_args(slime_args)
    ns = build_parser().parse_args(["run", "--config", str(path)])
    assert EngineConfig.from_args(settings_args(ns)) == from_slime
    assert from_slime.profile == "chat" and from_slime.tools == ("code_interpreter",) and from_slime.partial_rollout
    # a flag wins over the file, and changes nothing else
    ns = build_parser().parse_args(["run", "--config", str(path), "--max-turns", "3", "--tool-module", "tests.support.plugins.shout_format"])
    assert EngineConfig.from_args(settings_args(ns)) == attrs.evolve(from_slime, max_turns=3,
                                                                     tool_modules=("tests.support.plugins.shout_format",))


# -- soak and bench check the sandbox first -----------------------------------------------------------


def test_soak_and_bench_stop_before_starting_when_the_sandbox_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.local.bench.main import main_bench
    from engine.local.soak import main_soak
    from tests.support.broken_tools import REASON, DeadSandbox
    from engine.tools.registry import registered

    with registered(DeadSandbox()):
        soak = main_soak(argparse.Namespace(samples=10, concurrency=4, faults="default", seed=0, json=False))
        bench = main_bench(argparse.Namespace(small=True, json=False, samples=None, turns=None, repeats=None))
    err = capsys.readouterr().err
    assert soak == 1 and bench == 1
    assert f"error: tool code_interpreter cannot work: {REASON}; nothing was rolled out" in err
    assert f"error: tool code_interpreter cannot work: {REASON}; nothing was measured" in err
    assert "measuring" not in err  # no figure started


@pytest.mark.parametrize(("argv", "says"), [
    (["--port", "70000"], "argument --port: must be a port number from 0 to 65535, got '70000'"),
    (["--replay-path", "nope.jsonl"], "argument --replay-path: cannot read 'nope.jsonl' (No such file or directory)"),
    (["--model-path", "nope"], "argument --model-path: 'nope' is not a directory"),
    (["--context-length", "5"], "argument --context-length: must be a whole number >= 9, got '5'"),
])
def test_serve_refuses_bad_arguments_before_loading_anything(tmp_path: Path, argv: list[str], says: str) -> None:
    got = engine("serve", *argv, cwd=tmp_path)
    assert got.code == 2 and got.err.strip().splitlines() == [f"python -m engine serve: error: {says} (see python -m engine serve --help)"]
