"""The test MCP server (`mcp_server.py`) over streamable HTTP on 127.0.0.1, as a context manager."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

SERVER = Path(__file__).resolve().parent / "mcp_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_mcp_server(*options: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start it with these options (`--prefix h_`, `--token-env NAME`); yields its URL; kills its group after."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port), *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise RuntimeError("the HTTP MCP server exited at start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
