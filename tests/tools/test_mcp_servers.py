"""Tools served by real MCP servers (written with the SDK, started by the tests): listed at start,
offered with their schemas, called by the model; a server that dies or hangs ends the sample
untrained (or, when failures are the task's, answers with an error and is started again); a
tool's own error stays an observation; over stdio and over streamable HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import respx

pytest.importorskip("mcp", reason="the MCP SDK is not installed (the mcp extra)")

from engine import slime, tools  # noqa: E402
from engine.local.sample import Sample  # noqa: E402
from engine.settings import EngineConfig, RetryPolicy  # noqa: E402
from engine.loop.driver import drive, new_rollout  # noqa: E402
from engine.loop.runtime import Runtime  # noqa: E402
from engine.machine.rollout import Rollout  # noqa: E402
from engine.tools import mcp_servers  # noqa: E402
from tests.conftest import run  # noqa: E402
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, tok, turn  # noqa: E402
from tests.support.mcp_http import http_mcp_server  # noqa: E402

pytestmark = pytest.mark.slow

SUPPORT = Path(__file__).resolve().parents[1] / "support"
SERVER = f"{sys.executable} {SUPPORT / 'mcp_server.py'}"
RAW_SERVER = f"{sys.executable} {SUPPORT / 'raw_mcp_server.py'}"
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(autouse=True)
def forget_servers() -> Iterator[None]:
    """MCP tools are process-wide registrations: each test's are undone after it."""
    yield
    mcp_servers.unregister_servers()


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone(pid: int, seconds: float = 10) -> bool:
    """Whether `pid` is gone (or a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def rollout(script: list, servers: tuple[Any, ...], *, during: Any = None, failures: str = "unavailable",
            **kw: Any) -> tuple[Rollout, ScriptedServer]:
    server = ScriptedServer(script)
    cfg = EngineConfig(server_url=URL, profile="chat", max_context_len=8192, retry=RetryPolicy(max_attempts=1),
                       plugin_settings=[mcp_servers.McpSettings(servers=servers, failures=failures)], **kw)

    async def go() -> Rollout:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            rt = Runtime.create(cfg, tokenizer=tok())
            r = new_rollout(rt, MESSAGES, SAMPLING)
            try:
                task = asyncio.ensure_future(drive(rt, r))
                if during is not None:
                    await during(r)
                await task
            finally:
                await rt.aclose()
            return r

    r = run(go())
    r.traj.check(full=True, max_total_length=r.token_budget)
    return r, server


def observations(r: Rollout) -> list[str]:
    ids = r.traj.response_ids.tolist()
    return [tok().decode(ids[s.start:s.end]) for s in r.traj.segments if s.kind == "observation"]


def test_the_model_calls_a_stdio_servers_tool_offered_with_its_schema():
    r, server = rollout([turn(call("add", a=2, b=3)), turn("It is 5.")], (SERVER,), tools=("add",))
    assert (r.state, r.record.reason) == ("COMPLETED", "answered")
    assert ("TOOL_CALL", "dispatch", "TOOL_ADD") in [tuple(e) for e in r.record.trace]
    assert "<tool_response>\n5\n</tool_response>" in observations(r)[0]
    prompt = tok().decode(server.requests[0]["input_ids"])
    assert '"name": "add"' in prompt and '"description": "Add two integers."' in prompt and '"a": {' in prompt
    assert isinstance(tools.get("add"), mcp_servers.McpTool)


def test_a_tools_own_error_result_stays_an_observation():
    r, _ = rollout([turn(call("fail", reason="no such file")), turn("I could not.")], (SERVER,), tools=("fail",))
    assert (r.state, r.record.reason) == ("COMPLETED", "answered")
    assert "cannot do that: no such file" in observations(r)[0]
    assert r.record.tools.errors == {"tool_error": 1}


def _kill_when_the_call_starts(pidfile: Path, killed: list[int]) -> Any:
    async def kill_mid_call(r: Rollout) -> None:
        deadline = time.monotonic() + 60
        while not pidfile.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        pid = int(pidfile.read_text())
        pidfile.unlink()
        os.kill(pid, signal.SIGKILL)  # the server dies while the call waits for it
        killed.append(pid)

    return kill_mid_call


def test_a_server_killed_mid_call_ends_the_sample_untrained(tmp_path):
    pidfile = tmp_path / "pid"
    killed: list[int] = []
    script = [turn(call("slow_echo", text="hi", seconds=60)), turn("Never asked.")]
    r, server = rollout(script, (f"{SERVER} --pidfile {pidfile}",), during=_kill_when_the_call_starts(pidfile, killed),
                        tools=("slow_echo",), tool_timeout=30)
    assert (r.state, r.record.reason) == ("FAILED", "tool_unavailable")
    assert r.record.error == "tool slow_echo cannot work: MCP server 'engine-test' was killed by SIGKILL"
    assert len(server.requests) == 1  # nothing of the failure reached the model
    assert observations(r) == []


def test_when_failures_are_the_tasks_a_killed_server_answers_with_an_error_and_is_restarted(tmp_path):
    pidfile = tmp_path / "pid"
    killed: list[int] = []
    script = [turn(call("slow_echo", text="hi", seconds=60)), turn(call("slow_echo", text="again", seconds=0)), turn("Done.")]
    r, _ = rollout(script, (f"{SERVER} --pidfile {pidfile}",), during=_kill_when_the_call_starts(pidfile, killed),
                   tools=("slow_echo",), tool_timeout=30, failures="observation")
    assert r.state == "COMPLETED"
    first, second = observations(r)
    assert "Error: slow_echo: MCP server 'engine-test' was killed by SIGKILL" in first
    assert "echo: again" in second  # a new server answered the next call
    assert r.record.tools.errors == {"server_error": 1}
    restarted = int(pidfile.read_text())
    assert restarted != killed[0]
    assert gone(restarted)  # ended with the run


def test_a_slow_call_of_a_live_server_times_out_and_the_server_keeps_serving(tmp_path):
    """The call times out; the server answers a ping, so it is not ended: the next call reaches it."""
    pidfile = tmp_path / "pid"
    script = [turn(call("slow_echo", text="hi", seconds=60)), turn(call("slow_echo", text="there", seconds=0)), turn("Done.")]
    r, _ = rollout(script, (f"{SERVER} --pidfile {pidfile}",), tools=("slow_echo",), tool_timeout=8,
                   failures="observation")
    first, second = observations(r)
    assert "Error: slow_echo: MCP server 'engine-test' did not answer within 8 seconds" in first
    assert "echo: there" in second
    assert r.record.tools.errors == {"timeout": 1}
    assert gone(int(pidfile.read_text()))  # the one server, ended with the run


def test_a_timed_out_call_ends_the_sample_untrained_by_default(tmp_path):
    pidfile = tmp_path / "pid"
    r, server = rollout([turn(call("slow_echo", text="hi", seconds=60)), turn("Never asked.")],
                        (f"{SERVER} --pidfile {pidfile}",), tools=("slow_echo",), tool_timeout=8)
    assert (r.state, r.record.reason) == ("FAILED", "tool_unavailable")
    assert r.record.error == "tool slow_echo cannot work: MCP server 'engine-test' did not answer within 8 seconds"
    assert len(server.requests) == 1
    assert gone(int(pidfile.read_text()))


def test_a_crashing_server_says_how_it_ended():
    r, _ = rollout([turn(call("crash")), turn("Never asked.")], (SERVER,), tools=("crash",))
    assert (r.state, r.record.reason) == ("FAILED", "tool_unavailable")
    assert r.record.error == "tool crash cannot work: MCP server 'engine-test' exited with status 3"


@pytest.mark.parametrize("flag, why", [
    ("--surrogate", "(Invalid JSON: lone leading surrogate"),
    ("--deep", "(Invalid JSON: recursion limit exceeded"),  # nested past every parser here: known by its outermost keys
])
def test_a_reply_the_sdk_cannot_read_fails_the_call_at_once_saying_so_not_at_its_timeout(flag: str, why: str):
    r, server = rollout([turn(call("ok_echo", text="hi")), turn("Never asked.")], (f"{RAW_SERVER} {flag}",),
                        tools=("ok_echo",), tool_timeout=30)
    assert (r.state, r.record.reason) == ("FAILED", "tool_unavailable")
    assert r.record.error.startswith("tool ok_echo cannot work: MCP server 'raw' answered error -32700: a reply that "
                                     "is not JSON-RPC the MCP SDK reads " + why), r.record.error
    assert "input_value" not in r.record.error  # the reason, not the reply's data
    assert r.record.tools.seconds < 10  # before: "did not answer within 30 seconds", after all 30
    assert len(server.requests) == 1


@pytest.mark.parametrize("line, answers", [
    (b'{"jsonrpc": "2.0", "id": 7, "result": {"t": "\\udcff"}}', 7),
    (b'{"jsonrpc": "2.0", "id": "r-1", "error": {"code": 1, "message": "\\ud800"}}', "r-1"),
    (b'{"jsonrpc": "2.0", "id": 7, "method": "x", "params": {"t": "\\udcff"}}', None),  # a request, not a reply
    (b'{"jsonrpc": "2.0", "id": null, "result": {"t": "\\udcff"}}', None),
    (b"Starting server v1.0 ...", None),  # a banner: skipped, as before
    # nested past every parser here: known by its outermost keys, the id first (Python's SDK) or last (TypeScript's)
    (b'{"jsonrpc": "2.0", "id": 7, "result": ' + b"[" * 5000 + b"]" * 5000 + b"}", 7),
    (b'{"result": ' + b"[" * 5000 + b"]" * 5000 + b', "jsonrpc": "2.0", "id": "r-2"}', "r-2"),
    (b'{"jsonrpc": "2.0", "id": 7, "method": "x", "params": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    (b'{"result": {"v": ' + b"[" * 5000 + b"]" * 5000 + b', "id": 3}}', None),  # an inner id is not the reply's
])
def test_only_a_reply_to_a_request_becomes_an_error_reply(line: bytes, answers: Any):
    from engine.tools.mcp_stdio import unreadable_reply

    made = unreadable_reply(line, ValueError("1 validation error\n  Invalid JSON: why [type=json_invalid, input_value=x]"))
    assert (made.id if made is not None else None) == answers
    assert made is None or made.error.message == "a reply that is not JSON-RPC the MCP SDK reads (Invalid JSON: why)"


def test_an_invalid_schema_or_name_skips_that_tool_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.tools.mcp_servers"):
        names = mcp_servers.register_servers((RAW_SERVER, SERVER), 30, 30)
    assert names[:3] == ["ok_echo", "add", "slow_echo"]
    warnings = [rec.getMessage() for rec in caplog.records]
    assert len(warnings) == 3
    assert any("MCP server 'raw': tool 'bad_properties' skipped: its input schema's properties are not a mapping of schemas" in w
               for w in warnings)
    assert any("'bad_type' skipped: its input schema has type 'array', not 'object'" in w for w in warnings)
    assert any("MCP server 'engine-test': tool 'Not-A-State' skipped" in w for w in warnings)
    assert tools.get("ok_echo").lenient and not tools.get("add").lenient  # type: ignore[union-attr]
    # the good tool of that server still works, through the SDK
    r, _ = rollout([turn(call("ok_echo", text="hey")), turn("ok")], (RAW_SERVER,), tools=("ok_echo",))
    assert "echo: hey" in observations(r)[0]


def test_a_name_clash_is_one_error_naming_both():
    with pytest.raises(ValueError, match=r"tool name clash: MCP server 'engine-test' lists 'x_add', which MCP server 'engine-test'"):
        mcp_servers.register_servers((f"{SERVER} --prefix x_", f"{SERVER} --prefix x_ --pidfile /dev/null"), 30, 30)
    with pytest.raises(ValueError, match=r"tool name clash: MCP server 'second' lists 'w_add', which MCP server 'first'"):
        mcp_servers.register_servers(({"name": "first", "command": f"{SERVER} --prefix w_"},
                                      {"name": "second", "command": f"{SERVER} --prefix w_ --tag 2"}), 30, 30)

    @tools.tool(name="y_add")
    async def y_add(a: int) -> str:
        """A Python tool."""
        return str(a)

    try:
        with pytest.raises(ValueError, match=r"lists 'y_add', which the tool tests\.tools\.test_mcp_servers\.test_a_name_clash_is_one_error_naming_both\.<locals>\.y_add already has"):
            mcp_servers.register_servers((f"{SERVER} --prefix y_",), 30, 30)
    finally:
        tools.registry.unregister("y_add")


def test_a_server_that_cannot_start_is_a_setup_error_for_every_sample():
    sample = Sample(prompt=MESSAGES)
    args = make_args(engine_profile="chat", engine_mcp_servers=["/nonexistent/mcp-server --stdio --token s3cr3t-value"])
    run(slime.generate(args, sample, dict(SAMPLING)))
    fsm = sample.metadata["fsm"]
    assert fsm["termination_reason"] == "engine_setup_failed"
    assert "MCP server 'mcp-server' could not start (FileNotFoundError: No such file or directory)" in fsm["engine_error"]
    assert "s3cr3t" not in json.dumps(sample.metadata)  # never the command line


def test_a_server_that_exits_at_start_says_how():
    quitter = {"name": "quitter", "command": [sys.executable, "-c", "import sys; sys.exit(7)"]}
    with pytest.raises(ValueError, match=r"^MCP server 'quitter' could not start \(exited with status 7\)$"):
        mcp_servers.register_servers((quitter,), 30, 30)


def test_listing_is_bounded_by_its_own_setting(tmp_path):
    """A server that never answers `initialize` (it sleeps before speaking) fails the start after
    engine_mcp_list_timeout, whatever the tool timeout says."""
    sleeper = f"{sys.executable} -c 'import time; time.sleep(600)'"
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"MCP server 'python\S*' did not list its tools within 2 seconds"):
        mcp_servers.register_servers((sleeper,), 2, 30)
    assert time.monotonic() - started < 2 + 10  # the listing's limit, plus the close and a loaded machine


@pytest.fixture
def http_server() -> Iterator[str]:
    with http_mcp_server("--prefix", "h_") as url:
        yield url


def test_the_model_calls_a_tool_of_a_streamable_http_server(http_server):
    r, _ = rollout([turn(call("h_add", a=20, b=22)), turn("It is 42.")], (http_server,), tools=("h_add",))
    assert r.state == "COMPLETED"
    assert "<tool_response>\n42\n</tool_response>" in observations(r)[0]
    assert ("TOOL_CALL", "dispatch", "TOOL_H_ADD") in [tuple(e) for e in r.record.trace]


def test_an_http_servers_json_reply_past_the_message_cap_ends_the_call_at_once_unread():
    """The SDK reads a JSON reply whole, unbounded (its event streams stop at 1 MiB an event): 400 MB
    held the engine at 2 GB. Past LINE_LIMIT (16 MiB) the reply is not read further."""
    script = [turn(call("h_big", mib=40)), turn("Never asked.")]
    with http_mcp_server("--prefix", "h_", "--json-response") as url:
        r, server = rollout(script, (url,), tools=("h_big",), tool_timeout=60)
    assert (r.state, r.record.reason) == ("FAILED", "tool_unavailable")
    assert "runs past 16777216 bytes" in r.record.error, r.record.error
    assert r.record.tools.seconds < 20  # it was read whole (and parsed, on the event loop) first
    assert len(server.requests) == 1 and observations(r) == []


def test_an_http_server_that_went_down_ends_the_sample_untrained(http_server):
    mcp_servers.register_servers((http_server,), 30, 30)
    port = int(http_server.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:  # the server is still up; now take it down
        assert s.connect_ex(("127.0.0.1", port)) == 0
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"--http\x00" + str(port).encode() in cmdline:
            os.kill(pid, signal.SIGKILL)
    r, _ = rollout([turn(call("h_add", a=1, b=2)), turn("Never asked.")], (http_server,), tools=("h_add",), tool_timeout=10)
    assert (r.state, r.record.reason) == ("FAILED", "tool_unavailable")
    assert r.record.error == ("tool h_add cannot work: MCP server 'engine-test' could not start "
                              "(ConnectError: All connection attempts failed)")
