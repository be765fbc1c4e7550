"""The rollout machine: one table of states, edges and guards, and the machine built from it.

Read `core_edges()` top to bottom: each row is an edge `source --trigger [guard]--> dest`
with the action done on the way. Rows of one (source, trigger) are tried in order; the
first whose guard holds is taken. Registered tools add a state each (`TOOL_<NAME>`).

The runtime machine (`transitions`, sync, `auto_transitions=False`) and the diagrams
are both built from these rows. There is one machine per process (rebuilt only when the
tool registry changes) and no per-sample `add_model`: samples are triggered through
`machine.events[name].trigger(rollout)`, which costs microseconds, not a machine each.
After every transition the edge is appended to the sample's trace and the cheap
invariants are checked; a violation is recorded for the driver to act on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import attrs
from transitions import EventData, Machine

import tools
from engine.machine import actions as a
from engine.machine import guards as g
from engine.machine.rollout import Rollout
from engine.machine.trajectory import InvariantViolation

logging.getLogger("transitions").setLevel(logging.WARNING)  # 4 log lines per edge otherwise

RESET, RESUME, BUDGET_CHECK, GENERATE, TOOL_CALL, TRIM = "RESET", "RESUME", "BUDGET_CHECK", "GENERATE", "TOOL_CALL", "TRIM"
COMPLETED, TRUNCATED, ABORTED, FAILED = "COMPLETED", "TRUNCATED", "ABORTED", "FAILED"
TERMINALS = frozenset({COMPLETED, TRUNCATED, ABORTED, FAILED})


@attrs.frozen
class Edge:
    """One row of the table. `reason` is recorded when the edge ends the sample or trims it."""

    source: str
    trigger: str
    dest: str
    guard: g.Guard | None = None
    action: a.Action | tuple[a.Action, ...] | None = None

    @property
    def actions(self) -> tuple[a.Action, ...]:
        if self.action is None:
            return ()
        return self.action if isinstance(self.action, tuple) else (self.action,)

    @property
    def label(self) -> str:
        """`trigger [guard]`, as the diagrams print it."""
        return f"{self.trigger} [{self.guard.__name__}]" if self.guard else self.trigger

    @property
    def reason(self) -> str | None:
        if self.dest in TERMINALS or self.dest == TRIM:
            return self.guard.__name__ if self.guard else self.trigger
        return None


def tool_state(name: str) -> str:
    """The machine state of a registered tool."""
    return f"TOOL_{name.upper()}"


def core_edges() -> list[Edge]:
    """The machine, as a table. Tools' edges are added by `tool_edges`."""
    E = Edge
    return [
        # source        trigger               dest          guard                        action
        E(RESET,        "start",              BUDGET_CHECK, None,                        a.reset_rollout),
        E(RESET,        "resume",             RESUME,       g.checkpoint_valid,          a.restore_checkpoint),
        E(RESET,        "resume",             BUDGET_CHECK, g.checkpoint_rejected,       a.reset_rollout),
        E(RESUME,       "continue",           TOOL_CALL,    g.tools_pending,             a.plan_tool_calls),
        E(RESUME,       "continue",           BUDGET_CHECK, g.generation_pending),
        E(BUDGET_CHECK, "check",              ABORTED,      g.abort_requested),
        E(BUDGET_CHECK, "check",              TRUNCATED,    g.prompt_over_budget),
        E(BUDGET_CHECK, "check",              TRUNCATED,    g.context_full),
        E(BUDGET_CHECK, "check",              TRUNCATED,    g.no_new_tokens_asked),
        E(BUDGET_CHECK, "check",              TRUNCATED,    g.max_turns_reached),
        E(BUDGET_CHECK, "check",              GENERATE,     g.room_left,                 a.clamp_max_new_tokens),
        E(GENERATE,     "reply",              ABORTED,      g.reply_unusable,            a.record_unusable_reply),
        E(GENERATE,     "reply",              ABORTED,      g.top_p_replay_dropped,      a.record_unusable_reply),
        E(GENERATE,     "reply",              TRIM,         g.reply_over_budget,         a.append_model_turn),
        E(GENERATE,     "reply",              ABORTED,      g.server_aborted,            a.append_model_turn),
        E(GENERATE,     "reply",              TRUNCATED,    g.finished_length,           a.append_model_turn),
        E(GENERATE,     "reply",              COMPLETED,    g.answered,                  a.append_model_turn),
        E(GENERATE,     "reply",              TRUNCATED,    g.tool_calls_exhausted,      a.append_model_turn),
        E(GENERATE,     "reply",              TOOL_CALL,    g.calls_tool,                (a.append_model_turn, a.plan_tool_calls)),
        E(GENERATE,     "reply",              TOOL_CALL,    g.invalid_action,            (a.append_model_turn, a.plan_tool_calls)),
        E(GENERATE,     "context_rejected",   TRUNCATED),
        E(GENERATE,     "request_failed",     ABORTED),
        E(GENERATE,     "request_rejected",   FAILED),
        E(TOOL_CALL,    "observe",            TRIM,         g.observation_over_budget,   a.append_observation),
        E(TOOL_CALL,    "observe",            BUDGET_CHECK, g.observation_fits,          a.append_observation),
        E(TRIM,         "trim",               TRUNCATED,    None,                        a.trim_to_budget),
    ]


def tool_edges(name: str) -> list[Edge]:
    """A registered tool's state: entered while calls to it wait, left when they are answered."""
    state = tool_state(name)
    return [
        Edge(TOOL_CALL, "dispatch", state, g.calls_for(name)),
        Edge(state, "tool_done", TOOL_CALL),
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
            edges.append(Edge(state, "crashed", FAILED))
        if state in awaiting:
            edges.append(Edge(state, "cancelled", ABORTED))
        if state not in (RESET, ABORTED):
            edges.append(Edge(state, "invariant_violated", ABORTED, None, a.discard_response))
    return edges


@attrs.frozen
class MachineSpec:
    """The whole definition: states in drawing order, and every edge."""

    states: tuple[str, ...]
    edges: tuple[Edge, ...]
    tool_states: dict[str, str]  # state -> tool name

    @classmethod
    def from_registry(cls, tool_names: tuple[str, ...] | None = None) -> MachineSpec:
        names = tools.names() if tool_names is None else tool_names
        tool_states = {tool_state(n): n for n in names}
        states = [RESET, RESUME, BUDGET_CHECK, GENERATE, TOOL_CALL, *tool_states, TRIM, COMPLETED, TRUNCATED, ABORTED, FAILED]
        edges = core_edges()
        for n in names:
            edges += tool_edges(n)
        edges += fault_edges(states, {GENERATE, *tool_states})
        return cls(tuple(states), tuple(edges), tool_states)

    def triples(self) -> set[tuple[str, str, str]]:
        """Every (source, trigger, dest) the machine can take."""
        return {(e.source, e.trigger, e.dest) for e in self.edges}


def _call(fn: Callable[[Rollout], object]) -> Callable[[EventData], object]:
    return lambda event: fn(event.model)


def _after_edge(edge: Edge) -> Callable[[EventData], None]:
    """Record the edge taken (with its guard) and, on an ending edge, why the sample ends."""
    guard, reason = (edge.guard.__name__ if edge.guard else None), edge.reason
    step = (edge.source, edge.trigger, edge.dest)

    def after(event: EventData) -> None:
        r: Rollout = event.model
        r.trace.append(step)
        r.guards.append(guard)
        if reason == "invariant_violated":
            r.reason = reason  # the one reason that replaces another: the data is not trusted
        elif reason is not None:
            r.stop_because(reason)

    return after


def _check_invariants(event: EventData) -> None:
    """After every transition: I1 (cheap, lengths), and I2 once the sample has ended."""
    r: Rollout = event.model
    try:
        r.traj.check(max_total_length=r.budget_at_end() if r.state in TERMINALS else None)
    except InvariantViolation as exc:
        r.violation = str(exc)


class RolloutMachine:
    """The runtime machine of a `MachineSpec`. Thread-safe to share: it holds no sample state."""

    def __init__(self, spec: MachineSpec) -> None:
        self.spec = spec
        transitions = []
        for e in spec.edges:
            transitions.append(
                {
                    "trigger": e.trigger,
                    "source": e.source,
                    "dest": e.dest,
                    "conditions": [_call(e.guard)] if e.guard else [],
                    "before": [_call(fn) for fn in e.actions],
                    "after": [_after_edge(e)],
                }
            )
        self._machine = Machine(
            model=None,
            states=list(spec.states),
            transitions=transitions,
            initial=RESET,
            auto_transitions=False,
            send_event=True,
            after_state_change=_check_invariants,
        )
        self._events = self._machine.events

    def can(self, r: Rollout, trigger: str) -> bool:
        """Whether `trigger` has any edge from `r`'s state (guards aside)."""
        return bool(self._machine.get_transitions(trigger, source=r.state))

    def fire(self, r: Rollout, trigger: str) -> bool:
        """Take the first edge of `trigger` from `r.state` whose guard holds; False if none."""
        return bool(self._events[trigger].trigger(r))


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
