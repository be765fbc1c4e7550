"""Every command and flag the pages show exists: checked against the real parsers, not a list.

The pages are the README, docs/*.md and tools/README.md. An invocation of the engine's
commands (`python -m engine CMD`, `fsm-rollout CMD`, `python -m engine.MODULE`, `tools/*.sh`),
in a code block or an inline code span, has each `--flag` looked up in that command's own
`--help`; a flag named anywhere else on a page must be a flag of one of the engine's commands,
or one of another program's that the page names (slime's, pip's, setpriv's, Ray's: FOREIGN,
each with its owner). tests/test_docs.py runs the blocks that can run here; this also reads the
ones it cannot (a slime job, a GPU, root) and the prose.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

from engine.cli import build_parser
from engine.settings.core import load_plugins

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tools" / "README.md"]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w>-])")
INVOCATION = re.compile(r"(?:python -m (?P<module>engine(?:\.[\w.]+)?)|(?P<script>fsm-rollout)|(?P<tool>tools/[\w-]+\.sh))"
                        r"(?P<tail>[^|;&#`\n]*)")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
EDGE_LABEL = re.compile(r"--\w+ \[[^\]]*\]-->")  # `RESET --resume [checkpoint_rejected]--> BUDGET_CHECK`

# Flags of other programs the pages show, by owner. A flag is here because a page tells the
# reader to give it to that program; one of the engine's is never listed here.
FOREIGN: dict[str, str] = {
    **dict.fromkeys([
        "--custom-generate-function-path", "--custom-rm-path", "--custom-rollout-log-function-path",
        "--mask-offpolicy-in-partial-rollout", "--use-rollout-routing-replay", "--tool-key",
        "--save-debug-rollout-data", "--sglang-router-ip", "--hf-checkpoint", "--ref-load", "--prompt-data",
        "--input-key", "--label-key", "--reward-key", "--apply-chat-template", "--apply-chat-template-kwargs", "--rollout-shuffle", "--num-rollout",
        "--rollout-batch-size", "--rollout-max-response-len", "--rollout-max-context-len",
        "--rollout-temperature", "--rollout-top-p", "--global-batch-size", "--balance-data", "--advantage-estimator",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "--dynamic-sampling-filter-path", "--metadata-key",
        "--custom-reward-post-process-path",
    ], "slime"),
    "--no-deps": "pip", "--index-url": "pip",
    "--reuid": "setpriv", "--regid": "setpriv", "--bounding-set": "setpriv", "--clear-groups": "setpriv",
    "--address": "ray start", "--resources": "ray start",
    "--task": "mini-swe-agent",
    "--greeting": "greeter.py, docs/tools.md's example plugin (`run` offers it once given the module)",
    "--repository": "mcp-server-git",
    "--task": "mini-swe-agent, the command-line harness docs/agents.md names as an engine_agent",
    "--exit-immediately": "mini-swe-agent (docs/agents.md: its command line behind `python -m engine agent --`)",
}


def _help_flags(text: str) -> frozenset[str]:
    return frozenset(FLAG.findall(text))


@cache
def engine_commands() -> dict[str, frozenset[str]]:
    """Each `python -m engine` command and the flags its `--help` lists (with the built-in plugins' flags,
    which `python -m engine` loads before it builds its parser)."""
    load_plugins(())

    def help_of(*argv: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            build_parser("python -m engine").parse_args([*argv, "--help"])
        return out.getvalue()

    listing = help_of().split("COMMAND\n", 2)[-1]  # the commands, one a line: "    run   roll out ..."
    choices = re.findall(r"^    ([a-z]+)(?:\s|$)", listing, re.M)
    assert "run" in choices and "diagram" in choices, listing
    return {name: _help_flags(help_of(name)) for name in choices}


@cache
def program_flags(*argv: str) -> frozenset[str]:
    """The flags a module or script lists when asked for `--help` (or in the usage line it prints)."""
    done = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return _help_flags(done.stdout + done.stderr)


def command_lines(page: Path) -> list[tuple[int, str]]:
    """Lines of code blocks (continuations joined) and inline code spans, with their line numbers."""
    text = page.read_text(encoding="utf-8")
    found: list[tuple[int, str]] = []
    for m in FENCE.finditer(text):
        if m.group(1) == "mermaid":
            continue
        first = text[: m.start(2)].count("\n") + 1
        for i, line in enumerate(m.group(2).replace("\\\n", "  ").split("\n")):
            found.append((first + i, line))
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for n, line in enumerate(prose.split("\n"), 1):
        found += [(n, span) for span in INLINE.findall(line)]
        found.append((n, INLINE.sub(" ", line)))  # the prose around the spans (bare flags)
    return [(n, EDGE_LABEL.sub(" ", line)) for n, line in found]


def invocation_problems(where: str, line: str) -> tuple[list[str], set[str]]:
    """What is wrong with the engine invocations on `line`, and the flags they account for."""
    problems: list[str] = []
    seen: set[str] = set()
    for m in INVOCATION.finditer(line):
        tokens = [t.strip("[]()") for t in m.group("tail").split()]  # `[--json]` in a usage line
        if "--" in tokens:  # `agent [options] -- CMD ...`: what follows is the harness's command line
            tokens = tokens[: tokens.index("--")]
        flags = {t.split("=", 1)[0] for t in tokens if FLAG.fullmatch(t.split("=", 1)[0])}
        seen |= flags
        if m.group("module") and m.group("module") != "engine":
            allowed, name = program_flags(sys.executable, "-m", m.group("module")), m.group("module")
        elif m.group("tool"):
            script = ROOT / m.group("tool")
            if not script.is_file():
                problems.append(f"{where}: {m.group('tool')} does not exist")
                continue
            allowed, name = program_flags(str(script)), m.group("tool")
        else:
            command = tokens[0] if tokens and not tokens[0].startswith("-") else None
            if command is None:
                allowed, name = frozenset({"--help", "--version"}), "python -m engine"
            elif command not in engine_commands():
                if re.fullmatch(r"[a-z]+", command):
                    problems.append(f"{where}: `{command}` is not a command of python -m engine")
                continue
            else:
                allowed, name = engine_commands()[command], f"python -m engine {command}"
        problems += [f"{where}: {name} has no flag {flag}" for flag in sorted(flags - allowed - {"--help"})]
    return problems, seen


@cache
def every_flag_of_ours() -> frozenset[str]:
    """The flags of the engine's commands, and of every module or script of ours a page invokes."""
    flags = set().union(*engine_commands().values())
    for page in PAGES:
        for _, line in command_lines(page):
            for m in INVOCATION.finditer(line):
                if m.group("module") and m.group("module") != "engine":
                    flags |= program_flags(sys.executable, "-m", m.group("module"))
                elif m.group("tool") and (ROOT / m.group("tool")).is_file():
                    flags |= program_flags(str(ROOT / m.group("tool")))
    return frozenset(flags)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_command_and_flag_of_the_page_exists(page: Path) -> None:
    ours = every_flag_of_ours()
    problems: list[str] = []
    for n, line in command_lines(page):
        where = f"{page.relative_to(ROOT)}:{n}"
        found, accounted = invocation_problems(where, line)
        problems += found
        for flag in set(FLAG.findall(line)) - accounted:
            if flag not in ours and flag not in FOREIGN and flag != "--help":
                problems.append(f"{where}: {flag} is no flag of the engine's commands nor of a program FOREIGN names")
    assert not problems, "\n".join(dict.fromkeys(problems))


def test_the_checker_finds_a_flag_that_does_not_exist() -> None:
    """A negative control: docs/http.md once showed `run --server-url` (the flag is `--server`)."""
    problems, _ = invocation_problems("x.md:1", "points `python -m engine run --server-url URL` at a router")
    assert problems == ["x.md:1: python -m engine run has no flag --server-url"]
    assert invocation_problems("x.md:1", "python -m engine run --server URL --profile chat")[0] == []
    assert invocation_problems("x.md:1", "python -m engine rnu --server URL")[0] == [
        "x.md:1: `rnu` is not a command of python -m engine"]
    assert invocation_problems("x.md:1", "tools/regenerate.sh --chek")[0] == ["x.md:1: tools/regenerate.sh has no flag --chek"]
    # after `agent`'s bare `--` the flags are the harness's own, checked as another program's (FOREIGN)
    problems, seen = invocation_problems("x.md:1", "python -m engine agent --input t.jsonl -- mini --exit-immediately")
    assert problems == [] and seen == {"--input"}
    assert invocation_problems("x.md:1", "python -m engine agent --inptu t.jsonl -- mini")[0] == [
        "x.md:1: python -m engine agent has no flag --inptu"]
    assert not set(FOREIGN) & every_flag_of_ours(), "a FOREIGN flag is the engine's own: take it out of FOREIGN"


# No package index has the engine: it is installed from its checkout (`pip install -e '.[EXTRA]'`).
FROM_AN_INDEX = re.compile(r"pip install\s+['\"]?fsm-rollout-engine")
EXTRA = re.compile(r"-e\s+'?\.\[([\w,]+)\]")


def _texts() -> list[tuple[str, str]]:
    files = [*PAGES, *sorted((ROOT / "engine").rglob("*.py")), ROOT / "fsm_rollout_engine.py"]
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in files]


def test_no_page_or_message_offers_an_install_from_an_index_and_every_extra_named_exists() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    offered = [f"{name}: {m.group(0)}" for name, text in _texts() for m in FROM_AN_INDEX.finditer(text)]
    assert not offered, "no index has the engine; say how to install from the checkout:\n" + "\n".join(offered)
    named = {(name, e) for name, text in _texts() for m in EXTRA.finditer(text) for e in m.group(1).split(",")}
    assert {e for _, e in named} >= {"local", "dev", "diagrams", "ray", "mcp"}
    assert not [f"{name}: [{e}]" for name, e in sorted(named) if e not in extras]
