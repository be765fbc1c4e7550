"""The per-sample loop: do a state's I/O, fire the trigger it yields, repeat until terminal.

Each non-terminal state has one step: a coroutine that awaits what the state needs
(an HTTP reply, tool results), stores it on the `Rollout`, and names the trigger. The
machine then picks the edge by its guards. Nothing raised in a step escapes: an error
fires `crashed`, a cancellation fires `cancelled` (and is re-raised), a broken
invariant fires `invariant_violated`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import tools
from engine.machine import checkpoint
from engine.machine.table import BUDGET_CHECK, GENERATE, RESET, RESUME, TERMINALS, TOOL_CALL, TRIM, RolloutMachine, get_machine
from engine.machine.rollout import Rollout
from engine.loop.runtime import Runtime
from engine.loop.text import IncrementalText
from engine.machine.trajectory import InvariantViolation
from engine.sglang.wire import Failure

Step = Callable[[Runtime, Rollout], Awaitable[str]]
FAILURE_TRIGGERS = {"context_exceeded": "context_rejected", "rejected": "request_rejected", "unavailable": "request_failed"}


class NoEdge(RuntimeError):
    """No guard of a trigger held: the table is incomplete. A bug, recorded as a crash."""


async def step_reset(rt: Runtime, r: Rollout) -> str:
    r.prompt_ids = await rt.prompt_ids(r.prompt, r.allowed_tools)
    if not (r.cfg.partial_rollout and r.saved is not None):
        return "start"
    restored = checkpoint.validate(r.saved, r.prompt_ids, r.cfg.mask_offpolicy)
    if isinstance(restored, str):
        r.resume_rejected = restored
    else:
        r.resume = restored
        if restored.resume_at == "tools":  # the cut-off calls are read again from their turn
            last = restored.traj.segments[-1]
            r.turn = rt.profile.parse_turn(rt.profile.decode(restored.traj.response_ids[last.start : last.end].tolist()))
    return "resume"


async def step_resume(rt: Runtime, r: Rollout) -> str:
    return "continue"


async def step_budget_check(rt: Runtime, r: Rollout) -> str:
    return "check"


async def step_generate(rt: Runtime, r: Rollout) -> str:
    started = time.perf_counter()
    outcome = await rt.client.generate(
        r.traj.input_ids(), r.sampling_params, r.max_new_tokens, routing_key=r.routing_key
    )
    r.generation_time += time.perf_counter() - started
    r.reply, r.turn = None, None
    if isinstance(outcome, Failure):
        r.error = f"{outcome.kind}: {outcome.message}"
        return FAILURE_TRIGGERS[outcome.kind]
    r.reply = outcome
    if outcome.problem is None:
        # A resumed turn continues the tokens it had: parse the whole turn, not the tail.
        before = r.traj.response_ids[r.traj.response_length - r.partial_turn_tokens :].tolist() if r.partial_turn_tokens else []
        r.turn = rt.profile.parse_turn(rt.profile.decode(before + outcome.ids))
    else:
        r.error = f"{outcome.problem}: {outcome.problem_detail}"
    return "reply"


async def step_tool_call(rt: Runtime, r: Rollout) -> str:
    if r.calls:
        return "dispatch"
    assert r.turn is not None
    order = {id(call): i for i, call in enumerate(r.turn.calls)}  # answers in the turn's call order
    results = sorted(r.results, key=lambda res: order.get(id(res.call), len(order)))
    last = r.traj.response_ids[-1] if r.traj.response_length else None
    r.observation_ids = rt.profile.observation_ids(r.turn, results, last)
    return "observe"


async def step_trim(rt: Runtime, r: Rollout) -> str:
    return "trim"


async def run_tool_calls(rt: Runtime, r: Rollout, name: str) -> str:
    """A tool state's step: run every waiting call to this tool, concurrently."""
    mine = [c for c in r.calls if c.name == name]
    r.calls = [c for c in r.calls if c.name != name]
    tool = tools.get(name)
    assert tool is not None, f"tool {name} left the registry mid-rollout"
    started = time.perf_counter()
    if name not in r.tool_states:
        r.tool_states[name] = await tool.create()
    results = await asyncio.gather(*(rt.tool_runner.call(tool, r.tool_states[name], c) for c in mine))
    elapsed = time.perf_counter() - started
    r.tool_time += elapsed
    stats = r.tool_stats
    stats["calls"] = stats.get("calls", 0) + len(results)
    stats["seconds"] = stats.get("seconds", 0.0) + elapsed
    for res in results:
        for key, amount in res.stats.items():  # what the tool counted: retries, waiting, ...
            stats[key] = stats.get(key, 0) + amount
        if res.error:
            r.count_tool_error(res.error)
            if res.error == "timeout":
                stats["timeouts"] = stats.get("timeouts", 0) + 1
    r.results.extend(results)
    return "tool_done"


STEPS: dict[str, Step] = {
    RESET: step_reset,
    RESUME: step_resume,
    BUDGET_CHECK: step_budget_check,
    GENERATE: step_generate,
    TOOL_CALL: step_tool_call,
    TRIM: step_trim,
}


def _fire(machine: RolloutMachine, r: Rollout, trigger: str) -> None:
    if not machine.fire(r, trigger):
        raise NoEdge(f"no edge of {trigger!r} from {r.state} has a guard that holds")


def _fire_fault(machine: RolloutMachine, r: Rollout, trigger: str) -> None:
    """Fire a fault edge; if even that fails, the sample is ended by hand as ABORTED."""
    try:
        _fire(machine, r, trigger)
    except Exception as exc:  # the machine itself is broken: keep the batch alive anyway
        r.error = f"{r.error or ''}; {trigger} failed: {exc}"
        r.traj.reset(r.prompt_ids)
        r.trace.append((r.state, trigger, "ABORTED"))
        r.guards.append(None)
        r.state = "ABORTED"
        r.reason = r.reason or f"{trigger}_failed"


async def drive(rt: Runtime, r: Rollout, machine: RolloutMachine | None = None) -> Rollout:
    """Walk `r` from RESET to a terminal state. Re-raises only CancelledError, after recording it."""
    machine = machine or get_machine()
    text = IncrementalText(rt.profile.decode)
    try:
        while r.state not in TERMINALS:
            tool_name = machine.spec.tool_states.get(r.state)
            try:
                if tool_name is not None:
                    trigger = await run_tool_calls(rt, r, tool_name)
                else:
                    trigger = await STEPS[r.state](rt, r)
                _fire(machine, r, trigger)
                r.text = text.sync(r.traj.response_ids)
            except asyncio.CancelledError:
                r.error = "cancelled while in " + r.state
                _fire_fault(machine, r, "cancelled" if machine.can(r, "cancelled") else "crashed")
                raise
            except Exception as exc:
                r.error = f"{type(exc).__name__}: {exc}"
                _fire_fault(machine, r, "crashed")
            if r.violation is not None:
                _fire_fault(machine, r, "invariant_violated")
        finish(rt, r, machine, text)
    finally:
        await release_tool_states(r)
    return r


def finish(rt: Runtime, r: Rollout, machine: RolloutMachine, text: IncrementalText) -> None:
    """At the terminal: the full check (I1-I4, I2, and the text against one full decode)."""
    try:
        r.text = text.sync(r.traj.response_ids)
        r.traj.check(max_total_length=r.budget_at_end(), full=True, decode=rt.profile.decode, text=r.text)
    except Exception as exc:  # InvariantViolation, or a decode that failed
        r.violation = str(exc) if isinstance(exc, InvariantViolation) else f"text: {exc}"
        if r.state != "ABORTED":
            _fire_fault(machine, r, "invariant_violated")
        r.text = rt.profile.decode(r.traj.response_ids.tolist())


async def release_tool_states(r: Rollout) -> None:
    """Give every tool its per-trajectory state back, whatever happened."""
    for name, state in list(r.tool_states.items()):
        tool = tools.get(name)
        try:
            if tool is not None:
                await asyncio.shield(tool.release(state))
        except Exception:  # a release failure must not hide the sample's own outcome
            pass
    r.tool_states.clear()


def new_rollout(
    rt: Runtime, prompt: Any, sampling_params: dict[str, Any], *, tools_requested: Any = None, **fields: Any
) -> Rollout:
    """A rollout at RESET for a prompt. `tools_requested` narrows the tools (a sample's own list)."""
    params = dict(sampling_params)
    asked = params.get("max_new_tokens")
    return Rollout(
        rt.cfg,
        abort_check=rt.abort_requested,
        prompt=prompt,
        sampling_params=params,
        asked_max_new_tokens=None if asked is None else int(asked),
        allowed_tools=rt.allowed_tools(tools_requested),
        **fields,
    )
