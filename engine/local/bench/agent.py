"""Figure 8: what an agent's call costs as its history grows, and next to the engine's own loop.

S sessions make T calls each in lockstep rounds, every call carrying the whole history; the
canned server answers each with a tool call of `add`, then the answer. The engine's process
reads its own CPU time at the end of each round: a call's CPU at round k is that round's CPU
over S. Rows:

- the sessions' CPU per call at turn 50 against turn 5 (medians of rounds 48-52 and 3-7), the
  calls handed to `Sessions.call` in process: the history is matched, but nothing of it is
  rendered or tokenized again, so a call costs about the same at any length (target <= 1.5x;
  slime #2285 re-tokenizes the whole history every call);
- the same through the real front door over HTTP, driven by a harness subprocess
  (`engine.local.bench.agent_harness`: its own work is not the engine's): the protocol's JSON
  holds the whole history, and the door reads of it only what the call adds (what it read last
  time is kept with the session), so this too is judged (target <= 1.5x);
- the front door's CPU per turn against the engine's own loop on the same sessions (the same
  model turns, the `add` tool run by the engine instead of the harness): what serving a
  harness adds (HTTP, the protocol, matching the history), for information.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from engine import tools
from engine.local.bench.common import Figure, Sizes, median
from engine.local.bench.server import CannedServer, reply_body

SCENARIO = "agent"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
EARLY, LATE = 5, 50  # the turns compared
SPAN = 2  # rounds either side of each, in its median: one round of a few sessions is a few ms of CPU


class InstantAdd(tools.Tool):
    """`add`, answered at once: the engine's own loop runs it where the harness would."""

    name = "add"
    description = "Add two integers."
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}

    async def execute(self, state: Any, **arguments: Any) -> str:
        return "3"


def agent_scenario(tokenizer: Any, turns: int) -> dict[str, Any]:
    """`turns - 1` calls of `add`, then the answer, as Qwen3 writes them (hermes calls)."""
    return {"turns": turns, "tool": json.dumps(reply_body(tokenizer, CALL, eos=True)),
            "answer": json.dumps(reply_body(tokenizer, "The sum is 3.", eos=True))}


def _config(server: CannedServer, sizes: Sizes, **kw: Any) -> Any:
    from engine.settings import EngineConfig, RetryPolicy

    return EngineConfig(server_url=server.url(SCENARIO), profile="chat", max_context_len=1 << 20,
                        max_turns=sizes.agent_turns + 2, max_tool_calls=sizes.agent_turns + 2, tools=("add",),
                        retry=RetryPolicy(max_attempts=2, base_delay=0.0, deadline=60.0), **kw)


async def door_side(server: CannedServer, tokenizer: Any, sizes: Sizes) -> tuple[list[float], float]:
    """One pass through the front door: each round's CPU per call, and the CPU per turn over all."""
    from engine.agent.serving import close_served, served
    from engine.loop.runtime import Runtime

    rt = Runtime.create(_config(server, sizes, agent="bench"), tokenizer=tokenizer)
    door = await served(rt)
    sessions = [door.sessions.open(sampling_params={"max_new_tokens": 256}, routing_key=f"door-{i}")
                for i in range(sizes.agent_sessions)]
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "engine.local.bench.agent_harness",
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    spec = {"urls": [door.door.session_url(s.key) for s in sessions], "turns": sizes.agent_turns,
            "tools": [InstantAdd().schema()]}
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    await proc.stdin.drain()
    marks = [time.process_time()]
    try:
        while (line := (await proc.stdout.readline()).decode().strip()) != "DONE":
            if not line.startswith("ROUND"):
                raise RuntimeError(f"the benchmark's harness stopped: {line or 'no output'}")
            marks.append(time.process_time())
    finally:
        for s in sessions:
            s.end("harness_finished")
        await asyncio.gather(*(s.finished() for s in sessions))
        await proc.wait()
        await close_served(rt)
        await rt.aclose()
    per_call = [(b - a) / len(sessions) for a, b in zip(marks, marks[1:])]
    return per_call, (marks[-1] - marks[0]) / (len(sessions) * sizes.agent_turns)


async def session_side(server: CannedServer, tokenizer: Any, sizes: Sizes) -> list[float]:
    """One pass of the same sessions handed to the sessions directly (no HTTP, no protocol): each
    round's CPU per call of what the engine does with a call (match, render, the turn)."""
    from engine.agent.calls import Message, ModelAnswer, ModelCall
    from engine.agent.sessions import AgentSessions
    from engine.local.bench.agent_harness import SYSTEM, TASK
    from engine.loop.runtime import Runtime

    rt = Runtime.create(_config(server, sizes, agent="bench"), tokenizer=tokenizer)
    sessions = AgentSessions(rt)
    opened = [sessions.open(sampling_params={"max_new_tokens": 256}, routing_key=f"direct-{i}")
              for i in range(sizes.agent_sessions)]
    histories = [[Message("system", SYSTEM), Message("user", TASK)] for _ in opened]
    offered = (InstantAdd().schema(),)

    async def call(key: str, history: list[Message]) -> None:
        answer = await sessions.call(key, ModelCall(tuple(history), offered))
        if not isinstance(answer, ModelAnswer):
            raise RuntimeError(f"a session refused a call: {answer}")
        history.append(Message("assistant", answer.text, reasoning=answer.reasoning, calls=answer.calls))
        history.extend(Message("tool", "3", call_id=c.id) for c in answer.calls)

    marks = [time.process_time()]
    try:
        for _ in range(sizes.agent_turns):
            await asyncio.gather(*(call(s.key, h) for s, h in zip(opened, histories)))
            marks.append(time.process_time())
    finally:
        for s in opened:
            s.end("harness_finished")
        await asyncio.gather(*(s.finished() for s in opened))
        await rt.aclose()
    return [(b - a) / len(opened) for a, b in zip(marks, marks[1:])]


async def loop_side(server: CannedServer, tokenizer: Any, sizes: Sizes) -> float:
    """The same sessions' turns through the engine's own loop (its tool runs `add`): CPU per turn."""
    from engine.loop.driver import drive, new_rollout
    from engine.loop.runtime import Runtime

    with tools.registry.registered(InstantAdd()):
        rt = Runtime.create(_config(server, sizes), tokenizer=tokenizer)
        from engine.local.bench.agent_harness import SYSTEM, TASK

        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        rollouts = [new_rollout(rt, prompt, {"max_new_tokens": 256}, routing_key=f"loop-{i}")
                    for i in range(sizes.agent_sessions)]
        started = time.process_time()
        try:
            await asyncio.gather(*(drive(rt, r) for r in rollouts))
        finally:
            await rt.aclose()
        spent = time.process_time() - started
    turns = sum(r.turn_count for r in rollouts)
    if turns != sizes.agent_sessions * sizes.agent_turns:
        raise RuntimeError(f"the engine's loop took {turns} turns, not {sizes.agent_sessions * sizes.agent_turns}")
    return spent / turns


def around(per_call: list[float], turn: int) -> float:
    """The median of the rounds within `SPAN` of `turn` (round k at index k - 1)."""
    return median(per_call[max(turn - 1 - SPAN, 0):turn + SPAN])


async def agent_figures(server: CannedServer, tokenizer: Any, sizes: Sizes) -> list[Figure]:
    """Figure 8's rows, medians over `sizes.repeats` passes of each side."""
    early, late, door_early, door_late, door, loop = [], [], [], [], [], []
    for _ in range(sizes.repeats):
        per_call = await session_side(server, tokenizer, sizes)
        early.append(around(per_call, EARLY))
        late.append(around(per_call, LATE))
        per_call, per_turn = await door_side(server, tokenizer, sizes)
        door_early.append(around(per_call, EARLY))
        door_late.append(around(per_call, LATE))
        door.append(per_turn)
        loop.append(await loop_side(server, tokenizer, sizes))
    shape = f"{sizes.agent_sessions} sessions x {sizes.agent_turns} calls"
    us = 1e6
    return [
        Figure("agent_call_cpu_growth", f"sessions' CPU per call at turn {LATE} ({shape})", median(late) * us, "us",
               median(early) * us, f"the same at turn {EARLY}", "ratio", "<=", 1.5, sizes.repeats),
        Figure("agent_door_call_growth", f"front door's CPU per call at turn {LATE}, the protocol's whole history "
               "sent each call", median(door_late) * us, "us", median(door_early) * us, f"the same at turn {EARLY}",
               "ratio", "<=", 1.5, sizes.repeats),
        Figure("agent_turn_cpu", f"front door's CPU per turn, against the engine's own loop ({shape})", median(door) * us,
               "us", median(loop) * us, "the engine's own loop, same turns", None, None, None, sizes.repeats,
               {"door_us": [round(x * us, 1) for x in door], "loop_us": [round(x * us, 1) for x in loop]}),
    ]
