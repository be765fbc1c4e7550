"""The sessions behind the door, through `Sessions.call` as the door hands calls over: each call a
turn of one machine, the history matched onto what was sampled, every promise of the door kept."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import respx

from engine.agent.calls import CallRefused, Message, ModelAnswer, ModelCall, Part
from engine.agent.sessions import AgentSessions
from engine.loop.runtime import Runtime
from engine.machine.rollout import Rollout
from engine.profiles.tokenizer import load_tokenizer
from engine.settings import EngineConfig, RetryPolicy
from tests.conftest import run
from tests.support.agents import SYSTEM, TOOLS, ScriptedModel, as_message, tool_task
from tests.support.helpers import URL

SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "no_stop_trim": True, "skip_special_tokens": False}


def config(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(server_url=URL, profile="chat", max_context_len=8192,
                                retry=RetryPolicy(max_attempts=2, base_delay=0.0, deadline=5.0))
    base.update(kw)
    return EngineConfig(**base)


Body = Callable[[AgentSessions, Any, ScriptedModel], Awaitable[Any]]


def with_sessions(body: Body, *, model: Callable[[Any], Any] | None = None, steps: int = 3, **kw: Any) -> tuple[Any, ScriptedModel]:
    """Run `body(sessions, runtime, model)` with the Qwen3 tokenizer against a scripted model."""

    async def go() -> tuple[Any, ScriptedModel]:
        rt = Runtime.create(config(**kw), tokenizer=load_tokenizer(None))
        scripted = ScriptedModel(rt.profile, steps=steps)
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=model(scripted) if model else scripted)
            try:
                return await body(AgentSessions(rt), rt, scripted), scripted
            finally:
                await rt.aclose()

    return run(go())


async def finish(sessions: AgentSessions, key: str, reason: str = "harness_finished") -> Rollout:
    session = sessions.sessions[key]
    session.end(reason)
    r = await session.finished()
    assert r is not None
    return r


def gated(gate: asyncio.Event) -> Callable[[ScriptedModel], Callable[[httpx.Request], Any]]:
    """A scripted model whose replies wait for `gate` (a turn still being made)."""

    def slow(model: ScriptedModel) -> Callable[[httpx.Request], Any]:
        async def answer(request: httpx.Request) -> httpx.Response:
            await gate.wait()
            return model(request)
        return answer

    return slow


def keyed(sessions: AgentSessions) -> str:
    """A session whose requests carry its key as the routing key (the scripted model tells them apart)."""
    session = sessions.open(sampling_params=dict(SAMPLING))
    session.routing_key = session.key
    return session.key


def test_a_verbatim_tool_task_is_one_segment_whose_requests_each_extend_the_last():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> tuple[Rollout, list[Any]]:
        key = keyed(sessions)
        answers = await tool_task(sessions, key)
        return await finish(sessions, key), answers

    (r, answers), model = with_sessions(body)
    assert [a.finish for a in answers] == ["tool_calls"] * 3 + ["stop"]
    assert answers[0].reasoning == "Step 0: add 0 and 1." and answers[0].text == "Adding 0."
    assert [json.loads(a.calls[0].arguments) for a in answers[:3]] == [{"a": 0, "b": 1}, {"a": 1, "b": 2}, {"a": 2, "b": 3}]
    assert answers[-1].text == "The sum is 15." and answers[-1].calls == ()
    assert (r.state, r.reason, r.closed) == ("COMPLETED", "harness_finished", [])
    requests = next(iter(model.requests.values()))
    replies = next(iter(model.replies.values()))
    for before, after, (ids, _) in zip(requests, requests[1:], replies):
        assert after[:len(before) + len(ids)] == before + ids  # nothing re-rendered: the sampled ids as sent
    trained = [i for i, m in zip(r.traj.response_ids.tolist(), r.traj.loss_mask.tolist()) if m]
    assert trained == [i for ids, _ in replies for i in ids]
    assert [lp for lp, m in zip(r.traj.logprobs.tolist(), r.traj.loss_mask.tolist()) if m] == [
        lp for _, lps in replies for lp in lps]
    # the usage each answer reports: its prompt is the request's, its completion the reply's
    assert [(a.usage.prompt_tokens, a.usage.completion_tokens) for a in answers] == [
        (len(q), len(ids)) for q, (ids, _) in zip(requests, replies)]


def test_the_first_prompt_is_the_template_s_render_of_the_history_with_the_call_s_tools():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        await sessions.call(key, ModelCall((Message("system", SYSTEM), Message("user", "Hi")), TOOLS))
        await finish(sessions, key)
        return rt.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
                                                tools=list(TOOLS), tokenize=False, add_generation_prompt=True)

    rendered, model = with_sessions(body)
    assert next(iter(model.requests.values()))[0] == model.profile.encode(rendered)


def test_a_retry_gets_the_first_call_s_answer_and_makes_no_second_turn():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        call = ModelCall((Message("system", SYSTEM), Message("user", "Add.")), TOOLS, digest="d1")
        first = await sessions.call(key, call)
        again = await sessions.call(key, ModelCall(call.messages, TOOLS, digest="d1", retry_of="d1"))
        return first, again, await finish(sessions, key)

    (first, again, r), model = with_sessions(body)
    assert again == first and sum(len(v) for v in model.replies.values()) == 1
    assert r.turn_count == 1 and sessions_retries(r) == 1


def sessions_retries(r: Rollout) -> int:
    return r.inputs.harness.retries  # type: ignore[no-any-return]


def test_a_retry_while_the_turn_is_still_made_waits_for_that_turn():
    gate = asyncio.Event()
    slow = gated(gate)

    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        call = ModelCall((Message("system", SYSTEM), Message("user", "Add.")), TOOLS, digest="d1")
        first = asyncio.ensure_future(sessions.call(key, call))
        await asyncio.sleep(0.05)
        first.cancel()  # the SDK gave up on the connection; the turn is taken anyway
        again = asyncio.ensure_future(sessions.call(key, ModelCall(call.messages, TOOLS, digest="d1", retry_of="d1")))
        await asyncio.sleep(0.05)
        gate.set()
        return await again, await finish(sessions, key)

    (answer, r), model = with_sessions(body, model=slow)
    assert isinstance(answer, ModelAnswer) and answer.calls
    assert sum(len(v) for v in model.replies.values()) == 1 and r.turn_count == 1


def test_refusals_keep_the_session():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        history = (Message("system", SYSTEM), Message("user", "Add."))
        unknown = await sessions.call("no-such-key", ModelCall(history, TOOLS))
        wrong_model = await sessions.call(key, ModelCall(history, TOOLS, model="gpt-4o"))
        image = await sessions.call(key, ModelCall((Message("user", (Part("text", "see"), Part("image", image="data:,x"))),), TOOLS))
        first = await sessions.call(key, ModelCall(history, TOOLS, model="policy"))
        assert isinstance(first, ModelAnswer)
        later_image = await sessions.call(key, ModelCall(
            (*history, as_message(first), Message("tool", (Part("image", image="data:,y"),), call_id=first.calls[0].id)), TOOLS))
        second = await sessions.call(key, ModelCall((*history, as_message(first), Message("tool", "1", call_id=first.calls[0].id)), TOOLS))
        r = await finish(sessions, key)
        return unknown, wrong_model, image, later_image, second, r

    (unknown, wrong_model, image, later_image, second, r), _ = with_sessions(body)
    assert (unknown.kind, unknown.status) == ("unauthorized", 401)
    assert (wrong_model.kind, wrong_model.status) == ("not_found", 404) and "policy" in wrong_model.message
    assert "engine_agent_models" in wrong_model.message  # a harness whose model name is fixed: what to set
    assert (image.kind, image.status) == ("invalid_request", 400) and "image" in image.message
    assert later_image.kind == "invalid_request"
    assert isinstance(second, ModelAnswer) and r.closed == [] and r.turn_count == 2
    assert r.inputs.harness.refused == ["not_found", "invalid_request", "invalid_request"]  # recorded with the sample


def test_a_request_s_own_template_kwargs_are_served_when_they_render_as_the_job_s_and_refused_when_not():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        history = (Message("system", SYSTEM), Message("user", "Add."))
        off = await sessions.call(key, ModelCall(history, TOOLS, template_kwargs={"enable_thinking": False}))
        reserved = await sessions.call(key, ModelCall(history, TOOLS, template_kwargs={"tools": []}))
        on = await sessions.call(key, ModelCall(history, TOOLS, template_kwargs={"enable_thinking": True}))
        r = await finish(sessions, key)
        return off, reserved, on, r

    (off, reserved, on, r), _ = with_sessions(body)
    # Qwen3 thinks unless told not to: asking it to think is the job's render, asking it not to is not
    assert (off.kind, off.status) == ("invalid_request", 400)
    assert off.message.startswith('chat_template_kwargs {"enable_thinking": false} render the prompt unlike this '
                                  "job's apply_chat_template_kwargs {}")
    assert "--chat-template-kwargs" in off.message
    assert reserved.kind == "invalid_request" and "may not set tools" in reserved.message
    assert isinstance(on, ModelAnswer) and r.turn_count == 1
    assert r.inputs.harness.refused == ["invalid_request", "invalid_request"]


def test_a_job_that_switches_thinking_off_serves_a_harness_that_asks_the_same_or_nothing():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        history = (Message("system", SYSTEM), Message("user", "Add."))
        same = await sessions.call(key, ModelCall(history, TOOLS, template_kwargs={"enable_thinking": False}))
        other = await sessions.call(key, ModelCall(history, TOOLS, template_kwargs={"enable_thinking": True}))
        await finish(sessions, key)
        rendered = rt.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Add."}], tools=list(TOOLS),
            tokenize=False, add_generation_prompt=True, enable_thinking=False)
        return same, other, rendered

    (same, other, rendered), model = with_sessions(body, chat_template_kwargs={"enable_thinking": False})
    assert isinstance(same, ModelAnswer)
    assert next(iter(model.requests.values()))[0] == model.profile.encode(rendered)  # thinking off, as both asked
    assert rendered.endswith("<think>\n\n</think>\n\n")
    assert other.kind == "invalid_request" and 'apply_chat_template_kwargs {"enable_thinking": false}' in other.message


def test_any_model_name_is_served_under_a_star():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        answer = await sessions.call(key, ModelCall((Message("user", "Add."),), TOOLS, model="claude-sonnet"))
        await finish(sessions, key)
        return answer, sessions.models()

    (answer, models), _ = with_sessions(body, agent_models=("policy", "*"))
    assert isinstance(answer, ModelAnswer) and models == ["policy"]


def test_a_spent_turn_budget_answers_the_waiting_call_with_length_and_refuses_the_rest():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        answers = await tool_task(sessions, key)
        late = await sessions.call(key, ModelCall((Message("user", "more"),), TOOLS))
        return answers, late, await finish(sessions, key)

    (answers, late, r), model = with_sessions(body, max_turns=2)
    assert [a.finish for a in answers] == ["tool_calls", "tool_calls", "length"]
    assert answers[-1].text == "" and (r.state, r.reason) == ("TRUNCATED", "max_turns_reached")
    assert (late.kind, late.status) == ("over_budget", 400)


def test_a_turn_cut_by_the_call_s_max_tokens_says_length_and_the_harness_goes_on():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        history = [Message("system", SYSTEM), Message("user", "Add.")]
        cut = await sessions.call(key, ModelCall(tuple(history), TOOLS, {"max_new_tokens": 4}))
        history += [as_message(cut), Message("user", "Go on.")]
        more = await sessions.call(key, ModelCall(tuple(history), TOOLS))
        return cut, more, await finish(sessions, key)

    (cut, more, r), model = with_sessions(body)
    assert cut.finish == "length" and cut.usage.completion_tokens == 4
    assert isinstance(more, ModelAnswer) and r.closed == [] and r.state == "COMPLETED"
    assert next(iter(model.requests.values()))[1][-1] != 0


def test_a_context_spent_by_the_harness_s_results_answers_length():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        history = [Message("system", SYSTEM), Message("user", "Add.")]
        first = await sessions.call(key, ModelCall(tuple(history), TOOLS))
        history += [as_message(first), Message("tool", "word " * 400, call_id=first.calls[0].id)]
        second = await sessions.call(key, ModelCall(tuple(history), TOOLS))
        return second, await finish(sessions, key)

    (second, r), _ = with_sessions(body, max_context_len=400)
    assert second.finish == "length" and second.text == ""
    assert (r.state, r.reason) == ("TRUNCATED", "observation_over_budget") and r.traj.total_length == 400


@pytest.mark.parametrize("variant, matcher, breaks", [
    ("drop_reasoning", "exact", ["reasoning_dropped"] * 3),  # each turn it echoes drops the reasoning again
    ("drop_reasoning", "json_calls", []),
    ("compact", "json_calls", ["history_compacted"]),
    ("fork", "json_calls", ["history_forked", "history_forked"]),
    ("rewrite", "json_calls", ["turn_rewritten"]),
    ("rewrite_deep", "json_calls", ["turn_rewritten"]),  # compared as text: a break, never a crash
    ("contradict", "json_calls", ["history_contradicts"]),
])
def test_a_history_that_does_not_extend_starts_a_segment_from_the_history_as_given(variant: str, matcher: str,
                                                                                  breaks: list[str]):
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        answers = await tool_task(sessions, key, variant=variant)
        return answers, await finish(sessions, key)

    (answers, r), model = with_sessions(body, agent_matcher=matcher)
    assert [s.reason for s in r.closed] == breaks
    assert all(isinstance(a, ModelAnswer) for a in answers) and r.state == "COMPLETED"
    requests = next(iter(model.requests.values()))
    replies = next(iter(model.replies.values()))
    segments = [*[s.traj for s in r.closed], r.traj]
    # each segment's prompt was sent as it is held, and its trained tokens are the server's replies, in order
    starts = [i for i, q in enumerate(requests) if any(q == t.prompt_ids.tolist() for t in segments)]
    assert len(starts) == len(segments)
    for traj, first, end in zip(segments, starts, [*starts[1:], len(requests)]):
        assert requests[first] == traj.prompt_ids.tolist()
        trained = [i for i, m in zip(traj.response_ids.tolist(), traj.loss_mask.tolist()) if m]
        assert trained == [i for ids, _ in replies[first:end] for i in ids]
        traj.check(full=True, max_total_length=8192)


def test_a_server_abort_inside_a_turn_is_one_answer_to_the_harness():
    def aborting_once(model: ScriptedModel) -> Callable[[httpx.Request], httpx.Response]:
        rest: list[Any] = []

        def answer(request: httpx.Request) -> httpx.Response:
            if rest:  # the turn goes on: the tokens after the 3 it had
                ids, lps = rest.pop()
                meta = {"id": "r2", "finish_reason": {"type": "stop", "matched": ids[-1]}, "prompt_tokens": 1,
                        "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": "w1", "e2e_latency": 0.0,
                        "output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids)]}
                return httpx.Response(200, json={"text": "", "output_ids": ids, "meta_info": meta})
            body = model(request).json()  # the first request: cut after 3 tokens, as a weight update aborts it
            ids, meta = body["output_ids"], body["meta_info"]
            lps = [m[0] for m in meta["output_token_logprobs"]]
            rest.append((ids[3:], lps[3:]))
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:3]
            meta["finish_reason"] = {"type": "abort", "message": "Abort before weight update"}
            return httpx.Response(200, json={"text": "", "output_ids": ids[:3], "meta_info": meta})
        return answer

    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        answer = await sessions.call(key, ModelCall((Message("system", SYSTEM), Message("user", "Add.")), TOOLS))
        return answer, await finish(sessions, key)

    (answer, r), model = with_sessions(body, model=aborting_once)
    assert answer.reasoning == "Step 0: add 0 and 1." and json.loads(answer.calls[0].arguments) == {"a": 0, "b": 1}
    [(ids, lps)] = next(iter(model.replies.values()))  # the turn as the model wrote it, sent in two replies
    assert r.turn_count == 1 and [t.get("aborted") for t in r.record.turn_log] == [True, None]
    assert r.traj.response_ids.tolist() == ids and r.traj.logprobs.tolist() == lps
    assert answer.usage.completion_tokens == len(ids)


def test_the_harness_ending_while_a_turn_is_made_ends_the_sample_with_the_turn_kept():
    gate = asyncio.Event()
    slow = gated(gate)

    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        waiting = asyncio.ensure_future(sessions.call(key, ModelCall((Message("user", "Add."),), TOOLS)))
        await asyncio.sleep(0.05)
        waiting.cancel()
        sessions.sessions[key].end("harness_crashed", "the harness died")
        gate.set()
        return await finish(sessions, key, "harness_crashed")

    r, _ = with_sessions(body, model=slow)
    assert (r.state, r.reason, r.record.error) == ("FAILED", "harness_crashed", "the harness died")
    assert r.turn_count == 1 and r.traj.loss_mask.tolist().count(1) == r.traj.response_length


def test_count_tokens_renders_the_history_with_its_tools():
    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        history = (Message("system", SYSTEM), Message("user", "Hi"))
        counted = await sessions.count_tokens(key, ModelCall(history, TOOLS))
        text = rt.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
                                                tools=list(TOOLS), tokenize=False, add_generation_prompt=True)
        return counted, len(rt.profile.encode(text)), await sessions.count_tokens("nope", ModelCall(history))

    (counted, expected, refused), _ = with_sessions(body)
    assert counted == expected and isinstance(refused, CallRefused)


@pytest.mark.parametrize("matched", ["##", "%%"])
def test_an_answer_names_the_call_s_stop_string_the_server_matched_and_no_other(matched: str):
    def stopping(model: ScriptedModel) -> Callable[[httpx.Request], Any]:
        """The scripted model, its second reply (the answer) ended by a stop string as SGLang reports one."""
        def answer(request: httpx.Request) -> httpx.Response:
            reply = model(request)
            if sum(len(v) for v in model.replies.values()) != 2:
                return reply
            body = reply.json()
            body["meta_info"]["finish_reason"] = {"type": "stop", "matched": matched}
            return httpx.Response(200, json=body)
        return answer

    async def body(sessions: AgentSessions, rt: Any, model: ScriptedModel) -> Any:
        key = keyed(sessions)
        history = (Message("system", SYSTEM), Message("user", "Add."))
        first = await sessions.call(key, ModelCall(history, TOOLS, {"stop": ["##"]}))
        history = (*history, as_message(first), Message("tool", "1", call_id=first.calls[0].id))
        last = await sessions.call(key, ModelCall(history, TOOLS, {"stop": ["##"]}))
        await finish(sessions, key)
        return first, last

    (first, last), _ = with_sessions(body, model=stopping, steps=1)
    assert first.stop_sequence is None  # ended on the template's closing token, an id
    assert last.calls == () and last.finish == "stop"
    assert last.stop_sequence == ("##" if matched == "##" else None)  # "%%": a stop string the call did not ask for
