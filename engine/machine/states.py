"""The states of the rollout machine, each defined once, and the triggers that move between them.

`STATES` is the one definition of every core state: its name, its kind, the legend the
diagrams print, and what it does (`does`): the trigger the driver fires at once when the
state needs no I/O, or the named `Step` the loop runs there (and whether that step awaits,
so a cancellation can arrive). The state list, the awaiting set, the driver's dispatch and
the legend are all built from it; a state without exactly one behaviour is refused here, a
step the loop does not define when the driven machine is built. ENVIRONMENT is taken only
by a sample with an environment (its metadata's, else `engine_environment`), HARNESS only by an
agent's session (`engine_agent`: the harness, not the engine, answers the model), COMPACT only with
`engine_compaction`. Tool states (`TOOL_<NAME>`) are added
per registered tool by `engine.machine.table`; they all run `TOOL_STEP`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

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
    COMPACT = "COMPACT"
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
    COMPACTED = "compacted"
    TRIM = "trim"
    CRASHED = "crashed"
    CANCELLED = "cancelled"
    INVARIANT_VIOLATED = "invariant_violated"

    def __str__(self) -> str:
        return self.value


StateKind = Literal["core", "tool", "terminal"]


@attrs.frozen
class Step:
    """A state's behaviour when it needs I/O: the loop's step of that name runs there.

    The loop registers its steps by name (`engine.loop.driver.STEPS`); building the driven
    machine resolves every `Step` and refuses one the loop does not define. `awaits`: the step
    awaits I/O, so a cancellation can arrive there (the state gets a `cancelled` edge).
    Several states may share one step (every tool state runs `tool_calls`).
    """

    name: str
    awaits: bool = False


Behaviour = Trigger | Step


def _one_behaviour(definition: StateDef, _: attrs.Attribute[Any], does: Behaviour | None) -> None:
    """A terminal does nothing; every other state does exactly one thing (a type can hold no more)."""
    if definition.kind == "terminal" and does is not None:
        raise ValueError(f"terminal state {definition.name} cannot fire or run a step (it has {does!r})")
    if definition.kind != "terminal" and not isinstance(does, (Trigger, Step)):
        raise ValueError(f"state {definition.name} needs one behaviour: the Trigger it fires at once, "
                         f"or the Step the loop runs there (got {does!r})")


@attrs.frozen
class StateDef:
    """Everything about one state, in one place: its name, kind, legend, and what it does.

    `does` is the state's one behaviour: a `Trigger` the driver fires at once (the state needs
    no I/O; the table's rows of that trigger choose the edge), or a `Step` the loop runs, which
    reports the trigger. A terminal state does nothing.
    """

    name: str = attrs.field(converter=str)
    kind: StateKind
    legend: str
    does: Behaviour | None = attrs.field(default=None, validator=_one_behaviour)

    @property
    def fires(self) -> Trigger | None:
        """The trigger fired at once on entering the state (None: a step runs, or it is terminal)."""
        return self.does if isinstance(self.does, Trigger) else None

    @property
    def step(self) -> str | None:
        """The name of the loop's step that runs in the state (None: it fires at once, or is terminal)."""
        return self.does.name if isinstance(self.does, Step) else None

    @property
    def awaits(self) -> bool:
        """Its step awaits I/O, so a cancellation can arrive there."""
        return isinstance(self.does, Step) and self.does.awaits


S, T = State, Trigger
# fmt: off
STATES: tuple[StateDef, ...] = (
    #        name            kind        legend (diagrams/README.md)                                                   does
    StateDef(S.RESET,        "core",     "forgets what an earlier attempt left, starts the sample's environment (which may shape the prompt), renders the prompt; with a partial-rollout checkpoint, validates it", Step("reset", awaits=True)),
    StateDef(S.RESUME,       "core",     "puts back the partial trajectory of an aborted sample whose checkpoint matched, then re-runs its pending tool calls or goes on generating", T.CONTINUE),
    StateDef(S.BUDGET_CHECK, "core",     "before each turn: ends ABORTED (resumable) if the caller is aborting the step, TRUNCATED if the prompt alone is over budget or the context, per-turn cap or turns are spent, else clamps max_new_tokens to the room left", T.CHECK),
    StateDef(S.GENERATE,     "core",     "one /generate request; the reply's ids and logprobs are taken as sent, then the turn is parsed (answer, tool call, invalid)", Step("generate", awaits=True)),
    StateDef(S.TOOL_CALL,    "core",     "plans the turn's calls (surplus or unparsable ones get an error answer), hands them to the tool states, appends the observation (mask 0)", Step("tool_call")),
    StateDef(S.ENVIRONMENT,  "core",     "the sample's environment (its metadata's, else engine_environment) answers a model turn that is not a tool call: a user turn appended (mask 0) and the turn's reward, or the end of the episode", Step("environment", awaits=True)),
    StateDef(S.HARNESS,      "core",     "agent mode (engine_agent): answers the harness's waiting model call with the turn, then awaits its next call, whose history extends what was sampled (the added messages appended, mask 0) or breaks the segment (a new one from the history as given), or the session's end", Step("harness", awaits=True)),
    StateDef(S.COMPACT,      "core",     "engine_compaction, before the open segment overflows: summarize asks the policy for a summary in the segment's own context, drop_oldest leaves the oldest exchanges out; a new segment starts from the prompt, the summary and the latest turns as the template renders them", Step("compact", awaits=True)),
    StateDef(S.TRIM,         "core",     "cuts every per-token array to the budget together after a reply or an observation overflowed it", T.TRIM),
    StateDef(S.COMPLETED,    "terminal", "the model gave its final answer"),
    StateDef(S.TRUNCATED,    "terminal", "a budget ran out (context, turns, tool calls) or the turn hit its max_new_tokens"),
    StateDef(S.ABORTED,      "terminal", "the attempt ended on an unusable reply, a server abort, a failed request, a cancellation, the caller's abort, or a broken invariant (response discarded)"),
    StateDef(S.FAILED,       "terminal", "an engine error, a request the server rejected, a tool or an environment that cannot work (nothing of it trained)"),
)
# fmt: on
TOOL_STEP = Step("tool_calls", awaits=True)  # every tool state's step: run the turn's waiting calls to its tool
TERMINALS = frozenset(d.name for d in STATES if d.kind == "terminal")
BY_NAME: dict[str, StateDef] = {d.name: d for d in STATES}
# The edges that add an entry to the record's turn log: a reply (a model turn), a compaction.
LOGS_A_TURN = frozenset({(State.GENERATE.value, Trigger.REPLY.value), (State.COMPACT.value, Trigger.COMPACTED.value)})
