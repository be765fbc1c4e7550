"""What every figure of the benchmark shares: sizes, result rows, statistics, the fake tool.

A `Figure` is one printed row: a measured value next to the floor it is compared with,
and a target that is either on the value itself (e.g. "<= 15 us") or on the ratio
value / floor (e.g. ">= 0.8"). Medians of repeats are reported, never means: the
machine is shared and noisy, and one descheduled run must not move a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from engine import tools


@attrs.frozen
class Sizes:
    """How big each measurement is. `small()` is the CI size, `default()` the full run."""

    samples: int = 512  # figure 1: samples rolled out per repeat
    turns: int = 8  # figure 1 and 6: turns per sample (T-1 tool turns, then the answer)
    concurrency: int = 256  # figure 1: samples (and HTTP connections) in flight
    repeats: int = 3  # figures 1, 2, 3: medians over this many runs
    fsm_cycles: int = 3000  # figure 2: BUDGET_CHECK -> GENERATE -> TOOL_CALL -> BUDGET_CHECK cycles per repeat
    fsm_setups: int = 20000  # figure 2: Rollout() constructions per repeat
    add_models: int = 1000  # figure 2: models attached with Machine.add_model per repeat
    tool_samples: int = 64  # figure 3: K
    tool_calls: int = 2  # figure 3: M calls per sample
    tool_sleep: float = 0.5  # figure 3: s seconds each call sleeps in the sandbox
    tool_concurrency: int = 64  # figure 3: the engine's tool slots
    sandbox_runs: int = 30  # figure 4: N
    memory_samples: int = 100  # figure 5
    memory_tokens: int = 32768  # figure 5: response tokens per sample
    scale_samples: tuple[int, ...] = (4096, 10000)  # figure 6: samples in flight at once, one row each
    scale_turns: int = 2  # figure 6: turns per sample (a tool turn, then the answer)
    agent_sessions: int = 16  # figure 8: agents' sessions through the front door at once
    agent_turns: int = 52  # figure 8: calls per session (turn 50 is compared with turn 5)
    long_samples: int = 16  # figure 9: compacted rollouts at once
    long_turns: tuple[int, ...] = (10, 50, 100)  # figure 9: turns per rollout, one row each; the first is the floor

    @classmethod
    def default(cls) -> Sizes:
        return cls()

    @classmethod
    def small(cls) -> Sizes:
        return cls(
            samples=64, turns=4, concurrency=32, repeats=3, fsm_cycles=1000, fsm_setups=5000, add_models=200,
            tool_samples=8, tool_calls=1, tool_sleep=0.3, tool_concurrency=64, sandbox_runs=8,
            memory_samples=20, scale_samples=(512, 1024), scale_turns=2, agent_sessions=4, long_samples=2,
        )

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Sizes:
        """The sizes the command line asks for: --small or the default, then explicit overrides."""
        sizes = cls.small() if getattr(ns, "small", False) else cls.default()
        changes: dict[str, Any] = {}
        if getattr(ns, "samples", None):
            changes["samples"] = ns.samples
        if getattr(ns, "turns", None):
            changes["turns"] = ns.turns
        if getattr(ns, "repeats", None):
            changes["repeats"] = ns.repeats
        return attrs.evolve(sizes, **changes)


Target = Literal["value", "ratio"]


@attrs.define
class Figure:
    """One row of the table: `value` against `floor`, judged by `target` on the value or the ratio."""

    key: str
    title: str
    value: float
    unit: str
    floor: float | None
    floor_label: str
    target_on: Target | None  # None: shown for information, judged by nothing
    op: Literal["<=", ">="] | None
    threshold: float | None
    repeats: int
    notes: dict[str, Any] = attrs.field(factory=dict)
    number: int = 0  # the figure's number (1-9); rows may share one

    @property
    def ratio(self) -> float | None:
        if self.floor is None or self.floor == 0:
            return None
        return self.value / self.floor

    @property
    def judged(self) -> float | None:
        return self.value if self.target_on == "value" else self.ratio

    @property
    def passed(self) -> bool | None:
        """True/False against the target; None for an information-only row."""
        if self.target_on is None or self.threshold is None:
            return None
        x = self.judged
        if x is None or math.isnan(x):
            return False
        return x <= self.threshold if self.op == "<=" else x >= self.threshold

    def to_json(self) -> dict[str, Any]:
        return {
            "figure": self.number, "key": self.key, "title": self.title, "value": self.value, "unit": self.unit,
            "floor": self.floor, "floor_label": self.floor_label, "ratio": self.ratio,
            "target": None if self.target_on is None else {"on": self.target_on, "op": self.op, "threshold": self.threshold},
            "pass": self.passed, "repeats": self.repeats, "notes": self.notes,
        }


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): an observed value, honest for small N (p99 of 30 is the max)."""
    if not xs:
        return math.nan
    ordered = sorted(xs)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


class InstantInterpreter(tools.Tool):
    """Replaces `code_interpreter` where a figure measures the engine, not the sandbox: answers at once."""

    name = "code_interpreter"
    description = "A tool for executing Python code in a safe sandbox environment."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    async def execute(self, state: Any, **arguments: Any) -> str:
        return "Output:\n1"


def instant_interpreter() -> contextlib.AbstractContextManager[tools.Tool]:
    """Register `InstantInterpreter` for a block, then put back whatever was registered before."""
    return tools.registry.registered(InstantInterpreter())
