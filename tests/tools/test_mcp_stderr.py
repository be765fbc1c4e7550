"""A stdio MCP server's stderr, where MCP servers log: read by the engine as it comes, logged at
INFO with the server's secrets masked, bounded per start (a flood costs a counter, not the job's
log), never passed through to the engine's own stderr, and its last lines logged with the failure
when the server cannot start or dies."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'fsm-rollout-engine[mcp]')")

from engine import logs  # noqa: E402
from engine.tools.mcp_connection import Connection, ServerFailure  # noqa: E402
from engine.tools.mcp_spec import MASK, ServerSpec  # noqa: E402
from engine.tools.mcp_stdio import STDERR_LINE, STDERR_LOG_LIMIT, STDERR_TAIL, ErrorLog  # noqa: E402
from tests.conftest import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SERVER_PY = ROOT / "tests" / "support" / "mcp_server.py"
SECRET = "sk-fake-0123456789abcdef"
LINES = 200_000  # ~3.4 MB of stderr: fifty times the limit

# writes LINES lines to stderr, then becomes the test server
FLOOD = (f"import os, sys\nfor i in range({LINES}): sys.stderr.write(f'noise line {{i}}\\n')\n"
         "sys.stderr.flush()\nos.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
# says why it cannot start, naming its key, and exits 1
DIES = ("import os, sys\nprint('loading the index', file=sys.stderr)\n"
        "print('ValueError: the key ' + os.environ['API_KEY'] + ' is refused', file=sys.stderr)\nsys.exit(1)")


def records(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name]


def test_a_server_flooding_stderr_is_logged_up_to_the_limit_and_keeps_serving(
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO, logger="engine.tools.mcp_stdio")
    spec = ServerSpec.parse({"name": "noisy", "command": [sys.executable, "-c", FLOOD, str(SERVER_PY)]})

    async def main() -> tuple[str, int]:
        conn = Connection(spec)
        try:
            result = await conn.call("add", {"a": 2, "b": 3}, 60)
            life = conn._life
            assert life is not None and life.process is not None
            return result.content[0].text, life.process.errors.total
        finally:
            await conn.close()

    answer, read = run(main())
    assert answer == "5"  # the server was not held up by a stderr nobody reads
    assert read >= LINES * len("noise line 0\n")  # all of it drained
    logged = records(caplog, "engine.tools.mcp_stdio")
    lines = [r.getMessage() for r in logged if "noise line" in r.getMessage()]
    assert lines[0] == "MCP server 'noisy': noise line 0"
    assert 1000 < len(lines) < STDERR_LOG_LIMIT // len("noise line 0\n") + 1
    prefix = "MCP server 'noisy': "
    assert sum(len(line) - len(prefix) + 1 for line in lines) <= STDERR_LOG_LIMIT  # the server's bytes, each line's end counted
    assert sum("is not logged" in r.getMessage() for r in logged) == 1
    assert "noise line" not in capfd.readouterr().err  # nothing reached the engine's own stderr


def test_a_server_that_cannot_start_is_explained_by_its_stderr_with_its_secret_masked(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    logs.forget()
    monkeypatch.setenv("FSM_TEST_KEY", SECRET)
    spec = ServerSpec.parse({"name": "vault", "command": [sys.executable, "-c", DIES],
                             "env": {"API_KEY": "${FSM_TEST_KEY}"}})

    async def main() -> ServerFailure:
        conn = Connection(spec)
        try:
            with pytest.raises(ServerFailure) as failed:
                await conn.call("add", {"a": 1, "b": 2}, 60)
            return failed.value
        finally:
            await conn.close()

    failure = run(main())
    assert failure.reason == "could not start (exited with status 1)"  # what the sample (or model) reads
    told = [r.getMessage() for r in records(caplog, "engine.tools.mcp_connection") if r.levelno == logging.WARNING]
    assert len(told) == 1, told
    assert told[0].startswith("MCP server 'vault' could not start (exited with status 1); the last of its stderr:")
    assert f"    loading the index\n    ValueError: the key {MASK} is refused" in told[0]
    assert SECRET not in caplog.text
    assert SECRET not in capfd.readouterr().err
    assert SECRET not in failure.reason


def test_the_error_log_cuts_an_endless_line_and_keeps_whole_lines_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine.tools.mcp_stdio")
    errors = ErrorLog("s", lambda text: text.replace("KEY", MASK))
    errors.data_received(b"x" * (5 * STDERR_LINE))  # no end of line yet
    errors.data_received(b"y" * STDERR_LINE + b" still the same line\nthe KEY line\n")
    logged = [r.getMessage() for r in records(caplog, "engine.tools.mcp_stdio")]
    assert logged == ["MCP server 's': " + "x" * STDERR_LINE, f"MCP server 's': the {MASK} line"]
    assert 6 * STDERR_LINE > STDERR_TAIL  # so the kept end starts inside the long line
    assert errors.tail() == f"the {MASK} line"  # the cut line's remains are not shown as a line
    assert errors.total == 6 * STDERR_LINE + len(b" still the same line\nthe KEY line\n")


def test_the_limit_is_said_once_when_a_chunk_ends_right_at_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engine.tools.mcp_stdio")
    errors = ErrorLog("s", str)
    for _ in range(3):  # one endless line: the first chunk fills the limit exactly
        errors.data_received(b"x" * STDERR_LOG_LIMIT)
    logged = [r.getMessage() for r in records(caplog, "engine.tools.mcp_stdio")]
    assert logged == ["MCP server 's': " + "x" * STDERR_LINE, "MCP server 's': its stderr past 64 KiB is not logged"]
    assert errors.total == 3 * STDERR_LOG_LIMIT
