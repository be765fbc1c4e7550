"""A small MCP server written with the SDK, for the tests: `python mcp_server.py [--http PORT] [--pidfile F] [--prefix P]`.

Tools: `add` (sum two integers), `slow_echo` (answers after a while; writes the server's pid
first, so a test can kill it mid-call) and `Not-A-State` (a name that cannot be a state). The
SDK refuses to list an invalid input schema; `raw_mcp_server.py` lists some.
`--prefix` renames the tools, so two servers can be told apart.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from mcp.server.mcpserver import MCPServer


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

    @server.tool(name="Not-A-State", description="A name that cannot be a state.")
    def not_a_state() -> str:
        return ""

    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, default=None)
    parser.add_argument("--pidfile", default=None)
    parser.add_argument("--prefix", default="")
    ns = parser.parse_args()
    server = build(ns.prefix, ns.pidfile)
    if ns.http is not None:
        server.run("streamable-http", host="127.0.0.1", port=ns.http)
    else:
        server.run()
