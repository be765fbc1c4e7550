"""The states of the rollout machine, each defined once, and the triggers that move between them.

`STATES` is the one definition of every core state: its name, its kind, whether its step
awaits I/O (so a cancellation can arrive there), the trigger the driver fires at once when
the state needs no I/O, and the legend the diagrams print. The state list, the awaiting set,
the steps that need no coroutine and the legend are all built from it. ENVIRONMENT is taken
only when an environment is chosen (`engine_environment`), HARNESS only for an agent's
session (`engine_agent`: the harness, not the engine, answers the model). Tool states
(`TOOL_<NAME>`) are added per registered tool by `engine.machine.table`.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

import attrs


class State(str, Enum):
    """The core states. Tool states (`TOOL_<NAME>`) are added per registered tool, as plain strings."""

    RESET = "RESET"
    RESUME = "RESUME"
    BUDGET_CHECK = "BUDGET_CHECK"
    GENERATE = "GENERATE"
    TOOL_CALL = "TOOL_CALL"
    ENVIRONMENT = "ENVIRONMENT"
    HARNESS = "HARNESS"
    TRIM = "TRIM"
    COMPLETED = "COMPLETED"
    TRUNCATED = "TRUNCATED"
    ABORTED = "ABORTED"
    FAILED = "FAILED"

    def __str__(self) -> str:
        return self.value


class Trigger(str, Enum):
    """What a step reports; the machine picks the edge of that trigger whose guard holds."""

    START = "start"
    RESUME = "resume"
    CONTINUE = "continue"
    CHECK = "check"
    REPLY = "reply"
    CONTEXT_REJECTED = "context_rejected"
    REQUEST_FAILED = "request_failed"
    REQUEST_REJECTED = "request_rejected"
    DISPATCH = "dispatch"
    OBSERVE = "observe"
    TOOL_DONE = "tool_done"
    TOOL_UNAVAILABLE = "tool_unavailable"
    ENV_REPLY = "env_reply"
    ENV_FAILED = "environment_failed"
    HARNESS_CALL = "harness_call"
    HARNESS_END = "harness_end"
    TRIM = "trim"
    CRASHED = "crashed"
    CANCELLED = "cancelled"
    INVARIANT_VIOLATED = "invariant_violated"

    def __str__(self) -> str:
        return self.value


StateKind = Literal["core", "tool", "terminal"]


@attrs.frozen
class StateDef:
    """Everything about one state, in one place.

    `awaits`: its step awaits I/O, so a cancellation can arrive there. `fires`: the trigger
    the driver fires at once, with no step to run (None: the loop runs the state's step).
    """

    name: str = attrs.field(converter=str)
    kind: StateKind
    legend: str
    awaits: bool = False
    fires: Trigger | None = None


S, T = State, Trigger
# fmt: off
STATES: tuple[StateDef, ...] = (
    #        name            kind        legend (diagrams/README.md)                                                   awaits  fires
    StateDef(S.RESET,        "core",     "forgets what an earlier attempt left, renders the prompt; with a partial-rollout checkpoint, validates it", False, None),
    StateDef(S.RESUME,       "core",     "puts back the partial trajectory of an aborted sample whose checkpoint matched, then re-runs its pending tool calls or goes on generating", False, T.CONTINUE),
    StateDef(S.BUDGET_CHECK, "core",     "before each turn: ends ABORTED (resumable) if the caller is aborting the step, TRUNCATED if the prompt alone is over budget or the context, per-turn cap or turns are spent, else clamps max_new_tokens to the room left", False, T.CHECK),
    StateDef(S.GENERATE,     "core",     "one /generate request; the reply's ids and logprobs are taken as sent, then the turn is parsed (answer, tool call, invalid)", True, None),
    StateDef(S.TOOL_CALL,    "core",     "plans the turn's calls (surplus or unparsable ones get an error answer), hands them to the tool states, appends the observation (mask 0)", False, None),
    StateDef(S.ENVIRONMENT,  "core",     "the chosen environment (engine_environment) answers a model turn that is not a tool call: a user turn appended (mask 0) and the turn's reward, or the end of the episode", True, None),
    StateDef(S.HARNESS,      "core",     "agent mode (engine_agent): answers the harness's waiting model call with the turn, then awaits its next call, whose history extends what was sampled (the added messages appended, mask 0) or breaks the segment (a new one from the history as given), or the session's end", True, None),
    StateDef(S.TRIM,         "core",     "cuts every per-token array to the budget together after a reply or an observation overflowed it", False, T.TRIM),
    StateDef(S.COMPLETED,    "terminal", "the model gave its final answer"),
    StateDef(S.TRUNCATED,    "terminal", "a budget ran out (context, turns, tool calls) or the turn hit its max_new_tokens"),
    StateDef(S.ABORTED,      "terminal", "the attempt ended on an unusable reply, a server abort, a failed request, a cancellation, the caller's abort, or a broken invariant (response discarded)"),
    StateDef(S.FAILED,       "terminal", "an engine error, a request the server rejected, or a tool that cannot work (nothing of it trained)"),
)
# fmt: on
TERMINALS = frozenset(d.name for d in STATES if d.kind == "terminal")
BY_NAME: dict[str, StateDef] = {d.name: d for d in STATES}
