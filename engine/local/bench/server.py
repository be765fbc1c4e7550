"""A loopback `/generate` server that answers at once with canned replies, run as a subprocess.

Why a subprocess and not the benchmark's own event loop or a thread: on 2 cores, a server
in the same process would share the client's GIL (and, in-process, its event loop), so
its per-request CPU would be added to the engine's and to the floor's alike. That pads
both denominators with the same constant, pulls the ratio towards 1 (flattering the
engine), pollutes "engine CPU per turn" with server work, and (thread) adds GIL hand-off
latency to the stall figure. In a subprocess the server has its own interpreter and can
run on the other core; the client process's CPU time is then the client's alone. The
server's own CPU use is sampled from /proc so a report can tell whether it, rather than
the client, was the bottleneck.

The server is stateless but for one counter per sample: the n-th request carrying a
routing key (`X-SMG-Routing-Key`, which the engine sends as the sample's session id) gets
the scenario's tool turn while n < turns, and the final answer at n == turns. Scenarios
are addressed by path (`/<scenario>/generate`), since the engine appends `/generate` to
its server URL. Request bodies are read but not parsed: both sides send the same bytes,
and a server that never becomes the bottleneck is what makes the floor a floor.

    python -m engine.local.bench.server   # reads one JSON line of scenarios on stdin, prints "PORT <n>"
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROUTING_HEADER = "X-SMG-Routing-Key"
IM_END = 151645  # Qwen3 <|im_end|>


def reply_body(tokenizer: Any, text: str, *, eos: bool, matched: str | None = None) -> dict[str, Any]:
    """A `/generate` 200 body as SGLang 0.5.x writes it, for the tokens of `text` (+ <|im_end|>)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([IM_END] if eos else [])
    logprobs = [-((i * 7) % 97 + 1) / 64 for i in range(len(ids))]  # exact in binary, all < 0
    return {
        "text": tokenizer.decode(ids),
        "output_ids": ids,
        "meta_info": {
            "id": "bench",
            "finish_reason": {"type": "stop", "matched": IM_END if eos else matched},
            "prompt_tokens": 0,
            "weight_version": "default",
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "e2e_latency": 0.0,
            "input_token_logprobs": [],
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids)],
            "output_token_logprobs_length": len(ids),
        },
    }


def scenario(tokenizer: Any, turns: int, code: str, answer: str = "1") -> dict[str, Any]:
    """A scenario: `turns - 1` turns that run `code`, then `Answer: \\boxed{answer}`."""
    thinking = "Let me check this step by step with a short computation before answering. " * 2
    tool = reply_body(tokenizer, f"{thinking}\n<code>{code}</code>", eos=False, matched="</code>")
    final = reply_body(tokenizer, f"The computation confirms it.\nAnswer: \\boxed{{{answer}}}", eos=True)
    return {"turns": turns, "tool": json.dumps(tool), "answer": json.dumps(final)}


class CannedServer:
    """Starts the server subprocess; `url(name)` is the engine's server URL for a scenario."""

    def __init__(self, scenarios: dict[str, dict[str, Any]]) -> None:
        self.scenarios = scenarios
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def __enter__(self) -> CannedServer:
        # The child must import this package from wherever the parent did, whatever its cwd.
        root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.local.bench.server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(self.scenarios).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().decode()
        if not line.startswith("PORT "):
            self.__exit__(None, None, None)
            raise RuntimeError(f"canned server did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    def __exit__(self, *exc: Any) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF on stdin is the server's signal to stop
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def url(self, scenario_name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{scenario_name}"

    def cpu_seconds(self) -> float:
        """The server process's user + system CPU so far (to tell if it was the bottleneck)."""
        if self.proc is None:
            return 0.0
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _serve(scenarios: dict[str, dict[str, Any]]) -> None:
    from aiohttp import web

    bodies = {name: (int(s["turns"]), s["tool"].encode(), s["answer"].encode()) for name, s in scenarios.items()}
    counts: dict[tuple[str, str], int] = {}

    async def generate(request: web.Request) -> web.Response:
        name = request.match_info["scenario"]
        turns, tool, answer = bodies[name]
        await request.read()
        key = (name, request.headers.get(ROUTING_HEADER, ""))
        n = counts.get(key, 0) + 1
        if n >= turns:
            counts.pop(key, None)
            body = answer
        else:
            counts[key] = n
            body = tool
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/{scenario}/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=8192)  # thousands of connects may arrive at once
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"PORT {port}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await runner.cleanup()


def main() -> None:
    scenarios = json.loads(sys.stdin.readline())
    asyncio.run(_serve(scenarios))


if __name__ == "__main__":
    main()
