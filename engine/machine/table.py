"""The rollout machine: one table of states, one of edges, and the machine built from them.

`engine.machine.states` defines every core state once. `core_edges()` is the table of edges, read top to bottom: each
row is `source --trigger [guard]--> dest` with the actions done on the way. Rows of one
(source, trigger) are tried in order; the first whose guard holds is taken, and the last
row of a group is `otherwise` (drawn `[else]`), so a stop added above needs no negation
below. Registered tools add a state each (`TOOL_<NAME>`).

The runtime machine (`transitions`, sync, `auto_transitions=False`) and the diagrams are
both built from these tables. There is one machine per process (rebuilt only when the
tool registry changes) and no per-sample `add_model`: samples are triggered through
`machine.events[name].trigger(rollout)`, which costs microseconds, not a machine each.
After every transition the edge is appended to the sample's trace and the cheap
invariants are checked; a violation is recorded for the driver to act on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import attrs
from transitions import Machine, MachineError
from transitions.core import Event

from engine import tools
from engine.machine import actions, guards
from engine.machine.actions import Action
from engine.machine.guards import Guard, otherwise
from engine.machine.rollout import Rollout
from engine.machine.states import BY_NAME, STATES, TERMINALS, State, StateDef, Trigger
from engine.machine.trajectory import InvariantViolation

logging.getLogger("transitions").setLevel(logging.WARNING)  # 4 log lines per edge otherwise
S, T = State, Trigger


@attrs.frozen
class Edge:
    """One row of the table. `reason` is recorded when the edge ends the sample or trims it."""

    source: str = attrs.field(converter=str)  # plain strings: State/Trigger members come in, names go out
    trigger: str = attrs.field(converter=str)
    dest: str = attrs.field(converter=str)
    guard: Guard | None = None
    actions: tuple[Action, ...] = ()

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


def core_edges() -> list[Edge]:
    """The machine, as a table. Tools' edges are added by `tool_edges`, fault edges by `fault_edges`."""
    g, a = guards, actions
    E = Edge
    # fmt: off
    return [
        # source          trigger               dest            guard                       actions
        E(S.RESET,        T.START,              S.BUDGET_CHECK, None,                       (a.reset_rollout,)),
        E(S.RESET,        T.RESUME,             S.RESUME,       g.checkpoint_valid,         (a.restore_checkpoint,)),
        E(S.RESET,        T.RESUME,             S.BUDGET_CHECK, otherwise,                  (a.reset_rollout,)),
        E(S.RESUME,       T.CONTINUE,           S.TOOL_CALL,    g.tools_pending,            (a.plan_tool_calls,)),
        E(S.RESUME,       T.CONTINUE,           S.BUDGET_CHECK, otherwise),
        E(S.BUDGET_CHECK, T.CHECK,              S.ABORTED,      g.abort_requested),
        E(S.BUDGET_CHECK, T.CHECK,              S.TRUNCATED,    g.prompt_over_budget),
        E(S.BUDGET_CHECK, T.CHECK,              S.TRUNCATED,    g.context_full),
        E(S.BUDGET_CHECK, T.CHECK,              S.TRUNCATED,    g.no_new_tokens_asked),
        E(S.BUDGET_CHECK, T.CHECK,              S.TRUNCATED,    g.max_turns_reached),
        E(S.BUDGET_CHECK, T.CHECK,              S.GENERATE,     otherwise,                  (a.clamp_max_new_tokens,)),
        E(S.GENERATE,     T.REPLY,              S.ABORTED,      g.reply_unusable,           (a.record_unusable_reply,)),
        E(S.GENERATE,     T.REPLY,              S.ABORTED,      g.top_p_replay_dropped,     (a.record_unusable_reply,)),
        E(S.GENERATE,     T.REPLY,              S.TRIM,         g.reply_over_budget,        (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.ABORTED,      g.server_aborted,           (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.TRUNCATED,    g.finished_length,          (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.ENVIRONMENT,  g.environment_answers,     (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.COMPLETED,    g.answered,                 (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.TRUNCATED,    g.tool_calls_exhausted,     (a.append_model_turn,)),
        E(S.GENERATE,     T.REPLY,              S.TOOL_CALL,    g.calls_tool,               (a.append_model_turn, a.plan_tool_calls)),
        E(S.GENERATE,     T.REPLY,              S.TOOL_CALL,    g.invalid_action,           (a.append_model_turn, a.plan_tool_calls)),
        E(S.GENERATE,     T.CONTEXT_REJECTED,   S.TRUNCATED),
        E(S.GENERATE,     T.REQUEST_FAILED,     S.ABORTED),
        E(S.GENERATE,     T.REQUEST_REJECTED,   S.FAILED),
        E(S.TOOL_CALL,    T.OBSERVE,            S.TRIM,         g.observation_over_budget,  (a.append_observation,)),
        E(S.TOOL_CALL,    T.OBSERVE,            S.BUDGET_CHECK, otherwise,                  (a.append_observation,)),
        E(S.ENVIRONMENT,  T.ENV_REPLY,          S.COMPLETED,    g.environment_done,         (a.record_env_reply,)),
        E(S.ENVIRONMENT,  T.ENV_REPLY,          S.TRIM,         g.observation_over_budget,  (a.record_env_reply, a.append_user_turn)),
        E(S.ENVIRONMENT,  T.ENV_REPLY,          S.BUDGET_CHECK, otherwise,                  (a.record_env_reply, a.append_user_turn)),
        E(S.ENVIRONMENT,  T.ENV_FAILED,         S.FAILED),
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


@attrs.frozen
class MachineSpec:
    """The whole definition: states in drawing order with their definitions, and every edge."""

    states: tuple[str, ...]
    edges: tuple[Edge, ...]
    tool_states: dict[str, str]  # state -> tool name
    defs: dict[str, StateDef]

    @classmethod
    def from_registry(cls, tool_names: tuple[str, ...] | None = None) -> MachineSpec:
        names = tools.names() if tool_names is None else tool_names
        tool_states = {tool_state(n): n for n in names}
        tool_defs = [StateDef(s, "tool", f"runs the turn's waiting calls to the `{n}` tool concurrently, then back to TOOL_CALL", awaits=True)
                     for s, n in tool_states.items()]
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


def edge_event(edge: Edge) -> str:
    """The `transitions` event of one row: `trigger[guard]`, or the bare trigger for an unguarded row."""
    return f"{edge.trigger}[{edge.guard_name}]" if edge.guard is not None else edge.trigger


class _RowEvent(Event):
    """A `transitions` event that takes its row the short way.

    The table's rows need less than transitions' general path gives every event: `fire` has
    already picked the row by its guard (no conditions), states have no enter/exit callbacks,
    and nothing is queued. So a trigger runs the row's actions, sets the state and runs the
    bookkeeping, without an `EventData`, six empty callback lists and debug logging per
    edge (2/3 of an edge's cost measured through the stock path). It is installed through
    `transitions`' own extension point (`Machine.event_cls`), and the table, its validation and
    the diagrams remain `transitions`'.
    """

    def trigger(self, model: Rollout, *args: object, **kwargs: object) -> bool:
        rows = self.transitions.get(model.state)
        if not rows:
            raise MachineError(f"{self.name} cannot be taken from state {model.state}")
        row = rows[0]  # one row per (event, source): `edge_event` names each row apart
        for action in row.before:
            action(model)
        model.state = row.dest
        for after in row.after:
            after(model)
        return True


class _TableMachine(Machine):
    """`transitions.Machine` whose events take their row directly (see `_RowEvent`)."""

    event_cls = _RowEvent

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The short path honours only what this table uses; refuse anything it would skip.
        skipped = [name for name in ("prepare_event", "before_state_change", "after_state_change", "finalize_event",
                                     "on_exception", "on_final") if getattr(self, name)]
        if self.has_queue or self.model_attribute != "state" or skipped:
            raise ValueError(f"the rollout machine's short path cannot honour: queued / model_attribute / {skipped}")
        for state in self.states.values():
            if state.on_enter or state.on_exit or state.final:
                raise ValueError(f"the rollout machine's short path skips enter/exit callbacks ({state.name})")
        for event in self.events.values():
            for source, rows in event.transitions.items():
                if len(rows) != 1 or rows[0].conditions or rows[0].prepare or rows[0].dest is None:
                    raise ValueError(f"{event.name} from {source}: the short path takes one unconditional row with a dest")


class RolloutMachine:
    """The runtime machine of a `MachineSpec`. Thread-safe to share: it holds no sample state.

    Each row of the table is one `transitions` event (`reply[calls_tool]`), which owns the
    state change (the short way, `_RowEvent`): it checks the source state, runs the row's actions before it and the
    bookkeeping after it. `fire(r, trigger)` reads the table as it is written, trying the
    rows of (state, trigger) in order and taking the first whose guard holds. Letting
    `transitions` try the rows itself costs a full transition attempt (callbacks, logging)
    per row that fails: 4x the cost of the transition taken, on the hottest path there is.
    """

    def __init__(self, spec: MachineSpec) -> None:
        self.spec = spec
        # Actions and the after-edge bookkeeping are called with the rollout itself: no wrapper per call.
        transitions = [
            {"trigger": edge_event(e), "source": e.source, "dest": e.dest, "before": list(e.actions), "after": [_after_edge(e)]}
            for e in spec.edges
        ]
        self._machine = _TableMachine(
            model=None,
            states=list(spec.states),
            transitions=transitions,
            initial=str(State.RESET),
            auto_transitions=False,
            send_event=False,
        )
        self._rows: dict[tuple[str, str], list[tuple[Guard | None, Event]]] = {}
        for e in spec.edges:
            guard = None if e.guard is otherwise else e.guard  # `otherwise`: the rows above it were tried first
            self._rows.setdefault((e.source, e.trigger), []).append((guard, self._machine.events[edge_event(e)]))

    def can(self, r: Rollout, trigger: str) -> bool:
        """Whether `trigger` has any edge from `r`'s state (guards aside)."""
        return (r.state, trigger) in self._rows

    def fire(self, r: Rollout, trigger: str) -> bool:
        """Take the first edge of `trigger` from `r.state` whose guard holds; False if none."""
        for guard, event in self._rows.get((r.state, trigger), ()):
            if guard is None or guard(r):
                return event.trigger(r)
        return False


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
