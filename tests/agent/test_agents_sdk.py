"""The OpenAI Agents SDK, unmodified but for its base URL, runs a 5-turn tool task through the front door.

Four turns call a tool the SDK runs itself (`add`); the fifth answers. The SDK drives the loop
(Responses or Chat Completions, streamed or not); the scripted sessions record what each call
carried: the growing history, with each tool result answering the session's own call id.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)

from engine.agent.calls import CallMade, ModelAnswer, Usage
from tests.agent.scripted import MODEL, ScriptedSessions, openai_client, running

ADDENDS = [(1, 2), (3, 4), (10, 20), (100, 5)]


def script() -> list[ModelAnswer]:
    turns = [ModelAnswer(text="", reasoning=f"step {i}", finish="tool_calls", usage=Usage(10 * (i + 1), 5), id=f"t{i}",
                         calls=(CallMade(f"c{i}", "add", json.dumps({"a": a, "b": b})),))
             for i, (a, b) in enumerate(ADDENDS)]
    return [*turns, ModelAnswer(text="The sums are 3, 7, 30 and 105.", usage=Usage(60, 9), id="t4")]


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize("streamed", [False, True])
def test_the_agents_sdk_finishes_a_five_turn_tool_task(api: str, streamed: bool) -> None:
    sessions = ScriptedSessions({"agent-1": script()})

    async def go() -> str:
        async with running(sessions) as door:
            client = openai_client(door.session_url("agent-1"))
            model = (OpenAIResponsesModel(model=MODEL, openai_client=client) if api == "responses"
                     else OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
            agent = Agent(name="adder", instructions="Add with the tool.", tools=[add], model=model,
                          model_settings=ModelSettings(max_tokens=200))
            config = RunConfig(tracing_disabled=True)
            task = "Add 1+2, 3+4, 10+20 and 100+5, one call at a time."
            if streamed:
                run = Runner.run_streamed(agent, task, run_config=config, max_turns=8)
                async for _ in run.stream_events():
                    pass
                output = run.final_output
            else:
                output = (await Runner.run(agent, task, run_config=config, max_turns=8)).final_output
            await client.close()
            return str(output)

    assert asyncio.run(go()) == "The sums are 3, 7, 30 and 105."
    calls = sessions.calls["agent-1"]
    assert len(calls) == 5 and sessions.script["agent-1"] == []
    for turn, call in enumerate(calls):
        assert call.protocol == api and call.model == MODEL and call.sampling.get("max_new_tokens") == 200
        assert [t["function"]["name"] for t in call.tools] == ["add"]
        assert call.messages[0].role == "system" and call.messages[0].text() == "Add with the tool."
        assert call.messages[1].role == "user" and "100+5" in call.messages[1].text()
        # the history so far: each earlier turn's call, made by the session, and its result from the SDK's tool
        assistants = [m for m in call.messages if m.role == "assistant"]
        results = [m for m in call.messages if m.role == "tool"]
        assert [m.calls for m in assistants] == [(CallMade(f"c{i}", "add", json.dumps({"a": a, "b": b})),)
                                                 for i, (a, b) in enumerate(ADDENDS[:turn])]
        assert [(m.call_id, m.text()) for m in results] == [(f"c{i}", str(a + b))
                                                            for i, (a, b) in enumerate(ADDENDS[:turn])]
        if api == "responses":  # the SDK sends reasoning items back with the turn they belong to
            assert [m.reasoning for m in assistants] == [f"step {i}" for i in range(turn)]
