"""The per-sample record the machine moves: its state, trajectory, counters and trace.

A `Rollout` is the `transitions` model of one sample. It holds what the guards read
(the last reply, the parsed turn, the pending tool calls) and what the trace tools
show afterwards (the path, the termination reason, per-turn records). It never does
I/O; the driver fills its inputs between triggers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import attrs

from engine.config import EngineConfig
from engine.profiles.base import CallResult, ToolCall, Turn
from engine.machine.trajectory import Trajectory
from engine.sglang.wire import Reply

if TYPE_CHECKING:
    from engine.machine.checkpoint import Saved

ResumeAt = Literal["generate", "tools"]


@attrs.frozen
class Restored:
    """A validated checkpoint (partial rollout), ready to put back into a rollout."""

    traj: Trajectory
    resume_at: ResumeAt
    partial_turn_tokens: int
    turns: int
    tool_calls: int
    turn_log: list[dict[str, Any]]
    attempt: int


def _never() -> bool:
    return False


@attrs.define(eq=False, slots=True)
class Rollout:
    """One sample on its way through the machine."""

    cfg: EngineConfig
    state: str = "RESET"
    prompt: Any = None  # the sample's prompt: a string or chat messages
    traj: Trajectory = attrs.field(factory=Trajectory)
    prompt_ids: list[int] = attrs.field(factory=list)  # rendered by the driver before `start`
    sampling_params: dict[str, Any] = attrs.field(factory=dict)
    routing_key: str | None = None  # sent as X-SMG-Routing-Key so a sample's turns share a cache
    allowed_tools: frozenset[str] = frozenset()
    tool_schemas: dict[str, dict[str, Any]] | None = None  # the sample's own schemas, by tool name
    limit: int | None = None  # most tokens prompt + response may hold
    asked_max_new_tokens: int | None = None  # per-turn cap from sampling_params
    max_new_tokens: int | None = None  # the clamped cap of the next request
    turns: int = 0
    tool_calls: int = 0
    tool_calls_before_turn: int = 0  # so a resumed turn re-runs its calls within the same budget
    # Partial rollout: what the caller found on its sample, what RESET made of it, how far the last turn got.
    saved: Saved | None = None
    resume: Restored | None = None
    resume_rejected: str | None = None
    partial_turn_tokens: int = 0
    attempt: int = 1
    abort_check: Callable[[], bool] = _never  # cooperative abort (slime's or the engine's flag)
    # What the last I/O step produced; guards read these.
    reply: Reply | None = None
    turn: Turn | None = None
    calls: list[ToolCall] = attrs.field(factory=list)  # calls of this turn still to run
    results: list[CallResult] = attrs.field(factory=list)  # answers to this turn's calls
    observation_ids: list[int] = attrs.field(factory=list)
    # Record of the run.
    trace: list[tuple[str, str, str]] = attrs.field(factory=list)
    guards: list[str | None] = attrs.field(factory=list)  # the guard of each traced edge
    reason: str | None = None
    violation: str | None = None
    error: str | None = None
    text: str = ""
    final_text: str = ""  # the model's own tokens after the last observation, decoded (what rewards read)
    weight_versions: list[str] = attrs.field(factory=list)
    turn_log: list[dict[str, Any]] = attrs.field(factory=list)
    tool_stats: dict[str, Any] = attrs.field(factory=dict)
    tool_states: dict[str, Any] = attrs.field(factory=dict)  # per-trajectory tool state, by tool
    generation_time: float = 0.0
    tool_time: float = 0.0
    # Per /generate call, the meta_info counters slime accumulates (cached_tokens, spec_*...).
    call_stats: list[dict[str, int]] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        if self.cfg.expert_row_bytes and not self.traj.expert_row_bytes:
            self.traj = Trajectory(expert_row_bytes=self.cfg.expert_row_bytes)

    def budget_at_end(self) -> int | None:
        """I2's bound. A prompt longer than the budget may end only with an empty response."""
        if self.limit is None:
            return None
        return max(self.limit, self.traj.prompt_length)

    def stop_because(self, reason: str) -> None:
        """Record why the sample ends; the first reason stands (I6)."""
        if self.reason is None:
            self.reason = reason

    def count_tool_error(self, kind: str) -> None:
        errors = self.tool_stats.setdefault("errors", {})
        errors[kind] = errors.get(kind, 0) + 1
