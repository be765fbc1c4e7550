"""Figure 2: what the machine costs per sample (setup) and per transition.

Setup: the engine attaches nothing to a machine; a sample is a `Rollout(...)` and is
triggered through the one shared machine. The comparison is the pattern `transitions`' maintainers advise
against for many models, `Machine.add_model` per sample, measured on the same machine (same states and
edges). `Rollout` has `__slots__`, so `add_model` could not even bind its trigger methods
to it: the comparison attaches plain objects, which is the cheapest case for add_model.

Transition: a real cycle BUDGET_CHECK -check-> GENERATE -reply-> TOOL_CALL -observe->
BUDGET_CHECK, each edge with its guards (tried in table order) and actions, against a
plain Python function walking the same table: the same guard calls, the same actions and
the same after-edge bookkeeping (trace, guard, reason, the cheap invariant check), with
`transitions` taken out. Reading the table keeps the comparison honest as edges change.
A third row runs the same cycle on the same definition through transitions' stock `Event`
(`RolloutMachine(spec, stock=True)`), against the engine's: the price of the stock path
per edge, which is why the engine's event evaluates the rows itself (docs/machine.md).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from engine.machine import actions as a
from engine.local.bench.common import Figure, Sizes, median
from engine.settings import EngineConfig
from engine.machine.states import TERMINALS, State
from engine.machine.table import Edge, RolloutMachine, get_machine
from engine.profiles.base import ToolCall, Turn
from engine.machine.rollout import Inputs, Rollout, TurnScratch
from engine.machine.trajectory import InvariantViolation
from engine.sglang.wire import Reply

CYCLE_TRANSITIONS = 3
_CFG = EngineConfig(max_turns=100_000, max_tool_calls=1_000_000)  # the most each allows
_PARAMS = {"temperature": 1.0, "max_new_tokens": 1024}
_REPLY = Reply(list(range(1000, 1032)), [-0.5] * 32, "stop", "</code>")
_TURN = Turn("tool", calls=(ToolCall("code_interpreter", {"code": "print(1)"}),))
_OBSERVATION = list(range(2000, 2011))


def _rollout() -> Rollout:
    """A rollout parked at BUDGET_CHECK with a tool turn and its observation ready to replay."""
    r = Rollout(Inputs(_CFG, prompt="p", sampling_params=dict(_PARAMS), allowed_tools=frozenset({"code_interpreter"}),
                       asked_max_new_tokens=1024))
    r.prompt_ids = tuple(range(300))
    a.reset_rollout(r)
    r.state = State.BUDGET_CHECK.value
    return r


def fsm_cycle(machine: RolloutMachine, r: Rollout, cycles: int) -> None:
    """`cycles` turns of check -> reply -> observe through `RolloutMachine.fire`."""
    fire = machine.fire
    for _ in range(cycles):
        fire(r, "check")
        r.turn = TurnScratch(reply=_REPLY, parsed=_TURN)
        fire(r, "reply")
        r.turn.observation_ids = _OBSERVATION
        fire(r, "observe")
    assert r.state == State.BUDGET_CHECK and not r.record.violation


Index = dict[tuple[str, str], list[Edge]]


def edge_index(machine: RolloutMachine) -> Index:
    """The machine's own table, grouped by (source, trigger) in table order."""
    index: Index = {}
    for e in machine.spec.edges:
        index.setdefault((e.source, e.trigger), []).append(e)
    return index


def plain_fire(index: Index, r: Rollout, trigger: str) -> bool:
    """What `RolloutMachine.fire` does, as plain Python over the same table: the first edge
    whose guard holds runs its actions, moves the state, records the edge (and guard, and
    ending reason) and checks the cheap invariants, exactly as the machine's callbacks do."""
    for e in index.get((r.state, trigger), ()):
        if e.guard is None or e.guard(r):
            for action in e.actions:
                action(r)
            r.state = e.dest
            r.record.trace.append((e.source, e.trigger, e.dest))
            r.record.guards.append(e.guard_name)
            if e.reason is not None:
                r.stop_because(e.reason)
            try:
                r.traj.check(max_total_length=r.budget_at_end() if e.dest in TERMINALS else None)
            except InvariantViolation as exc:
                r.record.violation = str(exc)
            return True
    return False


def plain_cycle(index: Index, r: Rollout, cycles: int) -> None:
    """`fsm_cycle` with `plain_fire` in place of the machine."""
    for _ in range(cycles):
        plain_fire(index, r, "check")
        r.turn = TurnScratch(reply=_REPLY, parsed=_TURN)
        plain_fire(index, r, "reply")
        r.turn.observation_ids = _OBSERVATION
        plain_fire(index, r, "observe")
    assert r.state == State.BUDGET_CHECK and not r.record.violation


def _per_call(fn: Any, count: int) -> float:
    """Seconds per call of `fn()` repeated `count` times (gc collected first, left on)."""
    gc.collect()
    started = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - started) / count


class _Model:
    """A plain object for `add_model` (no slots, identity equality)."""


def _add_model_cost(machine: RolloutMachine, n: int) -> float:
    """Seconds per `add_model` when `n` samples join the shared machine one by one."""
    m = machine._machine  # the same `transitions.Machine` the engine triggers through
    models = [_Model() for _ in range(n)]
    gc.collect()
    started = time.perf_counter()
    for model in models:
        m.add_model(model)
    elapsed = time.perf_counter() - started
    m.remove_model(models)
    return elapsed / n


def fsm_figures(sizes: Sizes) -> list[Figure]:
    """Setup and per-transition cost, medians over `sizes.repeats` runs."""
    machine = get_machine()
    index = edge_index(machine)
    stock_machine = RolloutMachine(machine.spec, stock=True)
    setup, add_model, fsm, plain, stock = [], [], [], [], []
    for _ in range(sizes.repeats):
        setup.append(_per_call(lambda: Rollout(Inputs(_CFG, prompt="p", sampling_params=dict(_PARAMS), routing_key="k",
                                               allowed_tools=frozenset({"code_interpreter"}), asked_max_new_tokens=1024)),
                               sizes.fsm_setups))
        add_model.append(_add_model_cost(machine, sizes.add_models))
        r = _rollout()
        fsm.append(_per_call(lambda: fsm_cycle(machine, r, sizes.fsm_cycles), 1) / (sizes.fsm_cycles * CYCLE_TRANSITIONS))
        r = _rollout()
        plain.append(_per_call(lambda: plain_cycle(index, r, sizes.fsm_cycles), 1) / (sizes.fsm_cycles * CYCLE_TRANSITIONS))
        r = _rollout()
        stock.append(_per_call(lambda: fsm_cycle(stock_machine, r, sizes.fsm_cycles), 1) / (sizes.fsm_cycles * CYCLE_TRANSITIONS))
    us = 1e6
    states = len(machine.spec.states)
    return [
        Figure("fsm_setup", "per-sample setup: Rollout(...), no add_model", median(setup) * us, "us",
               median(add_model) * us, f"Machine.add_model ({states} states, {sizes.add_models} models)", "value", "<=",
               5.0, sizes.repeats, {"add_model_us": median(add_model) * us}),
        Figure("fsm_transition", "per transition: RolloutMachine.fire (guards + actions)", median(fsm) * us, "us",
               median(plain) * us, "plain Python over the same table", "value", "<=", 10.0, sizes.repeats,
               {"machine_overhead_us": (median(fsm) - median(plain)) * us, "cycles": sizes.fsm_cycles}),
        Figure("fsm_transition_stock", "per transition: the same machine through transitions' stock Event",
               median(stock) * us, "us", median(fsm) * us, "RolloutMachine.fire (the engine's event)", None, None, None,
               sizes.repeats, {"extra_us_per_edge": (median(stock) - median(fsm)) * us, "cycles": sizes.fsm_cycles}),
    ]
