"""One front door per runtime, and one agent run per sample: its session, its harness, its end.

The door (`engine.agent.app.serve`) listens on loopback for the life of the runtime's event
loop; every sample of that runtime opens a session behind it. `run_agent` opens the sample's
session, runs its harness against the session's URL under the time limit, ends the session
with the harness's outcome and hands back the rollout, whose segments become the samples.
A caller's abort that ends the sample stops the harness at once.
"""

from __future__ import annotations

import asyncio
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import attrs

from engine.agent.harness import HarnessOutcome, HarnessSpec, run_harness
from engine.agent.sessions import AgentSessions, Session
from engine.loop.runtime import Runtime
from engine.machine.rollout import Rollout
from engine.machine.states import State

DoorFactory = Callable[..., Any]  # serve(sessions, host=..., port=...) -> a door (or an awaitable of one)


def default_door() -> DoorFactory:
    """The front door's app (imported only when an agent runs: it loads aiohttp)."""
    from engine.agent.app import serve  # type: ignore[import-not-found,unused-ignore]

    return serve  # type: ignore[no-any-return]


@attrs.define(eq=False)
class Served:
    """A runtime's sessions and the door serving them."""

    sessions: AgentSessions
    door: Any


_served: weakref.WeakKeyDictionary[Runtime, Served] = weakref.WeakKeyDictionary()
_opening: weakref.WeakKeyDictionary[Runtime, asyncio.Lock] = weakref.WeakKeyDictionary()


def check_profile(rt: Runtime) -> None:
    """An agent's messages need a profile that renders chat messages and their deltas (chat)."""
    if not (hasattr(rt.profile, "follow_ids") and hasattr(rt.profile, "call_form")):
        raise ValueError(f"engine_agent needs engine_profile: chat (the {rt.cfg.profile} profile renders no chat messages)")


async def served(rt: Runtime, serve: DoorFactory | None = None) -> Served:
    """The runtime's sessions and door, opened on first use."""
    found = _served.get(rt)
    if found is not None:
        return found
    lock = _opening.setdefault(rt, asyncio.Lock())
    async with lock:
        found = _served.get(rt)
        if found is None:
            check_profile(rt)
            sessions = AgentSessions(rt)
            door = (serve or default_door())(sessions, host="127.0.0.1", port=0)
            if inspect.isawaitable(door):
                door = await door
            found = _served[rt] = Served(sessions, door)
    return found


async def close_served(rt: Runtime) -> None:
    """Close the runtime's door (the sessions' keys are refused from then on)."""
    found = _served.pop(rt, None)
    if found is not None:
        await found.door.aclose()


@attrs.frozen
class AgentRun:
    """What one sample's agent did: the rollout (None when it never called the model), how the
    harness ended, and what its session refused or answered again."""

    rollout: Rollout | None
    outcome: HarnessOutcome
    refused: tuple[str, ...] = ()
    retries: int = 0


async def run_agent(rt: Runtime, spec: HarnessSpec, *, prompt: Any, sampling_params: dict[str, Any], sample: Any = None,
                    routing_key: str | None = None, metadata: dict[str, Any] | None = None,
                    serve: DoorFactory | None = None) -> AgentRun:
    """One sample as an agent: open its session, run its harness, end the session, hand back the rollout."""
    door = await served(rt, serve)
    session = door.sessions.open(sampling_params=sampling_params, routing_key=routing_key, metadata=metadata)
    harness = asyncio.ensure_future(run_harness(spec, base_url=door.door.session_url(session.key), api_key=session.key,
                                                sample=sample, prompt=prompt, timeout=rt.cfg.agent_timeout))
    try:
        outcome = await _until_done(session, harness)
        session.end(outcome.reason, outcome.detail)
        rollout = await session.finished()
    finally:
        for task in (harness, session.task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        door.sessions.forget(session.key)
    return AgentRun(rollout, outcome, tuple(session.refused), session.retries)


async def _until_done(session: Session, harness: asyncio.Future[HarnessOutcome]) -> HarnessOutcome:
    """The harness's outcome; if the sample ends ABORTED first (the caller is aborting), the
    harness is stopped there and then."""
    stopped = asyncio.ensure_future(session.stopped.wait())
    try:
        await asyncio.wait({harness, stopped}, return_when=asyncio.FIRST_COMPLETED)
        r = session.rollout
        if not harness.done() and r is not None and r.state == State.ABORTED:
            harness.cancel()
            await asyncio.gather(harness, return_exceptions=True)
            return HarnessOutcome("harness_crashed", f"stopped: the sample ended ABORTED ({r.reason})")
        return await harness
    finally:
        stopped.cancel()
