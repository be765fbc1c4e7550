"""The `bench` command: every figure in one run, in an order that keeps them from disturbing each other.

Pure-CPU figures (FSM, memory) run first, on a quiet process. The sandbox figures run
before the HTTP ones, so no leftover connection or task competes with them. One canned
server subprocess serves every HTTP figure (a scenario each) and is stopped at the end,
whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from typing import Any

from engine import tools
from engine.local.bench.common import Figure, Sizes
from engine.local.bench.agent import SCENARIO, agent_figures, agent_scenario
from engine.local.bench.fsm import fsm_figures
from engine.local.bench.long import SCENARIO as LONG, long_figures, long_scenario
from engine.local.bench.memory import body_figure, memory_figure
from engine.local.bench.ray import ray_figures
from engine.local.bench.report import format_table, to_json
from engine.local.bench.rollout import rollout_figures, scale_figure
from engine.local.bench.sandbox import sandbox_figures, sleep_code, tool_concurrency_figure
from engine.local.bench.server import CannedServer, scenario
from engine.profiles.tokenizer import load_tokenizer


class _Clock:
    """Logs each figure as it starts (to stderr) and keeps how long each one took."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.seconds: dict[str, float] = {}
        self._name: str | None = None
        self._start = 0.0

    def start(self, name: str) -> None:
        self.stop()
        if not self.quiet:
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
        self._name, self._start = name, time.perf_counter()

    def stop(self) -> None:
        if self._name is not None:
            self.seconds[self._name] = round(time.perf_counter() - self._start, 1)
            self._name = None


async def _http_figures(server: CannedServer, tokenizer: Any, sizes: Sizes, clock: _Clock) -> dict[str, list[Figure]]:
    clock.start("4 sandbox cost")
    sandbox = await sandbox_figures(sizes)
    clock.start("3 tool concurrency")
    concurrency = await tool_concurrency_figure(server, tokenizer, sizes)
    clock.start("1 rollout")
    rollout = await rollout_figures(server, tokenizer, sizes)
    clock.start("6 scale")
    # The median of the repeats' maxima: one pass's maximum flips with the machine's drift.
    scale = await scale_figure(server, tokenizer, sizes, repeats=sizes.repeats)
    clock.start("8 agents")
    agent = await agent_figures(server, tokenizer, sizes)
    clock.start("9 long rollouts")
    long = await long_figures(server, tokenizer, sizes)
    clock.stop()
    return {"rollout": rollout, "concurrency": [concurrency], "sandbox": sandbox, "scale": scale, "agent": agent,
            "long": long}


def run_all(sizes: Sizes, *, quiet: bool = False) -> tuple[list[Figure], dict[str, Any]]:
    """Measure every figure; returns the rows in figure order and a header of context."""
    started = time.perf_counter()
    clock = _Clock(quiet)
    if tools.get("code_interpreter") is None:
        raise RuntimeError("the code_interpreter tool is not registered")
    clock.start("2 fsm")
    fsm = fsm_figures(sizes)
    clock.start("5 memory")
    memory = [memory_figure(sizes), body_figure(sizes.memory_tokens)]
    clock.start("tokenizer load")
    tokenizer = load_tokenizer()
    clock.stop()
    scenarios = {
        "tool": scenario(tokenizer, sizes.turns, "print(1)"),
        "scale": scenario(tokenizer, sizes.scale_turns, "print(1)"),
        "sleep": scenario(tokenizer, sizes.tool_calls + 1, sleep_code(sizes.tool_sleep)),
        SCENARIO: agent_scenario(tokenizer, sizes.agent_turns),
        LONG: long_scenario(tokenizer),
    }
    with CannedServer(scenarios) as server:
        http = asyncio.run(_http_figures(server, tokenizer, sizes, clock))
    groups = [http["rollout"], fsm, http["concurrency"], http["sandbox"], memory, http["scale"]]
    groups.append(ray_figures(sizes))  # 7: sandboxed calls on a two-node Ray test cluster (an info row without ray)
    groups.append(http["agent"])  # 8: an agent's calls as its history grows; the front door against the engine's loop
    groups.append(http["long"])  # 9: a turn of a compacted rollout at 10, 50 and 100 turns
    figures = []
    for number, group in enumerate(groups, 1):
        for figure in group:
            figure.number = number
            figures.append(figure)
    size = "default" if sizes == Sizes.default() else "small" if sizes == Sizes.small() else "custom"
    header = {
        "python": platform.python_version(), "cpus": os.cpu_count(), "size": size,
        "total_s": round(time.perf_counter() - started, 1), "seconds": clock.seconds,
    }
    return figures, header


def main_bench(ns: argparse.Namespace) -> int:
    """Entry point of `python -m engine bench`. Misses are reported, not failed: exit 0."""
    sizes = Sizes.from_args(ns)
    from engine.loop.preflight import check_tools_sync, describe

    problems = check_tools_sync(["code_interpreter"])  # figures 3 and 4 time the real sandbox
    if problems:
        print(f"error: {describe(problems)}; nothing was measured", file=sys.stderr)
        return 1
    figures, header = run_all(sizes, quiet=bool(getattr(ns, "json", False)))
    print(to_json(figures, header) if getattr(ns, "json", False) else format_table(figures, header))
    return 0
