"""The sessions behind the agent front door: each harness call is a turn of its sample's machine.

One `Session` per sample. Its first call opens the sample: the history is rendered by the
chat template (with the call's tools) as the prompt, and the machine is driven from RESET.
GENERATE's reply goes to HARNESS, whose step (`Session.exchange`) answers the waiting call
with the turn (read by the configured tool parser) and takes the next call off the queue: its
history is matched onto the segment's transcript (`engine.agent.matching`); the messages it
adds are rendered by the profile as the delta after the turn (mask 0), or, when the history
does not extend what was sampled, the next segment's prompt is rendered from the history as
given, on a named break edge. The end of the harness (`Session.end`) is the session's end.

What the door is promised:
- a retry of a call (`ModelCall.retry_of`, the SDKs' `x-stainless-retry-count`) gets that call's
  answer, awaited if it is still being made, and never a second turn; a harness that gave up
  on a call (its connection closed) still has its turn taken, for the retry to find;
- a server abort (a weight update) goes on inside the turn: the harness sees one reply;
- a budget spent while a call waits answers it with `finish="length"`; a call after the
  sample ended is refused (`over_budget` after a budget, `closed` otherwise);
- a call whose messages cannot be rendered (an image, a template's refusal) is refused
  (`invalid_request`), the session kept: the machine still waits for a call it can take.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections import OrderedDict
from typing import Any

import attrs

from engine.agent.calls import CallRefused, Message, ModelAnswer, ModelCall, Usage
from engine.agent.matching import MATCHERS, Match, match_history
from engine.agent.templates import (
    Unrenderable,
    argument_schemas,
    call_names,
    made_calls,
    read_turn,
    template_messages,
    tool_schemas,
)
from engine.loop.driver import drive, new_rollout
from engine.loop.runtime import Runtime
from engine.machine.rollout import HarnessEvent, Rollout
from engine.machine.states import TERMINALS, State

log = logging.getLogger(__name__)
ANY_MODEL = "*"  # in the served names: a call may name any model (the policy answers it)
KEPT_ANSWERS = 16  # answers a session keeps for retries of its recent calls


@attrs.define(eq=False)
class Pending:
    """A call waiting for its turn, and where its answer goes."""

    call: ModelCall
    answer: asyncio.Future[ModelAnswer | CallRefused]


@attrs.frozen
class End:
    """The harness ended the session (`reason`: harness_finished, harness_crashed, harness_timed_out)."""

    reason: str
    detail: str = ""


def _stops(call: ModelCall) -> tuple[str, ...]:
    """The stop strings a call asked for."""
    stop = call.sampling.get("stop")
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str))


class Session:
    """One sample's session: its harness's calls as the turns of one machine."""

    def __init__(self, owner: AgentSessions, key: str, *, sampling_params: dict[str, Any],
                 routing_key: str | None = None, metadata: dict[str, Any] | None = None) -> None:
        self.owner = owner
        self.key = key
        self.sampling_params = dict(sampling_params)
        self.routing_key = routing_key
        self.metadata = metadata
        self.rollout: Rollout | None = None
        self.task: asyncio.Task[Rollout] | None = None
        self.queue: asyncio.Queue[Pending | End] = asyncio.Queue()
        self.waiting: Pending | None = None
        self.transcript: list[Message] = []  # the open segment's history as the engine holds it
        self.model_turns: set[int] = set()  # indices of the model's own turns in it
        self.made: dict[str, str] = {}  # the calls its assistant messages made: id -> tool name
        self.tools: tuple[dict[str, Any], ...] = ()  # the tools the open segment's prompt shows
        self.schemas: dict[str, Any] = {}
        self.turn_input = 0  # the sequence's length when the waiting call's turn began
        self.answers: OrderedDict[str, asyncio.Future[ModelAnswer | CallRefused]] = OrderedDict()
        self.ended: End | None = None
        self.refused: list[str] = []  # why calls were refused, in order (recorded with the sample)
        self.retries = 0
        self.stopped = asyncio.Event()  # the machine reached a terminal state
        self.notes: dict[str, Any] = {}  # the door's, for this session's requests (`Sessions.notes`)

    # -- the door's side ----------------------------------------------------------------
    async def call(self, call: ModelCall) -> ModelAnswer | CallRefused:
        """Answer one call: a turn of the machine, or an earlier call's answer for its retry."""
        if call.retry_of is not None and call.retry_of in self.answers:
            self.retries += 1
            return await asyncio.shield(self.answers[call.retry_of])
        refusal = self._refusal()
        if refusal is not None:
            return self._refuse(refusal)
        answer: asyncio.Future[ModelAnswer | CallRefused] = asyncio.get_running_loop().create_future()
        self._keep(call.digest or uuid.uuid4().hex, answer)
        pending = Pending(call, answer)
        if self.rollout is None:
            refused = self._open(pending)
            if refused is not None:
                answer.set_result(refused)
        else:
            self.queue.put_nowait(pending)
        # The turn is taken whether the harness waits for it or not: its retry finds the answer.
        return await asyncio.shield(answer)

    def _refusal(self) -> CallRefused | None:
        r = self.rollout
        if self.ended is not None:
            return CallRefused("closed", f"the session has ended ({self.ended.reason})")
        if r is not None and r.state in TERMINALS:
            if r.state == State.TRUNCATED:
                return CallRefused("over_budget", f"the session's budget is spent ({r.reason})")
            return CallRefused("closed", f"the session's sample ended {r.state} ({r.reason})")
        return None

    def _refuse(self, refusal: CallRefused) -> CallRefused:
        self.refused.append(refusal.kind)
        return refusal

    def _keep(self, digest: str, answer: asyncio.Future[ModelAnswer | CallRefused]) -> None:
        self.answers[digest] = answer
        while len(self.answers) > KEPT_ANSWERS:
            self.answers.popitem(last=False)

    def _open(self, pending: Pending) -> CallRefused | None:
        """The first call: its history, rendered with its tools, is the sample's prompt."""
        profile = self.owner.rt.profile
        call = pending.call
        try:
            ids = profile.render_prompt(template_messages(call.messages, profile.call_form()), tool_schemas(call))
        except Exception as exc:  # an image, a template that refuses the history
            return self._refuse(CallRefused("invalid_request", f"the history cannot be rendered: {exc}"))
        r = new_rollout(self.owner.rt, list(call.messages), self.sampling_params, routing_key=self.routing_key,
                        metadata=self.metadata)
        # The harness runs its own tools and answers every turn: no tool or environment of the engine's.
        r.inputs = attrs.evolve(r.inputs, harness=self, rendered=tuple(ids), allowed_tools=frozenset(), environment=None)
        r.take_call(self._event("extends", call))
        self.rollout = r
        self._take(pending, segment=True)
        self.task = asyncio.ensure_future(self._drive(r))
        return None

    def _take(self, pending: Pending, *, segment: bool) -> None:
        """`pending` is the call the next turn answers (`segment`: its history starts a segment)."""
        call = pending.call
        self.waiting = pending
        if segment:
            self.transcript, self.model_turns = list(call.messages), set()
            self.made = call_names(call.messages)
            self.tools = call.tools
            self.schemas = argument_schemas(call.tools)

    def end(self, reason: str, detail: str = "") -> None:
        """The harness is done with the session (it exited, returned, failed or timed out)."""
        if self.ended is None:
            self.ended = End(reason, detail)
            self.queue.put_nowait(self.ended)

    async def finished(self) -> Rollout | None:
        """The sample, once its machine reached a terminal state (None: the harness never called)."""
        if self.task is None:
            return None
        return await asyncio.shield(self.task)

    # -- the machine's side (`engine.loop.harness.Harness`) -----------------------------
    async def exchange(self, r: Rollout) -> HarnessEvent:
        """HARNESS's step: answer the waiting call with the turn just sampled, then take the next
        call the machine can work with (a refused one is answered here), or the session's end."""
        answer = self._answer(r)
        r.record.tools.calls += len(answer.calls)  # handed to the harness, which runs them
        self.transcript.append(Message("assistant", answer.text, reasoning=answer.reasoning, calls=answer.calls))
        self.model_turns.add(len(self.transcript) - 1)
        self.made.update((c.id, c.name) for c in answer.calls)
        self._deliver(answer)
        while True:
            item = await self.queue.get()
            if isinstance(item, End):
                if item.detail:
                    r.record.error = item.detail
                return HarnessEvent("end", reason=item.reason)
            self.waiting = item  # answered by `_settle` should the machine stop before it is matched
            event = self._match(r, item)
            if event is not None:
                return event

    def _answer(self, r: Rollout) -> ModelAnswer:
        """The turn as the harness gets it: reasoning, text and calls as the parser reads them."""
        turn = r.turn
        read = read_turn(self.owner.rt.profile, turn.text, self.schemas)
        if read.malformed and r.record.turn_log:
            r.record.turn_log[-1]["malformed_call"] = True
        finish = "tool_calls" if read.calls else ("length" if turn.reply is not None and turn.reply.finish == "length" else "stop")
        total = r.traj.total_length
        # the server names the stop string it matched (a stop token is an id): the call's own, or the job's
        matched = turn.reply.finish_detail if turn.reply is not None and turn.reply.finish == "stop" else None
        asked = _stops(self.waiting.call) if self.waiting is not None else ()
        return ModelAnswer(read.text, read.reasoning, read.calls, finish,
                           Usage(self.turn_input, max(0, total - self.turn_input)), id=uuid.uuid4().hex,
                           stop_sequence=matched if isinstance(matched, str) and matched in asked else None)

    def _deliver(self, answer: ModelAnswer | CallRefused) -> None:
        pending, self.waiting = self.waiting, None
        if pending is not None and not pending.answer.done():
            pending.answer.set_result(answer)

    def _match(self, r: Rollout, pending: Pending) -> HarnessEvent | None:
        """The call's history against the segment's transcript: the delta it adds, or a break with
        the next segment's prompt. A call whose messages cannot be rendered is refused here."""
        call = pending.call
        profile = self.owner.rt.profile
        if call.tools != self.tools:  # other tools: the prompt that shows them parts at its start
            match = Match(False, reason="history_forked")
        else:
            match = match_history(call.messages, self.transcript, self.model_turns, self.owner.matcher, self.made.keys())
        try:
            if match.extends:
                added = template_messages(match.added, profile.call_form(), self.made)
                last = self._last_answer()
                ids = profile.follow_ids(added, r.traj.response_ids[-1] if r.traj.response_length else None,
                                         made_calls(last.calls) if last is not None else None)
                event = self._event("extends", call, observation_ids=tuple(ids))
                answered = len(self.transcript) - 1
                if answered in self.model_turns and call.messages[answered] == self.transcript[answered]:
                    # Equal in every field: hold the harness's copy, which the door hands back as it is
                    # with each later call, so matching it again is one identity check.
                    self.transcript[answered] = call.messages[answered]
                self.transcript.extend(match.added)
                self.made.update(call_names(match.added))
                self._take(pending, segment=False)
                self.turn_input = r.traj.total_length + len(ids)
                return event
            ids = profile.render_prompt(template_messages(call.messages, profile.call_form()), tool_schemas(call))
        except Exception as exc:  # Unrenderable, or what the template raises for these messages
            what = str(exc) if isinstance(exc, Unrenderable) else f"{type(exc).__name__}: {exc}"
            pending.answer.set_result(self._refuse(CallRefused("invalid_request", f"the history cannot be rendered: {what}")))
            return None
        self._take(pending, segment=True)
        self.turn_input = len(ids)
        return self._event("break", call, reason=match.reason, prompt_ids=tuple(ids))

    def _last_answer(self) -> Message | None:
        """The turn a call's history is matched after: the transcript's last message (`exchange` put it there)."""
        return self.transcript[-1] if self.transcript and len(self.transcript) - 1 in self.model_turns else None

    def _event(self, kind: str, call: ModelCall, **fields: Any) -> HarnessEvent:
        cap = call.sampling.get("max_new_tokens")
        return HarnessEvent(kind, max_new_tokens=cap if isinstance(cap, int) and cap > 0 else None,  # type: ignore[arg-type]
                            stop=_stops(call), **fields)

    async def _drive(self, r: Rollout) -> Rollout:
        self.turn_input = len(r.inputs.rendered or ())
        try:
            await drive(self.owner.rt, r)
        finally:
            self._settle(r)
            self.stopped.set()
        return r

    def _settle(self, r: Rollout) -> None:
        """The machine stopped: the waiting call gets what there is (a budget spent: `length`,
        with the turn's kept text), every queued call a refusal."""
        if self.waiting is not None:
            if r.state == State.TRUNCATED:
                kept = r.traj.response_ids[max(0, self.turn_input - r.traj.prompt_length):].tolist()
                profile = self.owner.rt.profile
                read = read_turn(profile, profile.decode(kept), self.schemas) if kept else None
                self._deliver(ModelAnswer(read.text if read else "", read.reasoning if read else None, (), "length",
                                          Usage(self.turn_input, len(kept)), id=uuid.uuid4().hex))
            else:
                self._deliver(self._refuse(CallRefused("closed", f"the session's sample ended {r.state} ({r.reason})")))
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, Pending) and not item.answer.done():
                item.answer.set_result(self._refuse(self._refusal() or CallRefused("closed", "the session has ended")))


class AgentSessions:
    """Every session of one runtime: what the front door's app serves (`engine.agent.calls.Sessions`)."""

    def __init__(self, rt: Runtime, *, matcher: str | None = None, models: tuple[str, ...] | None = None) -> None:
        """`matcher` and `models`: the settings' (`engine_agent_matcher`, `engine_agent_models`) unless given."""
        matcher = rt.cfg.agent_matcher if matcher is None else matcher
        if matcher not in MATCHERS:
            raise ValueError(f"engine_agent_matcher must be one of {', '.join(MATCHERS)}, got {matcher!r}")
        self.rt = rt
        self.matcher = matcher
        self.names = rt.cfg.agent_models if models is None else tuple(models)
        self.sessions: dict[str, Session] = {}

    def open(self, *, sampling_params: dict[str, Any], routing_key: str | None = None,
             metadata: dict[str, Any] | None = None) -> Session:
        """A new session under a fresh key (the harness's base URL or API key names it)."""
        key = secrets.token_urlsafe(18)
        session = self.sessions[key] = Session(self, key, sampling_params=sampling_params, routing_key=routing_key,
                                               metadata=metadata)
        return session

    def forget(self, key: str) -> None:
        """Drop a finished session: its key is refused from now on."""
        self.sessions.pop(key, None)

    def _session(self, key: str, call: ModelCall) -> Session | CallRefused:
        session = self.sessions.get(key)
        if session is None:
            return CallRefused("unauthorized", "no session has this key")
        if call.model and call.model not in self.names and ANY_MODEL not in self.names:
            return session._refuse(CallRefused("not_found", f"the model {call.model!r} is not served here: {', '.join(self.models())} "
                                            f"(engine_agent_models lists the names served; \"*\" takes any)"))
        if call.template_kwargs is not None:
            refused = self._template_refusal(call.template_kwargs)
            if refused is not None:
                return session._refuse(refused)
        return session

    def _template_refusal(self, kwargs: dict[str, Any]) -> CallRefused | None:
        """A request's own template kwargs (`chat_template_kwargs`): served when they render as the
        job's do, refused otherwise, so what the harness asked and what is trained never differ unseen."""
        profile = self.rt.profile
        alike = getattr(profile, "renders_alike", None)
        try:
            same = alike(kwargs) if alike is not None else not kwargs  # a profile without a template: none
        except ValueError as exc:
            return CallRefused("invalid_request", f"chat_template_kwargs: {exc}")
        except Exception as exc:  # noqa: BLE001 - the template itself refused them
            return CallRefused("invalid_request", f"chat_template_kwargs cannot be rendered: {type(exc).__name__}: {exc}")
        if same:
            return None
        job = json.dumps(dict(getattr(profile, "template_kwargs", {})), default=str)
        return CallRefused("invalid_request", f"chat_template_kwargs {json.dumps(kwargs, default=str)} render the "
                           f"prompt unlike this job's apply_chat_template_kwargs {job}: every call of a session is "
                           f"rendered with the job's, as its samples are trained; set the job's "
                           f"(--chat-template-kwargs) or drop them from the request")

    async def call(self, key: str, call: ModelCall) -> ModelAnswer | CallRefused:
        """Answer one model call of the session `key` (one turn of its machine)."""
        session = self._session(key, call)
        if isinstance(session, CallRefused):
            return session
        return await session.call(call)

    async def count_tokens(self, key: str, call: ModelCall) -> int | CallRefused:
        """How many tokens the call's prompt holds: the history rendered with its tools, as a
        segment's prompt is rendered."""
        session = self._session(key, call)
        if isinstance(session, CallRefused):
            return session
        profile = self.rt.profile
        try:
            return len(profile.render_prompt(template_messages(call.messages, profile.call_form()), tool_schemas(call)))
        except Exception as exc:
            return CallRefused("invalid_request", f"the history cannot be rendered: {exc}")

    def models(self) -> list[str]:
        """The model names served (`/v1/models`): the policy's, under the configured names."""
        return [n for n in self.names if n != ANY_MODEL]

    def notes(self, key: str) -> dict[str, Any] | None:
        """What the door keeps with the session `key` (None: no such session); it goes with the session."""
        session = self.sessions.get(key)
        return None if session is None else session.notes
