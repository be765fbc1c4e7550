"""A small MCP server written with the SDK, for the tests.

    python mcp_server.py [--http PORT [--token-env NAME]] [--pidfile F] [--prefix P] [--ignore-term] [--tag T] [--daemon]

Tools: `add` (sum two integers), `slow_echo` (answers after a while; writes the server's pid
to `--pidfile` first, so a test can kill or stop it mid-call), `freeze` (writes it too, then blocks
the server's whole event loop: it answers nothing more, a ping included), `crash` (the server exits with
status 3 mid-call), `fail` (the tool's own error: an `isError` result), `big` (a text of so many MiB), `key_length` (the
length of the API_KEY it was given, never the key) and `Not-A-State` (a name that cannot be a
state). The SDK refuses to list an invalid input schema; `raw_mcp_server.py` lists some.
`--prefix` renames the tools, so two servers can be told apart; `--ignore-term` makes it ignore
SIGTERM (a hung server that only SIGKILL ends); `--tag` only marks its command line, so a test
can find every process it left; `--json-response` answers each HTTP request with one JSON body, not an event stream;
`--daemon` starts a process that leaves the server's process
group (a session of its own) holding the server's stdout, marked `escaped-<tag>`. Over HTTP, `--token-env NAME` refuses (401) every request
without `Authorization: Bearer <the value of NAME>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def build(prefix: str, pidfile: str | None) -> MCPServer:
    server = MCPServer("engine-test")

    @server.tool(name=f"{prefix}add", description="Add two integers.")
    def add(a: int, b: int) -> str:
        return str(a + b)

    @server.tool(name=f"{prefix}slow_echo", description="Echo a text after some seconds.")
    async def slow_echo(text: str, seconds: float) -> str:
        if pidfile:
            with open(pidfile, "w") as f:
                f.write(str(os.getpid()))
        await asyncio.sleep(seconds)
        return f"echo: {text}"

    @server.tool(name=f"{prefix}freeze", description="Stop answering anything.")
    async def freeze() -> str:
        if pidfile:
            with open(pidfile, "w") as f:
                f.write(str(os.getpid()))
        time.sleep(3600)  # on the event loop: no request is read or answered any more
        return "thawed"

    @server.tool(name=f"{prefix}crash", description="Exit mid-call.")
    async def crash() -> str:
        os._exit(3)

    @server.tool(name=f"{prefix}fail", description="Fail with the tool's own error.")
    def fail(reason: str) -> str:
        raise ToolError(f"cannot do that: {reason}")

    @server.tool(name=f"{prefix}key_length", description="How long the API key this server was given is.")
    def key_length() -> str:
        return str(len(os.environ.get("API_KEY", "")))

    @server.tool(name=f"{prefix}big", description="A text of so many MiB.")
    def big(mib: int) -> str:
        return "y" * (mib << 20)

    @server.tool(name="Not-A-State", description="A name that cannot be a state.")
    def not_a_state() -> str:
        return ""

    return server


def guarded(app: Any, token: str) -> Any:
    """`app`, refusing any HTTP request without the bearer token."""
    expected = f"Bearer {token}".encode()

    async def guard(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != expected:
            await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"unauthorized"})
            return
        await app(scope, receive, send)

    return guard


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None)
    parser.add_argument("--pidfile", default=None)
    parser.add_argument("--prefix", default="")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--token-env", default=None)
    parser.add_argument("--daemon", action="store_true")
    parser.add_argument("--json-response", action="store_true")
    ns = parser.parse_args()
    if ns.daemon:
        import subprocess
        import sys

        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"escaped-{ns.tag}"],
                         start_new_session=True, stdin=subprocess.DEVNULL)
    if ns.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = build(ns.prefix, ns.pidfile)
    if ns.http is not None and ns.token_env:
        import uvicorn

        uvicorn.run(guarded(server.streamable_http_app(), os.environ[ns.token_env]), host="127.0.0.1", port=ns.http,
                    log_level="warning")
    elif ns.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=ns.http, json_response=ns.json_response)
    else:
        server.run()
