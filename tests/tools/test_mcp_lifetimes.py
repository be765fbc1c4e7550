"""Hostile MCP servers, as real subprocesses: one that ignores SIGTERM and stops answering, one
stopped with SIGSTOP behind a wrapper (`sh -c`), one whose call hangs while other samples call it.
Each sample ends within the tool timeout plus the shutdown; no process of a server is left (read
from /proc); Ctrl-C of `python -m engine run` is answered at once; a loop never closed leaves no
server behind (the atexit backstop)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'fsm-rollout-engine[mcp]')")

from engine.settings import EngineConfig, RetryPolicy  # noqa: E402
from engine.loop.driver import drive, new_rollout  # noqa: E402
from engine.loop.runtime import Runtime  # noqa: E402
from engine.machine.rollout import Rollout  # noqa: E402
from engine.tools import mcp_servers  # noqa: E402
from engine.tools.mcp_connection import SHUTDOWN_SECONDS, Connection  # noqa: E402
from engine.tools.mcp_spec import ServerSpec  # noqa: E402
from tests.conftest import run  # noqa: E402
from tests.support.helpers import SAMPLING, URL, tok, turn  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVER_PY = ROOT / "tests" / "support" / "mcp_server.py"
SLACK = 3.0  # seconds a loaded test machine may add to a bound


@pytest.fixture(autouse=True)
def forget_servers() -> Any:
    yield
    mcp_servers.unregister_servers()


@pytest.fixture
def tag() -> str:
    """A mark put on the command line of every process of one server (its wrapper's included)."""
    return f"fsm-test-{uuid.uuid4().hex[:12]}"


def tagged(tag: str) -> list[int]:
    """The live processes (zombies aside) whose command line carries `tag`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def scripts_by_prompt(scripts: dict[str, list[str]]) -> Any:
    """A `/generate` side effect for several samples at once: the prompt names the sample, and the
    tool results already in its input say which turn it is at."""
    def answer(request: httpx.Request) -> httpx.Response:
        text = tok().decode(json.loads(request.content)["input_ids"])
        sample = next(k for k in scripts if f"Sample {k}." in text)
        return turn(scripts[sample][text.count("<tool_response>")])

    return answer


def roll_out(scripts: dict[str, list[str]], spec: Any, *, during: Any = None, **kw: Any) -> dict[str, Rollout]:
    cfg = EngineConfig(server_url=URL, profile="chat", max_context_len=8192, retry=RetryPolicy(max_attempts=1),
                       plugin_settings=[mcp_servers.McpSettings(servers=(spec,))], **kw)

    async def go() -> dict[str, Rollout]:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=scripts_by_prompt(scripts))
            rt = Runtime.create(cfg, tokenizer=tok())
            rollouts = {k: new_rollout(rt, [{"role": "user", "content": f"Sample {k}."}], SAMPLING) for k in scripts}
            try:
                tasks = [asyncio.ensure_future(drive(rt, r)) for r in rollouts.values()]
                if during is not None:
                    await during()
                await asyncio.gather(*tasks)
            finally:
                await rt.aclose()
            return rollouts

    rollouts = run(go())
    for r in rollouts.values():
        r.traj.check(full=True, max_total_length=r.token_budget)
    return rollouts


async def wait_for(path: Path, seconds: float = 60) -> int:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} never written"
        await asyncio.sleep(0.02)
    return int(path.read_text())


def test_a_hung_server_that_ignores_sigterm_is_killed_within_the_timeout_plus_shutdown(tmp_path, tag):
    pidfile = tmp_path / "pid"
    spec = {"name": "frozen", "command": [sys.executable, str(SERVER_PY), "--ignore-term", "--pidfile", str(pidfile), "--tag", tag]}
    rollouts = roll_out({"a": [call("freeze"), "Never asked."]}, spec, tools=("freeze",), tool_timeout=8)
    r = rollouts["a"]
    assert (r.state, r.record.reason) == ("FAILED", "tool_unavailable")
    assert r.record.error == "tool freeze cannot work: MCP server 'frozen' did not answer within 8 seconds"
    assert r.record.tools.seconds < 8 + SHUTDOWN_SECONDS + SLACK
    assert tagged(tag) == []


def test_a_server_stopped_behind_a_wrapper_is_killed_with_its_wrapper(tmp_path, tag):
    pidfile = tmp_path / "pid"
    shell = f"{sys.executable} {SERVER_PY} --pidfile {pidfile} --tag {tag}; exit 0"  # sh stays: the server is its child
    stopped: list[int] = []

    async def stop_the_server() -> None:
        pid = await wait_for(pidfile)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    rollouts = roll_out({"a": [call("slow_echo", text="hi", seconds=2), "Never asked."]}, {"command": ["sh", "-c", shell]},
                        during=stop_the_server, tools=("slow_echo",), tool_timeout=8)
    r = rollouts["a"]
    assert (r.state, r.record.reason) == ("FAILED", "tool_unavailable")
    assert r.record.error == "tool slow_echo cannot work: MCP server 'engine-test' did not answer within 8 seconds"
    assert r.record.tools.seconds < 8 + SHUTDOWN_SECONDS + SLACK
    assert stopped and tagged(tag) == []  # the stopped server and the sh above it


def test_a_hung_call_ends_its_sample_while_the_other_samples_calls_are_answered(tmp_path, tag):
    """One sample's call never returns; three others call the same server before, during and after
    its timeout. The server answers a ping, so it is not ended: their calls are all answered."""
    pidfile = tmp_path / "pid"
    scripts = {
        "hang": [call("slow_echo", text="forever", seconds=3600), "Never asked."],
        "b": [call("slow_echo", text="b1", seconds=12), call("slow_echo", text="b2", seconds=12), "Done."],
        "c": [call("add", a=1, b=2), call("slow_echo", text="c2", seconds=14), "Done."],
        "d": [call("slow_echo", text="d1", seconds=4), call("add", a=3, b=4), "Done."],
    }
    spec = [sys.executable, str(SERVER_PY), "--pidfile", str(pidfile), "--tag", tag]
    rollouts = roll_out(scripts, {"command": spec}, tools=("slow_echo", "add"), tool_timeout=20)
    hung = rollouts.pop("hang")
    assert (hung.state, hung.record.reason) == ("FAILED", "tool_unavailable")
    assert hung.record.error == "tool slow_echo cannot work: MCP server 'engine-test' did not answer within 20 seconds"
    assert hung.record.tools.seconds < 20 + SHUTDOWN_SECONDS + SLACK
    answers = {k: re.findall(r"<tool_response>\n(.*?)\n</tool_response>", tok().decode(r.traj.response_ids.tolist()))
               for k, r in rollouts.items()}
    assert answers == {"b": ["echo: b1", "echo: b2"], "c": ["3", "echo: c2"], "d": ["echo: d1", "7"]}
    assert all(r.state == "COMPLETED" for r in rollouts.values())
    assert tagged(tag) == []


def test_ctrl_c_of_a_run_waiting_on_a_hung_server_is_answered_at_once(tmp_path, tag):
    pidfile = tmp_path / "pid"
    (tmp_path / "replay.jsonl").write_text(json.dumps({"prompt": "Freeze the server.", "turns": [call("freeze"), "Done."]}) + "\n")
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Freeze the server."}) + "\n")
    server = f"{sys.executable} {SERVER_PY} --ignore-term --pidfile {pidfile} --tag {tag}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "run", "--profile", "chat", "--replay", str(tmp_path / "replay.jsonl"),
         "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--no-progress",
         "--mcp-server", server, "--tool-timeout", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        while not pidfile.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pidfile.exists(), proc.communicate(timeout=60)[0]
        time.sleep(0.5)  # the call is in flight, the server frozen
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            printed, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say what the run was doing, not only that it hung
            proc.send_signal(signal.SIGKILL)
            raise AssertionError(f"the run did not stop within 60 s of Ctrl-C; it printed: {proc.communicate()[0][-3000:]}") from None
        answered = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, printed
    assert "interrupted" in printed
    assert answered < 2.0, f"Ctrl-C took {answered:.2f} s"
    assert tagged(tag) == []


def test_a_daemon_that_escapes_the_group_holding_stdout_leaves_no_descriptor_in_the_engine(tag):
    """A setsid daemon cannot be held by a process-group kill (docs/mcp.md says so); what the engine
    can hold is itself: each start of the server costs no descriptor once that start has ended."""
    spec = ServerSpec.parse({"command": [sys.executable, str(SERVER_PY), "--daemon", "--tag", tag]})

    async def starts(n: int) -> list[int]:
        held = []
        for _ in range(n):
            conn = Connection(spec)
            result = await conn.call("add", {"a": 1, "b": 2}, 60)
            assert result.content[0].text == "3"
            await conn.close()
            held.append(len(os.listdir("/proc/self/fd")))
        return held

    try:
        held = run(starts(4))
        escaped = [pid for pid in tagged(tag) if b"escaped-" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(escaped) == 4 and sorted(escaped) == sorted(tagged(tag))  # the servers are gone, their daemons not
        assert held[-1] == held[0], held  # before: one more pipe (and its transport) per start
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


ATEXIT_SCRIPT = """
import asyncio, sys
from engine.tools.mcp_connection import Connection
from engine.tools.mcp_spec import ServerSpec

async def main():
    conn = Connection(ServerSpec.parse({"command": sys.argv[2:]}))
    task = asyncio.ensure_future(conn.call("freeze", {}, 600))
    await asyncio.wait([task], timeout=float(sys.argv[1]))

loop = asyncio.new_event_loop()
loop.run_until_complete(main())
print("leaving with the loop open", flush=True)
"""


def test_a_loop_never_closed_leaves_no_server_behind(tmp_path, tag):
    """The frozen server ignores SIGTERM and never reads its closed stdin: only a kill ends it."""
    pidfile = tmp_path / "pid"
    script = tmp_path / "leave.py"
    script.write_text(ATEXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), "15", sys.executable, str(SERVER_PY), "--ignore-term",
                           "--pidfile", str(pidfile), "--tag", tag],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "leaving with the loop open" in done.stdout, done.stderr
    assert pidfile.exists()  # the server was frozen mid-call when the interpreter left
    deadline = time.monotonic() + 5
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tagged(tag) == []
