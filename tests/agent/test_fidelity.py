"""Fidelity over many sessions per family, with the families' real tokenizers and chat templates.

200 scripted sessions per family run at once through `Sessions.call` against a scripted model
that writes the family's own call format: most replay their history verbatim (the SDKs' way),
some drop reasoning (taken under the default matcher), compact, fork a sub-agent, rewrite a
call or send a result for a call never made. Every segment is written as slime's sample and
checked from the outside (engine.local.invariants): its trained tokens and logprobs are the
server's replies in order (its record), mask-0 tokens carry 0.0, its text is the decode of its
ids, its prompt is the request that began it, its status and path say why it ended (I1-I4, I6).
A verbatim harness makes one sample; every other break is the one its change names.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import respx

from engine.agent.sessions import AgentSessions
from engine.local.invariants import sample_violations
from engine.local.sample import Sample
from engine.loop.runtime import Runtime
from engine.profiles.tokenizer import load_tokenizer, offline_tokenizer_dir
from engine.settings import EngineConfig, RetryPolicy
from engine.slime.sample_io import write_segments
from tests.support.agents import ScriptedModel, tool_task
from tests.support.helpers import URL

SESSIONS = 200
SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "no_stop_trim": True, "skip_special_tokens": False}
BUDGET = 8192
# model (None: the shipped Qwen3) -> the parser its template names
FAMILIES = {"qwen3-hermes": (None, "qwen"),  # hermes calls; "qwen" is its name for Qwen's template
            "glm-4.7": ("glm-4.7-flash", "glm47"),
            "deepseek-v3.1": ("deepseek-v3.1", "deepseekv31")}
# the harness's change -> the breaks it makes (under the default matcher, json_calls)
VARIANTS = {"verbatim": [], "drop_reasoning": [], "compact": ["history_compacted"],
            "fork": ["history_forked", "history_forked"], "rewrite": ["turn_rewritten"],
            "contradict": ["history_contradicts"]}


def variant_of(i: int) -> str:
    """Three sessions in four verbatim; the rest take each change in turn."""
    changes = list(VARIANTS)[1:]
    return "verbatim" if i % 4 else changes[(i // 4) % len(changes)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_trained_token_of_every_segment_is_the_server_s(family: str):
    model_dir, parser = FAMILIES[family]
    tokenizer = load_tokenizer(offline_tokenizer_dir(model_dir) if model_dir else None)
    cfg = EngineConfig(server_url=URL, profile="chat", max_context_len=BUDGET, max_turns=32,
                       retry=RetryPolicy(max_attempts=2, base_delay=0.0, deadline=10.0))

    async def go() -> tuple[list[Any], ScriptedModel, Any]:
        rt = Runtime.create(cfg, tokenizer=tokenizer)
        assert rt.profile.tool_parser == parser
        model = ScriptedModel(rt.profile, steps=3, seed=len(family))
        sessions = AgentSessions(rt)
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=model)

            async def one(i: int) -> tuple[str, str, Any]:
                session = sessions.open(sampling_params=dict(SAMPLING))
                session.routing_key = session.key  # the scripted model tells sessions apart by it
                await tool_task(sessions, session.key, variant=variant_of(i))
                session.end("harness_finished")
                return session.key, variant_of(i), await session.finished()

            try:
                done = await asyncio.gather(*(one(i) for i in range(SESSIONS)))
            finally:
                await rt.aclose()
        return done, model, rt.profile

    done, model, profile = asyncio.run(go())
    broken: list[str] = []
    for key, variant, r in done:
        samples = write_segments(Sample(index=0, prompt="task"), r, profile.decode, requeued=False)
        if [s.metadata["fsm"]["termination_reason"] for s in samples[:-1]] != VARIANTS[variant]:
            broken.append(f"{variant}: breaks {[s.metadata['fsm']['termination_reason'] for s in samples]}")
            continue
        requests, replies = model.requests[key], model.replies[key]
        at = 0
        for k, sample in enumerate(samples):
            prompt = sample.tokens[:len(sample.tokens) - sample.response_length]
            start = requests.index(prompt, at)  # the request that began the segment sent its prompt as held
            end = requests.index(samples[k + 1].tokens[:len(samples[k + 1].tokens) - samples[k + 1].response_length],
                                 start + 1) if k + 1 < len(samples) else len(requests)
            problems = sample_violations(sample, prompt_ids=prompt, budget=BUDGET, decode=profile.decode,
                                         sent=replies[start:end])
            broken += [f"{variant} segment {k}: {p}" for p in problems]
            at = end
        assert at == len(requests)
        if variant in ("verbatim", "drop_reasoning"):
            assert len(samples) == 1 and sample.metadata["fsm"]["termination_reason"] == "harness_finished"
    assert broken == [], broken[:5]
    assert sum(len(v) for v in model.replies.values()) >= SESSIONS * 4


PROTOCOL_CLIENTS = ["chat_task", "chat_stream_task", "responses_task", "responses_stream_task", "messages_task",
                    "messages_stream_task", "messages_tool_runner_task", "agents_sdk_chat_task"]


def test_a_verbatim_harness_over_each_protocol_makes_one_sample_of_the_server_s_tokens():
    """Through the front door, each protocol's client replaying its history as its SDK hands it back
    (Anthropic's tool runner and the Agents SDK over Chat Completions drive their own loops): no break,
    one sample per session, its trained tokens the server's replies (Qwen3's template)."""
    from engine.agent.harness import HarnessSpec
    from engine.agent.serving import close_served, run_agent

    cfg = EngineConfig(server_url=URL, profile="chat", max_context_len=BUDGET,
                       retry=RetryPolicy(max_attempts=2, base_delay=0.0, deadline=10.0))

    async def go() -> tuple[list[Any], ScriptedModel, Any]:
        rt = Runtime.create(cfg, tokenizer=load_tokenizer(None))
        model = ScriptedModel(rt.profile, steps=3)
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=model)
            mock.route(host="127.0.0.1").pass_through()  # the clients reach the door

            async def one(i: int) -> tuple[str, str, Any]:
                client = PROTOCOL_CLIENTS[i % len(PROTOCOL_CLIENTS)]
                spec = HarnessSpec.parse(f"tests.support.agent_harnesses:{client}")
                run = await run_agent(rt, spec, prompt="task", sampling_params=dict(SAMPLING), routing_key=f"s{i}")
                return f"s{i}", client, run

            try:
                done = await asyncio.gather(*(one(i) for i in range(len(PROTOCOL_CLIENTS) * 3)))
            finally:
                await close_served(rt)
                await rt.aclose()
        return done, model, rt.profile

    done, model, profile = asyncio.run(go())
    for key, client, run in done:
        assert run.outcome.reason == "harness_finished" and run.outcome.result == "The sum is 15.", (client, run.outcome)
        samples = write_segments(Sample(index=0, prompt="task"), run.rollout, profile.decode, requeued=False)
        assert len(samples) == 1 and run.refused == (), (client, [s.metadata["fsm"]["termination_reason"] for s in samples])
        sample = samples[0]
        prompt = sample.tokens[:len(sample.tokens) - sample.response_length]
        assert model.requests[key][0] == prompt
        assert sample_violations(sample, prompt_ids=prompt, budget=BUDGET, decode=profile.decode,
                                 sent=model.replies[key]) == [], client
