"""The rollout machine: one table of states, one of edges, and the machine built from them.

`engine.machine.states` defines every core state once. `core_edges()` is the table of edges, read top to bottom: each
row is `source --trigger [guard]--> dest` with the actions done on the way. Rows of one
(source, trigger) are tried in order; the first whose guard holds is taken, and the last
row of a group is `otherwise` (drawn `[else]`), so a stop added above needs no negation
below. Registered tools add a state each (`TOOL_<NAME>`).

The runtime machine and the diagrams are both built from these tables. The runtime
machine is one `transitions.Machine` (sync, `auto_transitions=False`) holding the whole
table as transitions intends it: an event per trigger, its transitions the table's rows in
order, each row's guard its condition, its actions the `before` callbacks and the edge's
bookkeeping the `after` callback. There is one machine per process (rebuilt only when the
tool registry changes) and no per-sample `add_model`: a sample is triggered through
`machine.events[trigger].trigger(rollout, rollout)`, which costs nothing per sample.

One dispatcher: the machine's events are `_OrderedEvent`s, which evaluate transitions' own
rows (first row whose conditions hold: before, state, after) without the generic path's
per-trigger bookkeeping, which costs several times a whole edge on the hottest path there is
(the bench's figure 2 measures both on the same definition; docs/machine.md). `_TableMachine`
refuses any configuration that the short path would not honour, and
`RolloutMachine(spec, stock=True)` runs the same definition on transitions' stock `Event`,
which the tests walk side by side with the engine's. There is no second table of rows.
After every transition the edge is appended to the sample's trace and the cheap invariants
are checked; a violation is recorded for the driver to act on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
from transitions import Machine, MachineError
from transitions.core import Event

from engine import tools
from engine.machine import actions, guards
from engine.machine.actions import Action
from engine.machine.guards import Guard, otherwise
from engine.machine.rollout import Rollout
from engine.machine.states import BY_NAME, STATES, TERMINALS, TOOL_STEP, State, StateDef, Trigger
from engine.machine.trajectory import InvariantViolation
from engine.sglang.wire import PROBLEMS

logging.getLogger("transitions").setLevel(logging.WARNING)  # 4 log lines per edge otherwise
S, T = State, Trigger
StepT = TypeVar("StepT")


@attrs.frozen
class Edge:
    """One row of the table. `reason` is recorded when the edge ends the sample or trims it."""

    source: str = attrs.field(converter=str)  # plain strings: State/Trigger members come in, names go out
    trigger: str = attrs.field(converter=str)
    dest: str = attrs.field(converter=str)
    guard: Guard | None = None
    actions: tuple[Action, ...] = ()
    records: tuple[str, ...] = ()  # reasons an action here records in place of the guard's name

    @property
    def guard_name(self) -> str | None:
        return self.guard.__name__ if self.guard is not None else None

    @property
    def label(self) -> str:
        """`trigger [guard]`, as the diagrams print it; the `otherwise` row reads `[else]`."""
        if self.guard is None:
            return str(self.trigger)
        return f"{self.trigger} [{'else' if self.guard is otherwise else self.guard.__name__}]"

    @property
    def reason(self) -> str | None:
        if self.dest in TERMINALS or self.dest == State.TRIM:
            return self.guard.__name__ if self.guard is not None and self.guard is not otherwise else str(self.trigger)
        return None


def tool_state(name: str) -> str:
    """The machine state of a registered tool."""
    return f"TOOL_{name.upper()}"


def tool_of(state: str) -> str:
    """The tool whose calls `state` runs (tool names are lowercase, so the state name gives it back)."""
    if not state.startswith("TOOL_") or state in _CORE_NAMES:
        raise ValueError(f"{state} is not a tool's state")
    return state[len("TOOL_"):].lower()


def core_edges() -> list[Edge]:
    """The machine, as a table. Tools' edges are added by `tool_edges`, fault edges by `fault_edges`."""
    g, a = guards, actions
    E = Edge
    # fmt: off
    return [
        # source          trigger               dest            guard                       actions (, reasons its actions record instead)
        E(S.RESET,        T.START,              S.BUDGET_CHECK, None,                       (a.reset_rollout,)),
        E(S.RESET,        T.ENV_FAILED,         S.FAILED,       None,                       (a.reset_rollout,)),
        E(S.RESET,        T.RESUME,             S.RESUME,       g.checkpoint_valid,         (a.restore_checkpoint,)),
        E(S.RESET,        T.RESUME,             S.BUDGET_CHECK, otherwise,                  (a.reset_rollout,)),
        E(S.RESUME,       T.CONTINUE,           S.TOOL_CALL,    g.tools_pending,            (a.plan_tool_calls,)),
        E(S.RESUME,       T.CONTINUE,           S.BUDGET_CHECK, otherwise),
        E(S.BUDGET_CHECK, T.CHECK,              S.ABORTED,      g.abort_requested),
        E(S.BUDGET_CHECK, T.CHECK,              S.COMPACT,      g.compaction_due),
        E(S.BUDGET_CHECK, T.CHECK,              S.TRUNCATED,    g.prompt_over_budget),
        E(S.BUDGET_CHECK, T.CHECK,              S.TRUNCATED,    g.context_full),
        E(S.BUDGET_CHECK, T.CHECK,              S.TRUNCATED,    g.no_new_tokens_asked),
        E(S.BUDGET_CHECK, T.CHECK,              S.TRUNCATED,    g.max_turns_reached),
        E(S.BUDGET_CHECK, T.CHECK,              S.GENERATE,     otherwise,                  (a.clamp_max_new_tokens,)),
        E(S.GENERATE,     T.REPLY,              S.ABORTED,      g.reply_unusable,           (a.record_unusable_reply,), PROBLEMS),
        E(S.GENERATE,     T.REPLY,              S.ABORTED,      g.top_p_replay_dropped,     (a.record_unusable_reply,)),
        E(S.GENERATE,     T.REPLY,              S.TRIM,         g.reply_over_budget,        (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.BUDGET_CHECK, g.abort_resumed_inside,     (a.append_partial_turn,)),
        E(S.GENERATE,     T.REPLY,              S.ABORTED,      g.server_aborted,           (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.HARNESS,      g.harness_answers,          (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.TRUNCATED,    g.finished_length,          (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.ENVIRONMENT,  g.environment_answers,     (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.COMPLETED,    g.answered,                 (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.TRUNCATED,    g.tool_calls_exhausted,     (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.TOOL_CALL,    g.calls_tool,               (a.append_model_turn, a.plan_tool_calls)),
        E(S.GENERATE,     T.REPLY,              S.TOOL_CALL,    g.invalid_action,           (a.append_model_turn, a.plan_tool_calls)),
        E(S.GENERATE,     T.CONTEXT_REJECTED,   S.TRUNCATED),
        E(S.GENERATE,     T.REQUEST_FAILED,     S.ABORTED),
        E(S.GENERATE,     T.REQUEST_REJECTED,   S.FAILED),
        E(S.TOOL_CALL,    T.OBSERVE,            S.BUDGET_CHECK, g.reasoning_dropped,        (a.record_tool_results, a.break_segment)),
        E(S.TOOL_CALL,    T.OBSERVE,            S.TRIM,         g.observation_over_budget,  (a.append_observation,)),
        E(S.TOOL_CALL,    T.OBSERVE,            S.BUDGET_CHECK, otherwise,                  (a.append_observation,)),
        E(S.ENVIRONMENT,  T.ENV_REPLY,          S.COMPLETED,    g.environment_done,         (a.record_env_reply,)),
        E(S.ENVIRONMENT,  T.ENV_REPLY,          S.BUDGET_CHECK, g.reasoning_dropped,        (a.record_env_reply, a.break_segment)),
        E(S.ENVIRONMENT,  T.ENV_REPLY,          S.TRIM,         g.observation_over_budget,  (a.record_env_reply, a.append_user_turn)),
        E(S.ENVIRONMENT,  T.ENV_REPLY,          S.BUDGET_CHECK, otherwise,                  (a.record_env_reply, a.append_user_turn)),
        E(S.ENVIRONMENT,  T.ENV_FAILED,         S.FAILED),
        E(S.HARNESS,      T.HARNESS_CALL,       S.TRIM,         g.observation_over_budget,  (a.append_harness_delta,)),
        E(S.HARNESS,      T.HARNESS_CALL,       S.BUDGET_CHECK, g.history_extends,          (a.append_harness_delta,)),
        E(S.HARNESS,      T.HARNESS_CALL,       S.BUDGET_CHECK, g.reasoning_dropped,        (a.break_segment,)),
        E(S.HARNESS,      T.HARNESS_CALL,       S.BUDGET_CHECK, g.turn_rewritten,           (a.break_segment,)),
        E(S.HARNESS,      T.HARNESS_CALL,       S.BUDGET_CHECK, g.history_compacted,        (a.break_segment,)),
        E(S.HARNESS,      T.HARNESS_CALL,       S.BUDGET_CHECK, g.history_contradicts,      (a.break_segment,)),
        E(S.HARNESS,      T.HARNESS_CALL,       S.BUDGET_CHECK, g.history_forked,           (a.break_segment,)),
        E(S.HARNESS,      T.HARNESS_END,        S.COMPLETED,    g.harness_finished),
        E(S.HARNESS,      T.HARNESS_END,        S.TRUNCATED,    g.harness_timed_out),
        E(S.HARNESS,      T.HARNESS_END,        S.FAILED,       g.harness_crashed),
        E(S.COMPACT,      T.COMPACTED,          S.ABORTED,      g.summary_unusable,         (a.record_unusable_reply,), PROBLEMS),
        E(S.COMPACT,      T.COMPACTED,          S.ABORTED,      g.server_aborted,           (a.append_summary,)),
        E(S.COMPACT,      T.COMPACTED,          S.TRUNCATED,    g.summary_overflows,        (a.append_summary,)),
        E(S.COMPACT,      T.COMPACTED,          S.TRUNCATED,    g.summary_refused,          (a.append_summary,)),
        E(S.COMPACT,      T.COMPACTED,          S.BUDGET_CHECK, g.summarized,               (a.append_summary, a.compact_segment)),
        E(S.COMPACT,      T.COMPACTED,          S.TRUNCATED,    g.compaction_overflows,     (a.log_compaction,)),
        E(S.COMPACT,      T.COMPACTED,          S.BUDGET_CHECK, g.oldest_dropped,           (a.log_compaction, a.compact_segment)),
        E(S.COMPACT,      T.CONTEXT_REJECTED,   S.TRUNCATED),
        E(S.COMPACT,      T.REQUEST_FAILED,     S.ABORTED),
        E(S.COMPACT,      T.REQUEST_REJECTED,   S.FAILED),
        E(S.TRIM,         T.TRIM,               S.TRUNCATED,    None,                       (a.trim_to_budget,)),
    ]
    # fmt: on


def tool_edges(name: str) -> list[Edge]:
    """A registered tool's state: entered while calls to it wait, left when they are answered.

    A tool whose infrastructure cannot work (its sandbox cannot run code) is not the model's
    error to learn from: the sample ends FAILED, and the adapter keeps all of it out of training.
    """
    state = tool_state(name)
    return [
        Edge(State.TOOL_CALL, Trigger.DISPATCH, state, guards.calls_for(name)),
        Edge(state, Trigger.TOOL_DONE, State.TOOL_CALL),
        Edge(state, Trigger.TOOL_UNAVAILABLE, State.FAILED),
    ]


def fault_edges(states: list[str], awaiting: set[str]) -> list[Edge]:
    """Edges every state has: an engine error, a cancellation while awaiting, a broken invariant.

    `cancelled` leaves only states whose step awaits (GENERATE, the tools): the others
    never yield to the event loop. `invariant_violated` leaves every state an edge enters
    (so not RESET), terminals included: a sample whose arrays broke is never handed on.
    """
    edges: list[Edge] = []
    for state in states:
        if state not in TERMINALS:
            edges.append(Edge(state, Trigger.CRASHED, State.FAILED))
        if state in awaiting:
            edges.append(Edge(state, Trigger.CANCELLED, State.ABORTED))
        if state not in (State.RESET, State.ABORTED):
            edges.append(Edge(state, Trigger.INVARIANT_VIOLATED, State.ABORTED, None, (actions.discard_response,)))
    return edges


# Every trigger `fault_edges` can add, read from it rather than listed.
FAULT_TRIGGERS = frozenset(e.trigger for e in fault_edges(["S"], {"S"}))
_CORE_NAMES = {d.name for d in STATES}


def check_tool_name(name: str) -> None:
    """Refuse a tool whose state would be a core state of the machine.

    A tool named `call` would become `TOOL_CALL`, the hub itself: the machine would gain a
    self-loop and the driver would never yield. Installed as a registry check, so the clash
    is refused at registration, not at the first rollout.
    """
    state = tool_state(name)
    if state in _CORE_NAMES:
        raise ValueError(f"a tool named {name!r} would get the state {state}, which is a core state of the machine: rename the tool")


tools.registry.add_name_check(check_tool_name)


class MachineDefinitionError(ValueError):
    """The definition cannot run: a state without its behaviour, a step the loop lacks, an edge to nowhere."""


@attrs.frozen
class MachineSpec:
    """The whole definition: states in drawing order with their definitions, and every edge.

    Checked when built: every edge joins two states of the spec, and a state that fires a
    trigger at once has a row of that trigger whose last row always holds (so firing it can
    never find no edge). `bind` checks the loop's steps against it.
    """

    states: tuple[str, ...]
    edges: tuple[Edge, ...]
    tool_states: dict[str, str]  # state -> tool name
    defs: dict[str, StateDef]

    def __attrs_post_init__(self) -> None:
        problems = [f"state {s} has no definition" for s in self.states if s not in self.defs]
        known = set(self.states)
        problems += [f"edge {e.source} --{e.trigger}--> {e.dest} joins a state the machine does not have"
                     for e in self.edges if e.source not in known or e.dest not in known]
        rows: dict[tuple[str, str], list[Edge]] = {}
        for e in self.edges:
            rows.setdefault((e.source, e.trigger), []).append(e)
        for s in self.states:
            fires = self.defs[s].fires if s in self.defs else None
            if fires is None:
                continue
            group = rows.get((s, str(fires)))
            if not group:
                problems.append(f"state {s} fires {fires} at once, but no edge of {fires} leaves it")
            elif group[-1].guard not in (None, otherwise):
                problems.append(f"state {s} fires {fires} at once, but its last row of {fires} has a guard "
                                f"({group[-1].guard_name}): end the group with `otherwise`")
        if problems:
            raise MachineDefinitionError("the machine's definition cannot run:\n  " + "\n  ".join(problems))

    @classmethod
    def from_registry(cls, tool_names: tuple[str, ...] | None = None) -> MachineSpec:
        names = tools.names() if tool_names is None else tool_names
        tool_states = {tool_state(n): n for n in names}
        legend = "runs the turn's waiting calls to the `{}` tool concurrently, then back to TOOL_CALL"
        tool_defs = [StateDef(s, "tool", legend.format(n), TOOL_STEP) for s, n in tool_states.items()]
        core = [d for d in STATES if d.kind == "core"]
        ordered = [*core[: core.index(BY_NAME[State.TOOL_CALL]) + 1], *tool_defs,
                   *core[core.index(BY_NAME[State.TOOL_CALL]) + 1:], *(d for d in STATES if d.kind == "terminal")]
        states = [d.name for d in ordered]
        edges = core_edges()
        for n in names:
            edges += tool_edges(n)
        edges += fault_edges(states, {d.name for d in ordered if d.awaits})
        return cls(tuple(states), tuple(edges), tool_states, {d.name: d for d in ordered})

    @property
    def awaiting(self) -> frozenset[str]:
        """States whose step awaits I/O (GENERATE and the tools)."""
        return frozenset(s for s, d in self.defs.items() if d.awaits)

    def triples(self) -> set[tuple[str, str, str]]:
        """Every (source, trigger, dest) the machine can take."""
        return {(str(e.source), str(e.trigger), str(e.dest)) for e in self.edges}

    def bind(self, steps: Mapping[str, StepT]) -> dict[str, Trigger | StepT]:
        """Each non-terminal state's behaviour, resolved: the trigger it fires, or its step from `steps`.

        `steps` are the loop's, by name (opaque here: the machine never runs them). A state
        naming a step that `steps` lacks is refused, with every such state named at once.
        """
        bound: dict[str, Trigger | StepT] = {}
        missing: list[str] = []
        for s in self.states:
            d = self.defs[s]
            if d.fires is not None:
                bound[s] = d.fires
            elif d.step is not None:
                if d.step in steps:
                    bound[s] = steps[d.step]
                else:
                    missing.append(f"state {s} runs the step {d.step!r}, which the loop does not define")
        if missing:
            raise MachineDefinitionError("\n  ".join(["the loop cannot drive this machine:", *missing,
                                                        f"(the loop's steps: {', '.join(sorted(steps))})"]))
        return bound

    def reason_statuses(self) -> dict[str, str]:
        """Every termination reason an edge can record, and the terminal status it ends in.

        An edge into TRIM records its reason on the way to TRUNCATED, so a reason recorded on
        the way to a non-terminal state ends where that state's edges (fault edges aside) all
        lead. An edge with `records` (reasons an action writes in place of the guard's name: the
        reply's own problem) ends with those instead of its guard's name.
        """
        # States a sample can reach with no reason recorded yet: only edges leaving them can
        # record one (TRIM is entered by edges that record theirs, so `trim` is never recorded),
        # except `invariant_violated`, whose reason replaces any other.
        open_states, frontier = {str(State.RESET)}, [str(State.RESET)]
        while frontier:
            here = frontier.pop()
            for e in self.edges:
                if e.source == here and e.reason is None and e.dest not in open_states:
                    open_states.add(e.dest)
                    frontier.append(e.dest)
        out: dict[str, str] = {}
        for e in self.edges:
            if e.reason is None or (e.source not in open_states and e.trigger != Trigger.INVARIANT_VIOLATED):
                continue
            ends = {e.dest} if e.dest in TERMINALS else {
                x.dest for x in self.edges if x.source == e.dest and x.trigger not in FAULT_TRIGGERS}
            if len(ends) != 1 or not ends <= TERMINALS:
                raise MachineDefinitionError(
                    f"the reason {e.reason!r} ({e.source} -> {e.dest}) leads to no one terminal: {sorted(ends)}")
            (status,) = ends
            for reason in e.records or (e.reason,):
                if out.setdefault(reason, status) != status:
                    raise MachineDefinitionError(f"the reason {reason!r} ends in both {out[reason]} and {status}")
        return out


def _after_edge(edge: Edge) -> Callable[[Rollout], None]:
    """After the edge: record it (with its guard), why the sample ends if it does, and check I1 (and I2 at the end)."""
    guard, reason = edge.guard_name, edge.reason
    step = (edge.source, edge.trigger, edge.dest)
    replaces = reason == Trigger.INVARIANT_VIOLATED  # the one reason that replaces another: the data is not trusted
    terminal = edge.dest in TERMINALS

    def after(r: Rollout) -> None:
        record = r.record
        record.trace.append(step)
        record.guards.append(guard)
        if replaces:
            record.reason = reason
        elif reason is not None and record.reason is None:
            record.reason = reason
        try:
            r.traj.check(max_total_length=r.budget_at_end() if terminal else None)
        except InvariantViolation as exc:
            record.violation = str(exc)

    return after


class _OrderedEvent(Event):
    """`transitions`' event, evaluated the short way over transitions' own rows.

    What it does is what `transitions.core.Event` does with this machine's configuration:
    the rows of the model's state are tried in order; the first whose conditions all hold
    runs its `before` callbacks, sets the state and runs its `after` callbacks; no row
    taken: False; no row from the state: MachineError. What it leaves out is what the table
    never uses (an `EventData` per trigger, prepare and machine-level callbacks, enter/exit
    callbacks, the queue, debug logging): `_TableMachine` refuses a configuration that uses
    any of them, so the two can never disagree. `RolloutMachine(spec, stock=True)` builds the
    same definition on the stock `Machine`; the tests walk both and compare every edge, and
    the bench measures both (docs/machine.md says why this one runs).
    """

    def trigger(self, model: Any, *args: Any, **kwargs: Any) -> bool:
        rows = self.transitions.get(model.state)
        if not rows:
            raise MachineError(f"Can't trigger event {self.name} from state {model.state}!")
        for row in rows:
            for condition in row.conditions:  # every row of the table has at most one
                if condition.func(*args, **kwargs) != condition.target:
                    break
            else:
                for before in row.before:
                    before(*args, **kwargs)
                model.state = row.dest
                for after in row.after:
                    after(*args, **kwargs)
                return True
        return False


class _TableMachine(Machine):
    """`transitions.Machine` whose events are `_OrderedEvent`s; refuses what they would skip."""

    event_cls = _OrderedEvent

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        skipped = [name for name in ("prepare_event", "before_state_change", "after_state_change", "finalize_event",
                                     "on_exception", "on_final") if getattr(self, name)]
        if self.has_queue or self.model_attribute != "state" or self.send_event or skipped:
            raise ValueError("the rollout machine's short path cannot honour: "
                             f"queued / model_attribute / send_event / {skipped}")
        for state in self.states.values():
            if state.on_enter or state.on_exit or state.final:
                raise ValueError(f"the rollout machine's short path skips enter/exit callbacks ({state.name})")
        for event in self.events.values():
            for source, rows in event.transitions.items():
                for row in rows:
                    named = [f for f in (*row.before, *row.after, *(c.func for c in row.conditions)) if not callable(f)]
                    if row.prepare or row.dest is None or named:
                        raise ValueError(f"{event.name} from {source}: the short path takes rows with a dest, "
                                         "no prepare callbacks, and functions (not names) as callbacks")


def machine_config(spec: MachineSpec) -> dict[str, Any]:
    """The `transitions` configuration of a spec: one transition per row, in table order.

    A row's guard is its condition (`otherwise` has none: the rows above it were tried
    first), its actions its `before` callbacks, and the bookkeeping its `after` callback.
    Callbacks get the rollout as their one argument (`send_event=False`: the trigger's
    arguments are passed on), so no model is ever attached with `add_model`.
    """
    transitions = [
        {"trigger": e.trigger, "source": e.source, "dest": e.dest,
         "conditions": [] if e.guard is None or e.guard is otherwise else [e.guard],
         "before": list(e.actions), "after": [_after_edge(e)]}
        for e in spec.edges
    ]
    return {"model": None, "states": list(spec.states), "transitions": transitions, "initial": str(State.RESET),
            "auto_transitions": False, "send_event": False}


class RolloutMachine:
    """The runtime machine of a `MachineSpec`. Thread-safe to share: it holds no sample state.

    One `transitions` machine holds the whole table: an event per trigger, its transitions
    the table's rows in order, each with its guard as condition, its actions as `before`
    and the edge's bookkeeping (trace, reason, cheap invariant check) as `after`.
    `fire(r, trigger)` triggers the event on the rollout through `machine.events`, the
    pattern transitions' maintainers give for many models: no `add_model`, nothing per sample.
    The events are `_OrderedEvent`s (the same rows, evaluated without transitions' generic
    per-trigger bookkeeping); `stock=True` runs transitions' own `Event` instead.
    """

    def __init__(self, spec: MachineSpec, *, stock: bool = False) -> None:
        self.spec = spec
        self.stock = stock
        self._machine = (Machine if stock else _TableMachine)(**machine_config(spec))
        self._events = self._machine.events

    def can(self, r: Rollout, trigger: str) -> bool:
        """Whether `trigger` has any edge from `r`'s state (guards aside)."""
        event = self._events.get(trigger)
        return event is not None and r.state in event.transitions

    def fire(self, r: Rollout, trigger: str) -> bool:
        """Take the first edge of `trigger` from `r.state` whose guard holds; False if none."""
        event = self._events.get(trigger)
        if event is None or r.state not in event.transitions:
            return False
        return event.trigger(r, r)  # the model, then the one argument every guard and callback gets


_lock = threading.Lock()
_cached: tuple[int, RolloutMachine] | None = None


def get_machine() -> RolloutMachine:
    """The process's machine for the current tool registry (rebuilt when a tool registers)."""
    global _cached
    version = tools.registry.version()
    cached = _cached
    if cached is not None and cached[0] == version:
        return cached[1]
    with _lock:
        if _cached is None or _cached[0] != version:
            _cached = (version, RolloutMachine(MachineSpec.from_registry()))
        return _cached[1]
