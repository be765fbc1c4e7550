"""Figures 3 and 4: the real code-interpreter sandbox, through the engine and call by call.

Figure 3 drives K samples through the engine against the canned server; each of their
M tool turns runs `time.sleep(s)` in the real sandbox under the engine's shared tool
slots, so the wall time includes everything a tool turn costs (sandbox start, uid
lease, cleanup, the engine's bookkeeping). The ideal is `M * s * ceil(K / slots)`.

Figure 4 times single `print(1)` runs through the registered `code_interpreter` tool,
next to the cost of starting the interpreter at all (`python -c pass`, `python -I -c pass`)
spawned the same way (asyncio subprocess). The three kinds are interleaved run by run, so
a noisy moment on the shared machine hits all of them, not one.
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import subprocess
import sys
import time
from typing import Any

import tools
from engine.local.bench.common import Figure, Sizes, median, percentile
from engine.local.bench.rollout import bench_config, run_engine
from engine.local.bench.server import CannedServer
from engine.loop.runtime import Runtime


def sleep_code(seconds: float) -> str:
    return f"import time\ntime.sleep({seconds})"


async def tool_concurrency_figure(server: CannedServer, tokenizer: Any, sizes: Sizes) -> Figure:
    """Figure 3: wall time of K samples x M sandboxed sleeps against the ideal schedule."""
    k, m, s, slots = sizes.tool_samples, sizes.tool_calls, sizes.tool_sleep, sizes.tool_concurrency
    cfg = bench_config(server.url("sleep"), turns=m + 1, connections=max(k, 1), tool_concurrency=slots)
    ideal = m * s * math.ceil(k / slots)
    tool = tools.get("code_interpreter")
    if tool is None or type(tool).__name__ != "CodeInterpreter":
        raise RuntimeError(f"figure 3 needs the real code_interpreter, found {tool!r}")
    walls: list[float] = []
    child_cpu: list[float] = []  # CPU of the reaped sandbox processes, per call
    statuses: dict[str, int] = {}
    tool_errors = 0
    rt = Runtime.create(cfg, tokenizer=tokenizer)
    try:
        await run_engine(rt, server, 1, 1, "sleep-warm")  # sandbox capability probe, pool, machine
        for i in range(sizes.repeats):
            before = _children_cpu()
            run = await run_engine(rt, server, k, k, f"sleep-{i}")
            child_cpu.append((_children_cpu() - before) / max(k * m, 1))
            walls.append(run.wall)
            statuses, tool_errors = run.statuses, tool_errors + run.tool_errors
    finally:
        await rt.aclose()
    return Figure(
        "tool_concurrency", f"tool concurrency: {k} samples x {m} sandbox calls x {s:g} s, {slots} slots",
        median(walls), "s", ideal, "ideal M*s*ceil(K/slots)", "ratio", "<=", 1.5, sizes.repeats,
        {"statuses": statuses, "tool_errors": tool_errors, "walls_s": [round(w, 3) for w in walls],
         "overhead_per_round_s": (median(walls) - ideal) / max(m * math.ceil(k / slots), 1),
         "sandbox_cpu_ms_per_call": median(child_cpu) * 1e3,
         # No schedule beats the CPU the sandboxes need, spread over every core.
         "cpu_bound_s": max(ideal, median(child_cpu) * k * m / (os.cpu_count() or 1))},
    )


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def _spawn(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    if await proc.wait() != 0:
        raise RuntimeError(f"{args} exited {proc.returncode}")


async def sandbox_latency_figure(sizes: Sizes) -> Figure:
    """Figure 4: p50/p99 of `print(1)` in the sandbox next to bare interpreter start-up."""
    tool = tools.get("code_interpreter")
    if tool is None:
        raise RuntimeError("no code_interpreter registered")

    async def sandboxed() -> None:
        result = await tool.execute(None, code="print(1)")
        text = getattr(result, "text", result)
        if text != "Output:\n1":
            raise RuntimeError(f"sandboxed print(1) gave {text!r}")

    kinds = {
        "sandbox": sandboxed,
        "python -c pass": lambda: _spawn(sys.executable, "-c", "pass"),
        "python -I -c pass": lambda: _spawn(sys.executable, "-I", "-c", "pass"),
    }
    times: dict[str, list[float]] = {name: [] for name in kinds}
    await sandboxed()  # first run probes the kernel's namespaces once
    for _ in range(sizes.sandbox_runs):
        for name, run in kinds.items():
            started = time.perf_counter()
            await run()
            times[name].append(time.perf_counter() - started)
    ms = {name: (percentile(t, 50) * 1e3, percentile(t, 99) * 1e3) for name, t in times.items()}
    notes = {f"{name} p50/p99 ms": [round(p50, 2), round(p99, 2)] for name, (p50, p99) in ms.items()}
    return Figure(
        "sandbox_latency", f"sandbox print(1) p50 (p99 {ms['sandbox'][1]:.1f} ms), N={sizes.sandbox_runs}",
        ms["sandbox"][0], "ms", ms["python -c pass"][0], "python -c pass p50", "ratio", "<=", 2.0, sizes.sandbox_runs, notes,
    )
