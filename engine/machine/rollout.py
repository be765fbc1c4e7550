"""The per-sample record the machine moves, split by lifetime.

* `Inputs`: what the caller hands in for the sample; frozen for its whole life.
* `TurnScratch`: what one turn's I/O produced (the reply, its text parsed once, the tool
  calls and their answers, the observation); a new one replaces it every turn, so nothing
  of a turn leaks into the next and nothing resets it by hand.
* `Record`: what the trace tools show afterwards (the path, why it ended, per-turn log,
  tool statistics, times).
* `Rollout`: the `transitions` model of one sample, holding the three and the trajectory,
  the counters the guards read, and the partial-rollout bookkeeping. It never does I/O; the
  driver fills its turn scratch between triggers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs

from engine.settings import EngineConfig
from engine.machine.trajectory import Trajectory
from engine.profiles.base import CallResult, ToolCall, Turn
from engine.sglang.wire import Reply

ResumeAt = Literal["generate", "tools"]


def _never() -> bool:
    return False


@attrs.frozen
class Saved:
    """What an earlier attempt left on the sample, as plain values: the checkpoint and the arrays."""

    checkpoint: Any
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    logprobs: list[float]
    top_p_ids: Any = None
    top_p_offsets: Any = None
    routed_experts: bytes | None = None  # int32 bytes of the sample's rows (padded), None when absent


@attrs.frozen
class Inputs:
    """What the caller gives for one sample; the engine never changes it."""

    cfg: EngineConfig
    prompt: Any = None  # a string or chat messages
    sampling_params: dict[str, Any] = attrs.field(factory=dict)  # a private copy: never the caller's dict
    asked_max_new_tokens: int | None = None  # the per-turn cap the sampling params ask for
    routing_key: str | None = None  # sent as X-SMG-Routing-Key so a sample's turns share a cache
    allowed_tools: frozenset[str] = frozenset()
    tool_schemas: dict[str, dict[str, Any]] | None = None  # the sample's own schemas, by tool name
    abort_check: Callable[[], bool] = _never  # cooperative abort (the caller's flag, the runtime's signal)
    saved: Saved | None = None  # partial rollout: what an earlier attempt left on the sample
    environment: Any = None  # the `engine.envs.Environment` answering turns that call no tool (None: none)
    metadata: Any = None  # the sample's metadata, read-only, for the environment's `start`
    environment_args: Any = None  # the environment's arguments for this sample (`metadata["environment"]["args"]`)


@attrs.define(eq=False, slots=True)
class TurnScratch:
    """One turn's I/O results, read by the guards; replaced whole at the start of every turn."""

    reply: Reply | None = None
    text: str = ""  # the turn's text, decoded once (what the profile parses)
    parsed: Turn | None = None
    pending_calls: list[ToolCall] = attrs.field(factory=list)  # planned calls not yet run by their tool's state
    refused: list[tuple[ToolCall, str]] = attrs.field(factory=list)  # calls answered with an error, unrun, and why
    results: list[CallResult] = attrs.field(factory=list)  # answers to this turn's calls
    observation_ids: list[int] = attrs.field(factory=list)
    env_reply: Any = None  # the environment's `Reply` to this turn
    env_seconds: float = 0.0  # how long the environment took to answer it
    env_blocked: float = 0.0  # how long it held the event loop at once while answering, when that stalled others


@attrs.define(eq=False, slots=True)
class ToolStats:
    """Per-sample tool statistics: calls run, error kinds, timeouts, seconds spent in tools."""

    calls: int = 0
    errors: dict[str, int] = attrs.field(factory=dict)
    timeouts: int = 0
    seconds: float = 0.0
    counted: dict[str, float] = attrs.field(factory=dict)  # what tools counted (`tools.count`): retries, waiting

    def count(self, result: CallResult) -> None:
        """Count one answered call (errors answered without running count as errors only)."""
        if result.error:
            self.errors[result.error] = self.errors.get(result.error, 0) + 1
            if result.error == "timeout":
                self.timeouts += 1
        for key, amount in result.stats.items():
            self.counted[key] = self.counted.get(key, 0) + amount

    def as_dict(self) -> dict[str, Any]:
        return {**self.counted, "calls": self.calls, "errors": dict(self.errors), "timeouts": self.timeouts,
                "seconds": self.seconds}


@attrs.define(eq=False, slots=True)
class Record:
    """What happened: the path (with the guard of each edge), why it ended, per-turn and per-tool records."""

    trace: list[tuple[str, str, str]] = attrs.field(factory=list)
    guards: list[str | None] = attrs.field(factory=list)
    reason: str | None = None
    violation: str | None = None
    error: str | None = None
    turn_log: list[dict[str, Any]] = attrs.field(factory=list)
    weight_versions: list[str] = attrs.field(factory=list)
    tools: ToolStats = attrs.field(factory=ToolStats)
    generation_time: float = 0.0
    # Per /generate call, the meta_info counters slime accumulates (cached_tokens, spec_*...).
    call_stats: list[dict[str, int]] = attrs.field(factory=list)
    env_reason: str | None = None  # why the environment ended the episode, in its own words
    env_success: bool | None = None  # whether it says the episode reached its goal
    env_seconds: float = 0.0  # time in the environment: start, every answer, end


@attrs.frozen
class Restored:
    """A validated checkpoint (partial rollout), ready to put back into a rollout."""

    traj: Trajectory
    resume_at: ResumeAt
    partial_turn_tokens: int
    turn_count: int
    tool_call_count: int
    turn_log: list[dict[str, Any]]
    attempt: int


@attrs.define(eq=False, slots=True)
class Rollout:
    """One sample on its way through the machine."""

    inputs: Inputs
    state: str = "RESET"
    traj: Trajectory = attrs.field(factory=Trajectory)
    # Rendered by the driver before `start`: the runtime's cached tuple, shared by a prompt's samples.
    prompt_ids: Sequence[int] = ()
    token_budget: int | None = None  # the most tokens prompt + response may hold
    max_new_tokens: int | None = None  # the clamped cap of the next request
    turn_count: int = 0
    tool_call_count: int = 0
    tool_calls_before_turn: int = 0  # so a resumed turn re-runs its calls within the same budget
    turn: TurnScratch = attrs.field(factory=TurnScratch)
    record: Record = attrs.field(factory=Record)
    text: str = ""  # decode(response ids), made once the sample ends (the driver's `finish`)
    final_text: str = ""  # the model's own tokens after the last observation, decoded (what rewards read)
    tool_sessions: dict[str, Any] = attrs.field(factory=dict)  # per-trajectory tool state, by tool name
    env_episode: Any = None  # what the environment's `start` returned (env_started: it was called)
    env_started: bool = False
    # The episode's chat messages as `respond` sees them, recorded as turns happen (None: no environment).
    conversation: list[dict[str, Any]] | None = None
    # Partial rollout: what RESET made of the caller's checkpoint, and how far the last turn got.
    resume: Restored | None = None
    resume_rejected: str | None = None
    partial_turn_tokens: int = 0
    attempt: int = 1

    def __attrs_post_init__(self) -> None:
        if self.cfg.expert_row_bytes and not self.traj.expert_row_bytes:
            self.traj = Trajectory(expert_row_bytes=self.cfg.expert_row_bytes)

    @property
    def cfg(self) -> EngineConfig:
        return self.inputs.cfg

    @property
    def reason(self) -> str | None:
        return self.record.reason

    def budget_at_end(self) -> int | None:
        """I2's bound. A prompt longer than the budget may end only with an empty response."""
        if self.token_budget is None:
            return None
        return max(self.token_budget, self.traj.prompt_length)

    def stop_because(self, reason: str) -> None:
        """Record why the sample ends; the first reason stands (I6)."""
        if self.record.reason is None:
            self.record.reason = reason
