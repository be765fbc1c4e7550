"""Figure 9: what a turn of a long rollout costs as the rollout grows, compacted under a 4k context.

S samples run T turns each through the engine's own loop (chat profile, `engine_compaction:
summarize`, a 4096-token context: the threshold is 3072) against the canned server, which answers
every request, the summaries included, with a short note and a call of `add` (answered at once
by the engine), until `engine_max_turns` ends the rollout. A rollout of T turns is compacted about
T/30 times, each compaction a summary request and a render of the kept conversation. Rows, at
T = 50 and T = 100 against the same at T = 10 measured in the same run (the floor):

- the engine process's CPU per model turn (process time beyond a one-turn pass's, over S x (T - 1),
  medians over the repeats);
- the peak traced memory per model turn (tracemalloc's peak over the pass, less what was traced
  before it, beyond a one-turn pass's, over S x (T - 1), in passes of their own: tracing slows
  the CPU pass). The closed segments
  stay with the rollout (they are its samples), so memory grows with the turns; per turn it stays
  flat: the open segment and the conversation kept for rendering are bounded by the threshold.
  A compaction adds a passing peak of its own (the render of a threshold's worth of conversation,
  the segment closed), the same for every compaction: at 50 turns the first one's is spread over
  fewer turns than at 100, so that row is shown for information and the longest is judged.

Flat per turn is a ratio near 1 (target <= 1.5): a cost growing with the rollout's length (a
render of the whole history, a copy of every closed segment per turn) shows as a ratio near T/10.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import tracemalloc
from typing import Any

from engine import tools
from engine.local.bench.agent import InstantAdd
from engine.local.bench.common import Figure, Sizes, median
from engine.local.bench.server import CannedServer, reply_body

SCENARIO = "long"
CONTEXT = 4096
NOTE = ("I add the next pair with the tool and keep the running total, so that the report at the end can give "
        "every partial sum in order; the tool's answer is checked against the one before it each time.")
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
PROMPT = [{"role": "user", "content": "Add 1 and 2 again and again, one call each time, for as long as you can."}]


def long_scenario(tokenizer: Any) -> dict[str, Any]:
    """A note and a call of `add` for every request (summaries too): `engine_max_turns` ends the rollout."""
    body = json.dumps(reply_body(tokenizer, f"{NOTE}\n{CALL}", eos=True))
    return {"turns": 10**9, "tool": body, "answer": body}


async def one_pass(server: CannedServer, tokenizer: Any, samples: int, turns: int, *, traced: bool) -> tuple[float, int]:
    """S samples of `turns` model turns at once: (CPU seconds or traced peak bytes, compactions per sample)."""
    from engine.loop.driver import drive, new_rollout
    from engine.loop.runtime import Runtime
    from engine.settings import EngineConfig, RetryPolicy

    cfg = EngineConfig(server_url=server.url(SCENARIO), profile="chat", max_context_len=CONTEXT, max_turns=turns,
                       max_tool_calls=turns, tools=("add",), compaction="summarize",
                       retry=RetryPolicy(max_attempts=2, base_delay=0.0, deadline=60.0))
    rt = Runtime.create(cfg, tokenizer=tokenizer)
    rollouts = [new_rollout(rt, PROMPT, {"max_new_tokens": 256}, routing_key=f"long-{turns}-{i}-{time.monotonic_ns()}")
                for i in range(samples)]
    gc.collect()
    if traced:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    started = time.process_time()
    try:
        await asyncio.gather(*(drive(rt, r) for r in rollouts))
        spent = time.process_time() - started
        measured = float(tracemalloc.get_traced_memory()[1] - base) if traced else spent
    finally:
        if traced:
            tracemalloc.stop()
        await rt.aclose()
    done = sum(r.turn_count for r in rollouts)
    if done != samples * turns or any(r.record.reason != "max_turns_reached" for r in rollouts):
        raise RuntimeError(f"the long rollouts took {done} turns, not {samples * turns}, or ended otherwise: "
                           f"{sorted({r.record.reason for r in rollouts})}")
    return measured, len(rollouts[0].closed)


async def long_figures(server: CannedServer, tokenizer: Any, sizes: Sizes) -> list[Figure]:
    """Figure 9's rows: CPU and peak memory per model turn at each of `sizes.long_turns` against the first.

    A turn's cost is a pass's beyond a one-turn pass of the same samples, over the turns beyond the
    first: what a rollout costs once (its first request and connection, its prompt) is not spread
    over its turns, which would make a short rollout's turns look dearer and hide a growing cost.
    """
    cpu: dict[int, list[float]] = {t: [] for t in sizes.long_turns}
    memory: dict[int, float] = {}
    compactions: dict[int, int] = {}
    with tools.registry.registered(InstantAdd()):
        for _ in range(sizes.repeats):
            once, _ = await one_pass(server, tokenizer, sizes.long_samples, 1, traced=False)
            for t in sizes.long_turns:
                spent, compactions[t] = await one_pass(server, tokenizer, sizes.long_samples, t, traced=False)
                cpu[t].append((spent - once) / (sizes.long_samples * (t - 1)))
        once, _ = await one_pass(server, tokenizer, sizes.long_samples, 1, traced=True)
        for t in sizes.long_turns:
            peak, _ = await one_pass(server, tokenizer, sizes.long_samples, t, traced=True)
            memory[t] = (peak - once) / (sizes.long_samples * (t - 1))
    base, *longer = sizes.long_turns
    us, kib = 1e6, 1 / 1024
    rows = []
    for t in longer:
        notes = {"compactions": compactions[t], "floor_compactions": compactions[base],
                 "cpu_us": [round(x * us, 1) for x in cpu[t]], "floor_cpu_us": [round(x * us, 1) for x in cpu[base]]}
        rows.append(Figure(f"long_turn_cpu_{t}", f"CPU per turn of a {t}-turn rollout compacted {compactions[t]}x "
                           f"under a {CONTEXT}-token context ({sizes.long_samples} samples)", median(cpu[t]) * us, "us",
                           median(cpu[base]) * us, f"the same at {base} turns", "ratio", "<=", 1.5, sizes.repeats, notes))
    for t in longer:
        judged = t == longer[-1]  # a shorter one carries the first compaction's peak over fewer turns
        rows.append(Figure(f"long_turn_memory_{t}", f"peak memory per turn of a {t}-turn rollout, its closed segments "
                           "kept", memory[t] * kib, "KiB", memory[base] * kib, f"the same at {base} turns",
                           "ratio" if judged else None, "<=" if judged else None, 1.5 if judged else None, 1,
                           {"compactions": compactions[t]}))
    return rows
