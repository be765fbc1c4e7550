"""The sandbox host: a process a Ray sandbox worker starts to run `run_python` for it.

Why a process of its own, between the worker and the sandboxes: a worker can die at any
moment (its node lost, the actor killed), and a process killed with SIGKILL cleans up
nothing. The sandboxes it started run in sessions of their own, out of reach of Ray's
cleanup of the worker, and a sleeping program would run on forever. The host detaches
(no child of the worker, in a session of its own, so Ray's cleanup of the worker's children
and process group misses it), outlives the worker, sees its end of the socket close,
cancels every run (the sandbox's own cleanup then kills what each run left) and exits.
So nothing a call started outlives the worker by more than that cleanup.

The protocol, one JSON object per line over a socket pair:

    host -> worker   {"pid": n}                          once, first: the host's process id
    worker -> host   {"id": n, "code": str, "limits": {SandboxLimits fields}, "stdin": base64 | null}
                     {"cancel": n}
    host -> worker   {"id": n, "result": {SandboxResult fields}}
                     {"id": n, "error": "sandbox" | "internal", "message": str}

    python -m engine.sandbox.host FD     # FD: the host's end of the socket pair
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import sys
from typing import Any

import attrs

from engine.sandbox.runner import SandboxError, SandboxLimits, network_isolated, run_python

LINE_LIMIT = 1 << 26  # one request or reply; code and capped output are far smaller
CLEANUP_S = 60.0  # the most the host waits for cancelled runs to clean up before it exits


def encode(message: dict[str, Any]) -> bytes:
    """One protocol line."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def request(call_id: int, code: str, limits: dict[str, Any], stdin: bytes | None) -> bytes:
    """The line asking the host to run `code`."""
    data = base64.b64encode(stdin).decode() if stdin is not None else None
    return encode({"id": call_id, "code": code, "limits": limits, "stdin": data})


async def _run_one(message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
    call_id = message["id"]
    try:
        limits = SandboxLimits(**message["limits"])
        stdin = base64.b64decode(message["stdin"]) if message.get("stdin") is not None else None
        result = await run_python(message["code"], limits, stdin=stdin)
        reply = {"id": call_id, "result": attrs.asdict(result)}
    except SandboxError as exc:
        reply = {"id": call_id, "error": "sandbox", "message": str(exc)}
    except Exception as exc:  # a bad request or a bug here: the worker answers the call with it
        reply = {"id": call_id, "error": "internal", "message": f"{type(exc).__name__}: {exc}"}
    try:
        writer.write(encode(reply))
        await writer.drain()
    except (ConnectionError, RuntimeError):
        pass  # the worker is gone; the run is over and cleaned up all the same


async def serve(sock: socket.socket) -> None:
    """Run requests until the worker's end closes, then cancel every run and let it clean up."""
    reader, writer = await asyncio.open_connection(sock=sock, limit=LINE_LIMIT)
    runs: dict[int, asyncio.Task[None]] = {}
    try:
        while line := await reader.readline():
            message = json.loads(line)
            if "cancel" in message:
                task = runs.get(message["cancel"])
                if task is not None:
                    task.cancel()
                continue
            task = asyncio.create_task(_run_one(message, writer))
            runs[message["id"]] = task
            task.add_done_callback(lambda _t, call_id=message["id"]: runs.pop(call_id, None))
    except (ConnectionError, ValueError):
        pass  # a reset or an oversized line: treated as the worker's end
    finally:
        for task in list(runs.values()):
            task.cancel()
        # The runs' cleanups are shielded tasks of their own: wait for every task, not just the runs.
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=CLEANUP_S)
        writer.close()


def detach() -> None:
    """Fork; the first process exits, the second goes on in a session of its own.

    So the host is no child of the worker: Ray, killing a worker, kills its child processes too,
    and the host must live on to clean up after it. (Its parent is then init, which reaps it.)
    """
    if os.fork():
        os._exit(0)
    os.setsid()


def main(argv: list[str]) -> int:
    """Entry point: detach, probe the sandbox, say hello with our pid, serve the socket end numbered `argv[0]`."""
    sock = socket.socket(fileno=int(argv[0]))
    detach()
    try:
        network_isolated()  # the sandbox probes the kernel once: now, so that no call waits for it
    except SandboxError:
        pass  # every run reports it, as a local run would
    sock.sendall(encode({"pid": os.getpid()}))
    asyncio.run(serve(sock))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
