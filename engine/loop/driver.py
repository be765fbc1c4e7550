"""The per-sample loop: do a state's I/O, fire the trigger it yields, repeat until terminal.

What a state does is written in its definition (`StateDef.does`, engine/machine/states.py):
a trigger fired at once when the state needs no I/O, or a `Step` named there and defined
here (`@step("name")`): a coroutine that awaits what the state needs (an HTTP reply, tool
results), stores it in the rollout's turn scratch, and names the trigger. The machine then
picks the edge by its guards. The first time a machine is driven its states are bound to
these steps (`MachineSpec.bind`): a step the definition names and this module lacks is one
error naming the state, before any sample moves. Nothing raised in a step escapes: an
error fires `crashed`, a cancellation fires `cancelled` (and is re-raised), a broken
invariant fires `invariant_violated`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from engine import envs, tools
from engine.aio import within
from engine.logs import log_once
from engine.loop import environment as episodes
from engine.loop.harness import Harness
from engine.loop.runtime import Runtime, full_collections
from engine.machine import actions, checkpoint
from engine.machine.rollout import Compaction, Inputs, Rollout, Saved, SegmentBreak, TurnScratch
from engine.machine.states import STATES, TERMINALS, TOOL_STEP, State, Trigger
from engine.machine.table import MachineDefinitionError, RolloutMachine, get_machine, tool_of
from engine.machine.trajectory import InvariantViolation
from engine.profiles.chat import prompt_messages, result_contents
from engine.profiles.history import History, extends
from engine.sglang.wire import Failure, Reply, require_routed_experts, require_top_p, top_p_asked

StateStep = Callable[[Runtime, Rollout], Awaitable[str]]
STEPS: dict[str, StateStep] = {}
"""The loop's steps by the name a state's definition gives (`Step(name)`)."""


def step(name: str) -> Callable[[StateStep], StateStep]:
    """Register the decorated coroutine as the step named `name` (a state's `Step(name)` runs it)."""

    def register(fn: StateStep) -> StateStep:
        if name in STEPS:
            raise ValueError(f"two steps named {name!r}: {STEPS[name].__qualname__} and {fn.__qualname__}")
        STEPS[name] = fn
        return fn

    return register

FAILURE_TRIGGERS = {
    "context_exceeded": Trigger.CONTEXT_REJECTED,
    "rejected": Trigger.REQUEST_REJECTED,
    "unavailable": Trigger.REQUEST_FAILED,
}


DEFAULT_ENVIRONMENT: Any = object()  # new_rollout's default: the runtime's own (engine_environment)


class NoEdge(RuntimeError):
    """No guard of a trigger held: the table is incomplete. A bug, recorded as a crash."""


@step("reset")
async def step_reset(rt: Runtime, r: Rollout) -> str:
    """Start the environment's episode (it may shape the prompt), render the prompt (an agent's
    first call comes rendered by its session); with a partial-rollout checkpoint, validate it
    against the prompt."""
    prompt = r.inputs.prompt
    if r.inputs.rendered is not None:  # an agent's first call, rendered by its session
        r.prompt_ids = r.inputs.rendered
        return Trigger.START
    if r.inputs.environment is not None:
        stopped, prompt = await start_episode(rt, r)
        if stopped is not None:  # the sample keeps its own prompt, and ends here
            r.prompt_ids = await rt.prompt_ids(r.inputs.prompt, r.inputs.allowed_tools, r.inputs.tool_schemas)
            return stopped
    try:
        r.prompt_ids = await rt.prompt_ids(prompt, r.inputs.allowed_tools, r.inputs.tool_schemas)
    except Exception as exc:
        if prompt is r.inputs.prompt:
            raise  # the sample's own prompt: a crash, as before any environment
        r.record.error = f"environment {env_name(r.inputs.environment)}: the prompt its start made cannot be rendered: {type(exc).__name__}: {exc}"
        r.prompt_ids = await rt.prompt_ids(r.inputs.prompt, r.inputs.allowed_tools, r.inputs.tool_schemas)
        return Trigger.ENV_FAILED
    if rt.keeps_history and r.inputs.harness is None:  # the conversation as the template renders it
        r.history = History(tuple(prompt_messages(prompt)),
                            tuple(rt.tool_schemas(r.inputs.allowed_tools, r.inputs.tool_schemas)))
    saved = r.inputs.saved
    if not (r.cfg.partial_rollout and saved is not None):
        return Trigger.START
    restored = checkpoint.validate(saved, r.prompt_ids, r.cfg.mask_offpolicy, r.cfg.expert_row_bytes)
    if isinstance(restored, str):
        r.resume_rejected = restored
    else:
        r.resume = restored
        if restored.resume_at == "tools":  # the cut-off calls are read again from their turn
            last = restored.traj.segments[-1]
            text = rt.profile.decode(restored.traj.response_ids[last.start : last.end].tolist())
            r.turn = TurnScratch(text=text, parsed=rt.profile.parse_turn(text))
    return Trigger.RESUME


async def start_episode(rt: Runtime, r: Rollout) -> tuple[str | None, Any]:
    """The environment's `start`, bounded by `engine_tool_timeout`: (None, the prompt to render), or
    (the trigger that ends the sample, the sample's prompt) when it failed or the caller aborts."""
    env = r.inputs.environment
    task = envs.Task(r.inputs.prompt, r.inputs.metadata if isinstance(r.inputs.metadata, dict) else {},
                     r.inputs.environment_args or {})
    r.env_started = True
    timing = episodes.Timing()
    starting = asyncio.ensure_future(within(rt.cfg.tool_timeout, episodes.call(env, "start", task, timing=timing)))
    try:
        if not await finished_unless_aborted(rt, starting):
            r.record.error = f"abort requested while environment {env_name(env)} started"
            r.stop_because("abort_requested")
            return Trigger.CANCELLED, r.inputs.prompt
        r.env_episode, prompt = envs.check_opening(starting.result(), r.inputs.prompt)
    except asyncio.TimeoutError:
        r.record.error = f"environment {env_name(env)} did not start within {rt.cfg.tool_timeout:g} seconds"
        return Trigger.ENV_FAILED, r.inputs.prompt
    except Exception as exc:  # the environment's bug or its backend's failure: recorded, never raised
        r.record.error = f"environment {env_name(env)} failed to start: {type(exc).__name__}: {exc}"
        return Trigger.ENV_FAILED, r.inputs.prompt
    finally:
        r.record.env_seconds += timing.seconds
    r.conversation = episodes.prompt_messages(prompt)
    return None, prompt


def env_name(env: Any) -> str:
    """An environment's name, for the messages."""
    return str(getattr(env, "name", "") or type(env).__name__)


@step("generate")
async def step_generate(rt: Runtime, r: Rollout) -> str:
    """One `/generate` request; the reply's text is decoded once and parsed."""
    started = time.perf_counter()
    input_length = r.traj.total_length
    experts_start = r.traj.routed_rows if r.traj.experts is not None else None
    # The last turn's scratch (its reply, text and parse) is read by nothing from here on: let it
    # go now rather than hold it for as long as the server takes to answer.
    r.turn = TurnScratch()
    # The trajectory itself, so the client reuses the sample's encoded prompt instead of encoding it again.
    outcome = await rt.client.generate(
        r.traj, r.sampling_params(), r.max_new_tokens, routing_key=r.inputs.routing_key,
        routed_experts_start=experts_start,
    )
    r.record.generation_time += time.perf_counter() - started
    if isinstance(outcome, Failure):
        r.record.error = f"{outcome.kind}: {outcome.message}"
        return FAILURE_TRIGGERS[outcome.kind]
    outcome = check_reply(r, outcome, input_length, experts_start)
    r.record.call_stats.append(outcome.stats)
    r.turn.reply = outcome  # the scratch made fresh above, before the request
    if outcome.problem is None:
        # A resumed turn continues the tokens it had: parse the whole turn, not the tail.
        before = r.traj.response_ids[r.traj.response_length - r.partial_turn_tokens :].tolist() if r.partial_turn_tokens else []
        r.turn.text = rt.profile.decode(before + outcome.ids)
        r.turn.parsed = rt.profile.parse_turn(r.turn.text)
    else:
        r.record.error = f"{outcome.problem}: {outcome.problem_detail}"
    return Trigger.REPLY


def check_reply(r: Rollout, reply: Reply, input_length: int, experts_start: int | None) -> Reply:
    """What this request asked for and the parser cannot know: top-p replay, routed-expert rows."""
    if top_p_asked(r.inputs.sampling_params):
        reply = require_top_p(reply)
    if experts_start is not None:
        reply = require_routed_experts(
            reply, sequence_length=input_length + len(reply.ids), start=experts_start, row_bytes=r.traj.expert_row_bytes
        )
    return reply


@step("tool_call")
async def step_tool_call(rt: Runtime, r: Rollout) -> str:
    """Hand planned calls to their tools' states; once all are answered, build the observation."""
    if r.turn.pending_calls:
        return Trigger.DISPATCH
    parsed = r.turn.parsed
    assert parsed is not None
    refused = [rt.tool_runner.refuse(call, kind) for call, kind in r.turn.refused]
    order = {id(call): i for i, call in enumerate(parsed.calls)}  # answers in the turn's call order
    results = sorted([*r.turn.results, *refused], key=lambda res: order.get(id(res.call), len(order)))
    for res in results:
        r.record.tools.count(res)
    r.turn.results = results
    if r.conversation is not None:  # an environment will read this turn and its answers
        r.conversation.append(episodes.assistant_message(episodes.plain(rt.tokenizer, rt.profile, r.turn.text), parsed))
        r.conversation.extend(episodes.tool_messages(results))
    last = r.traj.response_ids[-1] if r.traj.response_length else None
    r.turn.observation_ids = rt.profile.observation_ids(parsed, results, last)
    if r.history is not None:
        follow(rt, r, results=result_contents(results))
    return Trigger.OBSERVE


def follow(rt: Runtime, r: Rollout, *, results: list[str] | None = None, user: str | None = None) -> None:
    """Keep the conversation (the turn and what answered it). Where the template renders the
    next prompt otherwise than the sequence glued so far (it drops earlier reasoning), that render
    is the next prompt: its tail glued on where it extends the sequence, else a new segment."""
    history = r.history
    history.add(rt.profile, r.turn.text, results=results, user=user)
    rendered = history.follow(rt.profile, rt.reasoning_rule)
    if rendered is None:
        return
    sequence = r.traj.input_ids()
    if extends(rendered, sequence):
        r.turn.observation_ids = rendered[len(sequence):]
    else:
        r.turn.rerender = SegmentBreak("reasoning_dropped", tuple(rendered))


@step("tool_calls")
async def run_tool_calls(rt: Runtime, r: Rollout) -> str:
    """A tool state's step: run every waiting call to this state's tool, concurrently."""
    name = tool_of(r.state)
    mine = [c for c in r.turn.pending_calls if c.name == name]
    r.turn.pending_calls = [c for c in r.turn.pending_calls if c.name != name]
    tool = rt.tool(name)
    assert tool is not None, f"tool {name} left the registry mid-rollout"
    started = time.perf_counter()
    if name not in r.tool_sessions:
        r.tool_sessions[name] = await tool.create()
    calls = [asyncio.ensure_future(rt.tool_runner.call(tool, r.tool_sessions[name], c)) for c in mine]
    single = len(calls) == 1  # the common case: the call's own task, no gather around it
    running = calls[0] if single else asyncio.gather(*calls)
    if not await finished_unless_aborted(rt, running):
        # The caller is ending the step: cut the calls (cancelling a sandboxed run kills its
        # process) and end resumable, so the caller's abort() does not wait on them.
        r.record.tools.seconds += time.perf_counter() - started
        r.record.error = f"abort requested while {name} ran"
        r.stop_because("abort_requested")
        return Trigger.CANCELLED
    try:
        results = [running.result()] if single else running.result()
    except tools.ToolUnavailable as exc:
        for call in calls:  # the turn's other calls: nothing started is left running
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        r.record.tools.seconds += time.perf_counter() - started
        r.record.error = f"tool {name} cannot work: {exc}"
        log_once(r.record.error, logging.ERROR)  # one clear error, not one per sample
        return Trigger.TOOL_UNAVAILABLE
    elapsed = time.perf_counter() - started
    r.record.tools.calls += len(results)
    r.record.tools.seconds += elapsed
    r.turn.results.extend(results)
    return Trigger.TOOL_DONE


@step("environment")
async def step_environment(rt: Runtime, r: Rollout) -> str:
    """The environment answers the model's turn; its reply becomes the next user turn's ids.

    `respond` gets the conversation so far and is bounded by `engine_tool_timeout`; its time is
    kept with the turn. An environment that raises, returns the wrong type or never answers
    fires `environment_failed`: the sample ends FAILED with the reason recorded, untrained.
    """
    env = r.inputs.environment
    name = env_name(env)
    messages = r.conversation if r.conversation is not None else []
    messages.append(episodes.assistant_message(episodes.plain(rt.tokenizer, rt.profile, r.turn.text), r.turn.parsed))
    seen = episodes.conversation(messages, r.prompt_ids, r.traj, rt.profile.decode, r.turn_count)
    timing = episodes.Timing()
    answering = asyncio.ensure_future(within(rt.cfg.tool_timeout,
                                             episodes.call(env, "respond", r.env_episode, seen, timing=timing)))
    try:
        if not await finished_unless_aborted(rt, answering):
            # The caller is ending the step: end resumable, as a tool turn would.
            r.record.error = f"abort requested while environment {name} answered"
            r.stop_because("abort_requested")
            return Trigger.CANCELLED
        reply = envs.check_reply(answering.result())
    except asyncio.TimeoutError:
        r.record.error = f"environment {name} did not answer within {rt.cfg.tool_timeout:g} seconds"
        return Trigger.ENV_FAILED
    except Exception as exc:  # the environment's bug or its backend's failure: recorded, never raised
        r.record.error = f"environment {name} failed: {type(exc).__name__}: {exc}"
        return Trigger.ENV_FAILED
    finally:
        r.turn.env_seconds = timing.seconds
        r.turn.env_blocked = timing.blocked if timing.blocked >= episodes.BLOCKING_SECONDS else 0.0
        r.record.env_seconds += timing.seconds
    r.turn.env_reply = reply
    if not reply.done:
        messages.append({"role": "user", "content": reply.text})
        last = r.traj.response_ids[-1] if r.traj.response_length else None
        r.turn.observation_ids = rt.profile.user_turn_ids(reply.text, last)
        if r.history is not None:
            follow(rt, r, user=reply.text)
    return Trigger.ENV_REPLY


@step("compact")
async def step_compact(rt: Runtime, r: Rollout) -> str:
    """COMPACT: plan the next segment; with summarize, first ask the policy for the summary in
    the segment's own context (the generation prompt the sequence ends with gives way to the
    question, engine_compaction_prompt). The next segment's prompt is the original prompt, the
    summary and the latest exchanges that fit under the threshold, as the template renders them."""
    history, cfg, at = r.history, r.cfg, r.inputs.compact_at
    assert history is not None and at is not None
    r.turn = TurnScratch()
    keep = min(cfg.compaction_keep_turns, len(history.exchanges))
    if cfg.compaction == "drop_oldest":
        prompt, compacted, dropped = compacted_prompt(rt, history, None, min(keep, len(history.exchanges) - 1), at)
        r.turn.compaction = Compaction("drop_oldest", prompt, compacted, dropped)
        return Trigger.COMPACTED
    cut, asked = rt.profile.ask_after_results(cfg.compaction_prompt)
    sequence = r.traj.input_ids()
    if cut and sequence[len(sequence) - len(cut):] != cut:
        raise ValueError("compaction: the segment does not end with the template's generation prompt")
    ids = sequence[: len(sequence) - len(cut)] + asked
    room = None if r.token_budget is None else r.token_budget - len(ids)
    if room is not None and room < 1:
        r.turn.compaction = Compaction("summarize", cut=len(cut), asked=tuple(asked), room=False)
        return Trigger.COMPACTED
    cap = cfg.compaction_summary_tokens if room is None else min(cfg.compaction_summary_tokens, room)
    experts_start = r.traj.routed_rows if r.traj.experts is not None else None
    started = time.perf_counter()
    outcome = await rt.client.generate(ids, r.sampling_params(), cap, routing_key=r.inputs.routing_key,
                                       routed_experts_start=experts_start)
    r.record.generation_time += time.perf_counter() - started
    if isinstance(outcome, Failure):
        r.record.error = f"{outcome.kind}: {outcome.message}"
        return FAILURE_TRIGGERS[outcome.kind]
    outcome = check_reply(r, outcome, len(ids), experts_start)
    r.record.call_stats.append(outcome.stats)
    r.turn.reply = outcome
    summary = ""
    if outcome.problem is None:
        summary = rt.profile.read_turn(rt.profile.decode(outcome.ids)).content.strip()
    else:
        r.record.error = f"{outcome.problem}: {outcome.problem_detail}"
    prompt, compacted, dropped = compacted_prompt(rt, history, summary, keep, at) if summary else ((), None, 0)
    r.turn.compaction = Compaction("summarize", prompt, compacted, dropped, len(cut), tuple(asked), summary)
    return Trigger.COMPACTED


def compacted_prompt(rt: Runtime, history: History, summary: str | None, keep: int,
                     at: int) -> tuple[tuple[int, ...], History | None, int]:
    """The compacted segment's prompt, its conversation and how many exchanges it leaves out: the
    latest `keep` exchanges, fewer while the render reaches the threshold `at`; ((), None, all)
    when even none fit."""
    for kept in range(max(0, keep), -1, -1):
        compacted = history.compacted(summary, kept)
        ids = compacted.render(rt.profile)
        if len(ids) < at:
            return tuple(ids), compacted, len(history.exchanges) - kept
    return (), None, len(history.exchanges)


@step("harness")
async def step_harness(rt: Runtime, r: Rollout) -> str:
    """An agent's session answers the harness's waiting call with the turn and brings what the
    harness does next: its next call (matched onto what was sampled) or the session's end.
    The caller's abort cuts the wait, as it cuts a tool's."""
    harness: Harness = r.inputs.harness
    waiting = asyncio.ensure_future(harness.exchange(r))
    if not await finished_unless_aborted(rt, waiting):
        r.record.error = "abort requested while the harness had the turn"
        r.stop_because("abort_requested")
        return Trigger.CANCELLED
    event = waiting.result()
    r.turn = TurnScratch(harness=event, observation_ids=list(event.observation_ids))
    return Trigger.HARNESS_END if event.kind == "end" else Trigger.HARNESS_CALL


async def finished_unless_aborted(rt: Runtime, work: asyncio.Future[Any]) -> bool:
    """Wait for `work`; if the caller starts aborting first, it is cancelled and waited for: False.

    The runtime's poller cancels watched work when the abort starts, so a wait costs no task
    of its own. If this task is cancelled, `work` is cancelled, waited for, and the
    cancellation re-raised.
    """
    if rt.abort_requested():
        work.cancel()
    elif not work.done():
        # A future of our own to wait on (what `asyncio.wait` builds, without its set and
        # bookkeeping): a cancellation of this task lands on it, not on `work`.
        woken = asyncio.get_running_loop().create_future()
        wake = functools.partial(_wake, woken)
        work.add_done_callback(wake)
        rt.watch(work)
        try:
            await woken
        except asyncio.CancelledError:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise
        finally:
            work.remove_done_callback(wake)
            rt.unwatch(work)
    if not work.done():  # cancelled just now: let it end
        await asyncio.gather(work, return_exceptions=True)
    return not work.cancelled()


def _wake(woken: asyncio.Future[None], _: object) -> None:
    if not woken.done():
        woken.set_result(None)


def _fire(machine: RolloutMachine, r: Rollout, trigger: str) -> None:
    if not machine.fire(r, trigger):
        raise NoEdge(f"no edge of {trigger!r} from {r.state} has a guard that holds")


def _fire_fault(machine: RolloutMachine, r: Rollout, trigger: str) -> None:
    """Fire a fault edge; if even that fails, the sample is ended by hand as ABORTED."""
    try:
        _fire(machine, r, trigger)
    except Exception as exc:  # the machine itself is broken: keep the batch alive anyway
        r.record.error = f"{r.record.error or ''}; {trigger} failed: {exc}"
        r.traj.reset(r.prompt_ids)
        r.record.trace.append((r.state, str(trigger), State.ABORTED.value))
        r.record.guards.append(None)
        r.state = State.ABORTED.value
        r.record.reason = r.record.reason or f"{trigger}_failed"


_BOUND: weakref.WeakKeyDictionary[RolloutMachine, dict[str, Any]] = weakref.WeakKeyDictionary()
_LAST_BOUND: tuple[RolloutMachine, dict[str, Any]] | None = None  # the process's one machine, found by identity


def behaviours(machine: RolloutMachine) -> dict[str, Any]:
    """Each non-terminal state of `machine` bound to what it does: its trigger, or its step here.

    Bound once per machine, the first time it is driven: a state whose step this module lacks
    raises `MachineDefinitionError` naming it (recorded as the sample's crash, never raised
    into the caller). The built-in states' steps are checked as this module is imported.
    """
    global _LAST_BOUND
    last = _LAST_BOUND
    if last is not None and last[0] is machine:  # every step asks: no weak reference made each time
        return last[1]
    bound = _BOUND.get(machine)
    if bound is None:
        bound = _BOUND[machine] = machine.spec.bind(STEPS)
    _LAST_BOUND = (machine, bound)
    return bound


async def _next_trigger(rt: Runtime, r: Rollout, machine: RolloutMachine) -> str:
    """The trigger of `r`'s state: the one its definition fires at once, or its step's."""
    does = behaviours(machine)[r.state]
    if isinstance(does, str):  # a Trigger: no I/O to do
        return does
    return await does(rt, r)


async def drive(rt: Runtime, r: Rollout, machine: RolloutMachine | None = None) -> Rollout:
    """Walk `r` from RESET to a terminal state. Re-raises only CancelledError, after recording it."""
    machine = machine or get_machine()
    deferred = r.cfg.gc_defer_full
    if deferred:
        full_collections.enter()
    try:
        while r.state not in TERMINALS:
            try:
                trigger = await _next_trigger(rt, r, machine)
                _fire(machine, r, trigger)
            except asyncio.CancelledError:
                r.record.error = "cancelled while in " + r.state
                _fire_fault(machine, r, Trigger.CANCELLED if machine.can(r, Trigger.CANCELLED) else Trigger.CRASHED)
                finish(rt, r, machine)  # a cancelled sample is handed back too: its text must match its ids
                raise
            except Exception as exc:
                r.record.error = f"{type(exc).__name__}: {exc}"
                _fire_fault(machine, r, Trigger.CRASHED)
            if r.record.violation is not None:
                _fire_fault(machine, r, Trigger.INVARIANT_VIOLATED)
        finish(rt, r, machine)
    finally:
        if deferred:
            full_collections.exit()
        await release_tool_sessions(rt, r)
        await end_episode(rt, r)
    return r


def finish(rt: Runtime, r: Rollout, machine: RolloutMachine) -> None:
    """At the terminal: the full check (I1-I4, I2), then the response text from the ids, in one decode.

    The text is derived here and nowhere else (I3 by construction): a character split across
    turns is whole, a TRIM is reflected, and no in-flight sample holds its text (~4 bytes a token).
    Never raises: whatever fails here is recorded as a violation and the response discarded.
    """
    try:
        r.traj.check(max_total_length=r.budget_at_end(), full=True)
    except Exception as exc:  # InvariantViolation, or a bug in the check itself
        _distrust(machine, r, str(exc) if isinstance(exc, InvariantViolation) else f"check: {exc}")
    try:
        r.text = rt.profile.decode(r.traj.response_ids.tolist())
        r.final_text = final_model_text(rt, r)
    except Exception as exc:  # a tokenizer that cannot decode ids it made
        _distrust(machine, r, f"text: {exc}")
        r.text = r.final_text = ""


def _distrust(machine: RolloutMachine, r: Rollout, violation: str) -> None:
    """A terminal sample whose data failed a check: record why and keep nothing of its response."""
    r.record.violation = violation
    if r.state != State.ABORTED:
        _fire_fault(machine, r, Trigger.INVARIANT_VIOLATED)  # its edge discards the response
    else:  # no edge leaves a terminal state: do what that edge does
        actions.discard_response(r)
        r.record.reason = Trigger.INVARIANT_VIOLATED.value


def final_model_text(rt: Runtime, r: Rollout) -> str:
    """The model's own last words: its tokens after the last observation, never tool output."""
    start = next((s.end for s in reversed(r.traj.segments) if s.kind == "observation"), 0)
    if start == 0:
        return r.text
    ids = r.traj.response_ids[start:].tolist()
    return rt.profile.decode(ids) if ids else ""


async def release_tool_sessions(rt: Runtime, r: Rollout) -> None:
    """Give every tool its per-trajectory session back, whatever happened."""
    for name, session in list(r.tool_sessions.items()):
        try:
            tool = rt.tool(name)
            if tool is not None:
                await asyncio.shield(tool.release(session))
        except Exception:  # a release failure must not hide the sample's own outcome
            pass
    r.tool_sessions.clear()


async def end_episode(rt: Runtime, r: Rollout) -> None:
    """Tell the environment its episode is over, whatever happened (bounded; its failure is ignored)."""
    if not r.env_started:
        return
    r.env_started = False
    timing = episodes.Timing()
    try:
        ending = episodes.call(r.inputs.environment, "end", r.env_episode, timing=timing)
        await asyncio.shield(within(rt.cfg.tool_timeout, ending))
    except Exception:  # the sample's own outcome stands
        pass
    finally:
        r.record.env_seconds += timing.seconds
    r.env_episode = None


def new_rollout(
    rt: Runtime,
    prompt: Any,
    sampling_params: dict[str, Any],
    *,
    tools_requested: Any = None,
    routing_key: str | None = None,
    saved: Saved | None = None,
    tool_schemas: dict[str, dict[str, Any]] | None = None,
    metadata: dict[str, Any] | None = None,
    environment: Any = DEFAULT_ENVIRONMENT,
    environment_args: dict[str, Any] | None = None,
) -> Rollout:
    """A rollout at RESET for a prompt. `tools_requested` narrows the tools (a sample's own list);
    `metadata` is the sample's, which its environment starts the episode from: `environment`, set
    up by the runtime (None: none; by default the runtime's, `engine_environment`), with its
    `environment_args` for this sample."""
    params = dict(sampling_params)  # the caller's dict is never changed (slime shares one in evaluation)
    asked = params.get("max_new_tokens")
    inputs = Inputs(
        rt.cfg,
        prompt=prompt,
        sampling_params=params,
        asked_max_new_tokens=None if asked is None else int(asked),
        routing_key=routing_key,
        allowed_tools=rt.allowed_tools(tools_requested),
        tool_schemas=tool_schemas,
        abort_check=rt.abort_requested,
        saved=saved,
        environment=rt.environment if environment is DEFAULT_ENVIRONMENT else environment,
        metadata=metadata,
        environment_args=environment_args,
        compact_at=rt.compact_at,
    )
    return Rollout(inputs)


def _check_builtin_steps() -> None:
    """Every step the built-in states name is defined here: checked on import, not mid-sample."""
    named = {d.step: d.name for d in STATES if d.step is not None} | {TOOL_STEP.name: "TOOL_<NAME>"}
    missing = [f"{state} runs the step {name!r}" for name, state in named.items() if name not in STEPS]
    if missing:
        raise MachineDefinitionError("the loop defines no step for: " + "; ".join(missing))


_check_builtin_steps()
