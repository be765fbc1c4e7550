"""Anthropic Messages through the front door, with the `anthropic` SDK on a real loopback socket.

System, thinking, tool_use and tool_result blocks (with `is_error`), images kept as image parts,
the event sequence the SDK's stream helper rebuilds, `max_tokens` as the stop reason, and
`count_tokens` answered by the session; the SDK's tool runner, whose server-held thread the door
refuses so that it sends the whole conversation; structured output refused before any turn.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import pydantic
import pytest
from anthropic import beta_async_tool
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent

from engine.agent.calls import CallMade, Message, ModelAnswer, Part, Usage
from tests.agent.scripted import CALLING, LONG, MODEL, ScriptedSessions, anthropic_client, running, sse_events

WEATHER = {"name": "get_weather", "description": "Weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SUNNY = ModelAnswer(text="Sunny in Paris; Rome failed.", usage=Usage(60, 6), id="m2")
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


def test_system_tools_thinking_and_tool_results_with_errors_round_trip() -> None:
    sessions = ScriptedSessions({"k": [CALLING, SUNNY]})

    async def go() -> tuple[Any, dict[str, Any], Any]:
        async with running(sessions) as door:
            client = anthropic_client(door.session_url("k"))
            history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris and Rome?"}]
            raw = await client.messages.with_raw_response.create(
                model=MODEL, max_tokens=256, system=[{"type": "text", "text": "Be brief."}], messages=history,
                tools=[WEATHER], tool_choice={"type": "any"}, stop_sequences=["##"],
                extra_body={"temperature": 0.3, "top_k": 40})  # older SDKs' and harnesses' sampling fields
            first = await raw.parse()
            history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
            uses = [b for b in first.content if b.type == "tool_use"]
            history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"},
                {"type": "tool_result", "tool_use_id": uses[1].id, "content": [{"type": "text", "text": "timeout"}],
                 "is_error": True},
                {"type": "text", "text": "Anything else?"}]})
            second = await client.messages.create(model=MODEL, max_tokens=256, system="Be brief.", messages=history,
                                                  tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
            await client.close()
            return first, raw.http_response.json(), second

    first, body, second = asyncio.run(go())
    AnthropicMessage.model_validate(body)
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, *uses = first.content
    assert thinking.thinking == "I need the weather" and thinking.signature and text.text == "Let me look."
    assert [(u.id, u.name, u.input) for u in uses] == [("toolu_c0", "get_weather", {"city": "Paris"}),
                                                       ("toolu_c1", "get_weather", {"city": "Rome"})]
    assert first.stop_reason == "tool_use" and first.id == "msg_m1"
    # Anthropic counts cached prompt tokens apart from input_tokens
    assert (first.usage.input_tokens, first.usage.cache_read_input_tokens, first.usage.output_tokens) == (20, 10, 9)
    assert second.content[0].text == "Sunny in Paris; Rome failed." and second.stop_reason == "end_turn"
    one, two = sessions.calls["k"]
    assert one.messages == (Message("system", "Be brief."), Message("user", "Weather in Paris and Rome?"))
    assert one.tools == ({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                           "parameters": WEATHER["input_schema"]}},)
    assert one.tool_choice == "required" and two.tool_choice == "get_weather" and one.protocol == "messages"
    assert one.sampling == {"max_new_tokens": 256, "temperature": 0.3, "top_k": 40, "stop": ["##"]}
    assert two.messages[2:] == (
        Message("assistant", "Let me look.", reasoning="I need the weather", calls=CALLING.calls),
        Message("tool", "sunny", call_id="c0"),
        Message("tool", "timeout", call_id="c1", error=True),
        Message("user", "Anything else?"),
    )


def test_a_stream_is_anthropics_event_sequence_and_the_sdk_rebuilds_the_message() -> None:
    answer = LONG
    sessions = ScriptedSessions({"sdk": [answer], "raw": [answer]})
    request = {"model": MODEL, "max_tokens": 512, "messages": [{"role": "user", "content": "go"}], "tools": [WEATHER],
               "stream": True}

    async def go() -> tuple[list[str], Any, str]:
        async with running(sessions) as door:
            client = anthropic_client(door.session_url("sdk"))
            async with client.messages.stream(model=MODEL, max_tokens=512, tools=[WEATHER],  # type: ignore[list-item]
                                              messages=[{"role": "user", "content": "go"}]) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
            await client.close()
            async with httpx.AsyncClient() as http:
                raw = await http.post(f"{door.session_url('raw')}/v1/messages", json=request,
                                      headers={"anthropic-version": "2023-06-01"})
            return kinds, final, raw.text

    kinds, final, raw = asyncio.run(go())
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == answer.reasoning and final.content[1].text == answer.text
    assert final.content[2].input == {"city": "Paris" * 30} and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 99
    events = list(sse_events(raw))
    for name, data in events:
        if name != "ping":  # Anthropic's keep-alive, which its SDK reads apart from the message's events
            assert name == EVENTS.validate_python(data).type
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 3
    assert names.count("content_block_delta") > 6 and "content_block_delta" in kinds


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_at_its_token_cap_stops_for_max_tokens(stream: bool) -> None:
    sessions = ScriptedSessions({"k": [ModelAnswer(text="The answer is", finish="length", usage=Usage(5, 3))]})

    async def go() -> Any:
        async with running(sessions) as door:
            client = anthropic_client(door.session_url("k"))
            messages: Any = [{"role": "user", "content": "Say a lot."}]
            if stream:
                async with client.messages.stream(model=MODEL, max_tokens=3, messages=messages) as events:
                    done = await events.get_final_message()
            else:
                done = await client.messages.create(model=MODEL, max_tokens=3, messages=messages)
            await client.close()
            return done

    done = asyncio.run(go())
    assert done.stop_reason == "max_tokens" and done.content[0].text == "The answer is"


def test_images_by_base64_and_url_are_kept_as_image_parts_also_inside_tool_results() -> None:
    sessions = ScriptedSessions({"k": [SUNNY]})

    async def go() -> None:
        async with running(sessions) as door:
            client = anthropic_client(door.session_url("k"))
            await client.messages.create(model=MODEL, max_tokens=16, messages=[
                {"role": "user", "content": [
                    {"type": "text", "text": "What is here?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_z", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_z", "content": [
                    {"type": "image", "source": {"type": "url", "url": "https://example.invalid/s.png"}}]}]},
            ])
            await client.close()

    asyncio.run(go())
    [call] = sessions.calls["k"]
    assert call.messages == (
        Message("user", (Part("text", "What is here?"), Part("image", image="data:image/png;base64,iVBORw0KGgo="))),
        Message("assistant", "", calls=(CallMade("z", "shot", "{}"),)),
        Message("tool", (Part("image", image="https://example.invalid/s.png"),), call_id="z"),
    )


def test_count_tokens_is_the_sessions_count_of_the_rendered_request() -> None:
    sessions = ScriptedSessions({"k": []})

    async def go() -> int:
        async with running(sessions) as door:
            client = anthropic_client(door.session_url("k"))
            counted = await client.messages.count_tokens(model=MODEL, system="two words",
                                                         messages=[{"role": "user", "content": "three words here"}],
                                                         tools=[WEATHER])  # type: ignore[list-item]
            await client.close()
            return counted.input_tokens

    assert asyncio.run(go()) == 5
    [call] = sessions.counted
    assert call.messages == (Message("system", "two words"), Message("user", "three words here"))
    assert call.tools[0]["function"]["name"] == "get_weather" and call.protocol == "messages"


def test_the_sdks_tool_runner_sends_its_whole_conversation_once_the_door_refuses_its_thread() -> None:
    # The SDK's beta tool runner asks for a server-held thread and then sends only each turn's new
    # messages; the door keeps no state, so it refuses `thread` with the code on which the SDK
    # stops threading and sends the whole conversation again.
    sessions = ScriptedSessions({"k": [CALLING, SUNNY]})

    @beta_async_tool
    async def get_weather(city: str) -> str:
        """Weather of a city."""
        if city == "Rome":
            raise TimeoutError("the weather service timed out")
        return "sunny"

    async def go() -> list[str | None]:
        async with running(sessions) as door:
            client = anthropic_client(door.session_url("k"))
            runner = client.beta.messages.tool_runner(model=MODEL, max_tokens=256, tools=[get_weather],
                                                      messages=[{"role": "user", "content": "Paris and Rome?"}])
            stops = [message.stop_reason async for message in runner]
            await client.close()
            return stops

    assert asyncio.run(go()) == ["tool_use", "end_turn"]
    one, two = sessions.calls["k"]  # the refused request took no turn
    assert sessions.script["k"] == [] and one.messages == (Message("user", "Paris and Rome?"),)
    assert two.messages[0] == one.messages[0] and two.messages[1].calls == CALLING.calls
    assert [(m.role, m.call_id, m.error) for m in two.messages[2:]] == [("tool", "c0", False), ("tool", "c1", True)]
    assert two.messages[2].text() == "sunny" and "timed out" in two.messages[3].text()


@pytest.mark.parametrize("beta", [False, True])
def test_structured_output_is_refused_before_a_turn_is_taken(beta: bool) -> None:
    sessions = ScriptedSessions({"k": [SUNNY]})

    class City(pydantic.BaseModel):
        name: str

    async def go() -> anthropic.BadRequestError:
        async with running(sessions) as door:
            client = anthropic_client(door.session_url("k"))
            messages = client.beta.messages if beta else client.messages
            with pytest.raises(anthropic.BadRequestError) as refused:
                await messages.parse(model=MODEL, max_tokens=64, output_format=City,
                                     messages=[{"role": "user", "content": "Which city?"}])
            await client.close()
            return refused.value

    refused = asyncio.run(go())
    assert refused.status_code == 400 and "structured output is not enforced" in refused.message
    assert "k" not in sessions.calls and sessions.script["k"] == [SUNNY]


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_ended_by_a_requested_stop_sequence_says_which(stream: bool) -> None:
    sessions = ScriptedSessions({"k": [ModelAnswer(text="1, 2, 3", usage=Usage(5, 4), stop_sequence="##"), SUNNY]})

    async def go() -> list[Any]:
        async with running(sessions) as door:
            client = anthropic_client(door.session_url("k"))
            done = []
            for _ in range(2):
                messages: Any = [{"role": "user", "content": "Count."}]
                if stream:
                    async with client.messages.stream(model=MODEL, max_tokens=64, messages=messages,
                                                      stop_sequences=["##"]) as events:
                        done.append(await events.get_final_message())
                else:
                    done.append(await client.messages.create(model=MODEL, max_tokens=64, messages=messages,
                                                             stop_sequences=["##"]))
            await client.close()
            return done

    stopped, ended = asyncio.run(go())
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", "##", "1, 2, 3")
    assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None)
