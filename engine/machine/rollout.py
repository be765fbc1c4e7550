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

An agent's session (`engine_agent`) may break its history, and the engine's own loop breaks it
where the chat template renders the next prompt otherwise (earlier reasoning dropped) or the
context is compacted (`engine_compaction`): the rollout then holds the segments a break closed
(`ClosedSegment`: the prompt, the aligned arrays, why it ended and where its turns and path lie
in the record) beside the trajectory of the open one. Each segment becomes one sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs

from engine.machine.trajectory import Trajectory
from engine.profiles.base import CallResult, ToolCall, Turn
from engine.settings import EngineConfig
from engine.sglang.wire import Reply

ResumeAt = Literal["generate", "tools"]
BreakReason = Literal["reasoning_dropped", "turn_rewritten", "history_compacted", "history_forked", "history_contradicts",
                      "summarized", "oldest_dropped"]
EndReason = Literal["harness_finished", "harness_crashed", "harness_timed_out"]


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
    harness: Any = None  # an agent's session (`engine.loop.harness.Harness`): the harness answers the model
    rendered: tuple[int, ...] | None = None  # the prompt's ids, rendered by the caller (an agent's first call)
    environment_args: Any = None  # the environment's arguments for this sample (`metadata["environment"]["args"]`)
    compact_at: int | None = None  # engine_compaction: the open segment's length that starts COMPACT (None: off)


@attrs.frozen
class HarnessEvent:
    """What came of the harness after a turn was answered: its next call, or the session's end.

    `extends`: the call's history extends what was sampled; `observation_ids` are the messages
    it added, as the template renders them after the turn (mask 0). `break`: it does not;
    `reason` names how, and `prompt_ids` are the history as given, the next segment's prompt.
    `end`: the session ended, `reason` says how. `max_new_tokens` and `stop` are the call's own
    cap and stop strings (on top of the sample's).
    """

    kind: Literal["extends", "break", "end"]
    reason: str | None = None
    observation_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()


@attrs.frozen
class SegmentBreak:
    """The next prompt as the chat template renders the conversation, where that does not extend
    the sequence sampled so far (the template dropped earlier reasoning): the next segment's
    prompt, and the guard of the break's edge."""

    reason: str
    prompt_ids: tuple[int, ...]


@attrs.frozen
class Compaction:
    """What COMPACT's step made of the open segment (engine_compaction), for its edges to act on.

    `summarize`: `asked` are the ids that ask for the summary (a user message and the generation
    prompt), appended after the last `cut` tokens (the generation prompt the sequence ended with)
    are cut; the reply is the turn scratch's, `summary` its text outside reasoning ("" when there
    is none: refused). `prompt_ids` is the next segment's prompt (empty when even the prompt and
    the summary, or the prompt alone, reach the threshold), `history` its conversation, and
    `dropped` how many model turns it leaves out. `room`: the summary could be asked for at all.
    """

    mode: Literal["summarize", "drop_oldest"]
    prompt_ids: tuple[int, ...] = ()
    history: Any = None
    dropped: int = 0
    cut: int = 0
    asked: tuple[int, ...] = ()
    summary: str | None = None
    room: bool = True


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
    harness: HarnessEvent | None = None  # an agent's next call (or its end), after this turn was answered
    env_seconds: float = 0.0  # how long the environment took to answer it
    env_blocked: float = 0.0  # how long it held the event loop at once while answering, when that stalled others
    rerender: SegmentBreak | None = None  # the template's own next prompt, where it does not extend the sequence
    compaction: Compaction | None = None  # COMPACT's plan for the open segment


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


@attrs.frozen
class Marks:
    """How long the record's lists were when a segment began (or ended): its turns, weight
    versions, per-call stats and edges are the entries between two marks."""

    turns: int = 0
    versions: int = 0
    stats: int = 0
    trace: int = 0

    @classmethod
    def of(cls, record: Record, edges_ahead: int = 0) -> Marks:
        """The record's lengths now; `edges_ahead`: edges taken but not yet recorded (the one being taken)."""
        return cls(len(record.turn_log), len(record.weight_versions), len(record.call_stats), len(record.trace) + edges_ahead)


@attrs.frozen
class ClosedSegment:
    """A segment of an agent's rollout that a history break closed: its own sample.

    `traj` holds its prompt and aligned arrays (checked whole when it closed); `reason` is the
    break that closed it; its turns, weight versions, per-call stats and path are the record's
    entries between `start` and `end`.
    """

    traj: Trajectory
    reason: str
    start: Marks
    end: Marks


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
    turn_resumes: int = 0  # how often an agent's turn was aborted and went on (reset by a whole turn)
    attempt: int = 1
    # An agent's session: the segments its history breaks closed, where the open one began, and
    # the cap and stop strings its waiting call asked for (`max_tokens`, `stop`).
    closed: list[ClosedSegment] = attrs.field(factory=list)
    segment_start: Marks = attrs.field(factory=Marks)
    call_max_new_tokens: int | None = None
    call_stop: tuple[str, ...] = ()
    # The conversation as the template's messages (`engine.profiles.history.History`), kept where
    # the template may render it otherwise than the sequence (earlier reasoning) or compaction is on.
    history: Any = None

    def take_call(self, event: HarnessEvent) -> None:
        """The harness's call asks its own cap and stop strings for the turn that answers it."""
        self.call_max_new_tokens, self.call_stop = event.max_new_tokens, event.stop

    def sampling_params(self) -> dict[str, Any]:
        """The next request's sampling params: the sample's, with the waiting call's stop strings added."""
        params = self.inputs.sampling_params
        if not self.call_stop:
            return params
        own = params.get("stop")
        stops = [own] if isinstance(own, str) else list(own or [])
        return {**params, "stop": stops + [s for s in self.call_stop if s not in stops]}

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
