"""Responses through the front door, with the `openai` SDK on a real loopback socket.

Input items become the session's messages (an assistant turn is its reasoning, message and
function calls together); an answer becomes output items, and as a stream the Responses event
sequence, which the SDK's own accumulator rebuilds into the same response.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from engine.agent.calls import CallMade, Message, ModelAnswer, Part, Usage
from tests.agent.scripted import CALLING, LONG, MODEL, ScriptedSessions, openai_client, running, sse_events

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city.", "strict": False,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SUNNY = ModelAnswer(text="Sunny in both.", usage=Usage(60, 4), id="r2")
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def test_instructions_items_and_tools_become_the_call_and_the_answer_output_items() -> None:
    sessions = ScriptedSessions({"k": [CALLING, SUNNY]})

    async def go() -> tuple[Any, dict[str, Any], Any]:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            items: list[Any] = [{"role": "user", "content": "Weather in Paris and Rome?"}]
            raw = await client.responses.with_raw_response.create(
                model=MODEL, instructions="Be brief.", input=items, tools=[WEATHER], max_output_tokens=64,
                temperature=0.2, top_p=0.5, tool_choice="auto")
            first = raw.parse()
            items += [item.model_dump(exclude_none=True) for item in first.output]
            items += [{"type": "function_call_output", "call_id": c.call_id, "output": f"sunny in {i}"}
                      for i, c in enumerate(o for o in first.output if o.type == "function_call")]
            second = await client.responses.create(model=MODEL, instructions="Be brief.", input=items, tools=[WEATHER],
                                                   tool_choice={"type": "function", "name": "get_weather"})
            await client.close()
            return first, raw.http_response.json(), second

    first, body, second = asyncio.run(go())
    Response.model_validate(body)
    assert [o.type for o in first.output] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, *calls = first.output
    assert reasoning.content[0].text == "I need the weather" and message.content[0].text == "Let me look."
    assert [(c.call_id, c.id, c.name, c.arguments) for c in calls] == [
        ("call_c0", "fc_c0", "get_weather", '{"city": "Paris"}'), ("call_c1", "fc_c1", "get_weather", '{"city": "Rome"}')]
    assert first.status == "completed" and first.id == "resp_m1" and first.tools[0].name == "get_weather"
    assert (first.usage.input_tokens, first.usage.output_tokens, first.usage.input_tokens_details.cached_tokens) == \
        (30, 9, 10)
    assert second.output_text == "Sunny in both."
    one, two = sessions.calls["k"]
    assert one.messages == (Message("system", "Be brief."), Message("user", "Weather in Paris and Rome?"))
    assert one.tools == ({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                           "parameters": WEATHER["parameters"]}},)
    assert one.sampling == {"max_new_tokens": 64, "temperature": 0.2, "top_p": 0.5} and one.protocol == "responses"
    assert two.tool_choice == "get_weather"
    assert two.messages[2:] == (
        Message("assistant", "Let me look.", reasoning="I need the weather", calls=CALLING.calls),
        Message("tool", "sunny in 0", call_id="c0"), Message("tool", "sunny in 1", call_id="c1"))


def test_a_stream_is_the_event_sequence_and_the_sdk_rebuilds_the_response_from_it() -> None:
    answer = LONG
    sessions = ScriptedSessions({"sdk": [answer], "raw": [answer]})
    request = {"model": MODEL, "input": "go", "tools": [WEATHER], "stream": True}

    async def go() -> tuple[list[str], Any, str]:
        async with running(sessions) as door:
            client = openai_client(door.session_url("sdk"))
            async with client.responses.stream(model=MODEL, input="go", tools=[WEATHER]) as stream:  # type: ignore[list-item]
                kinds = [event.type async for event in stream]
                final = await stream.get_final_response()
            await client.close()
            async with httpx.AsyncClient() as http:
                raw = await http.post(f"{door.session_url('raw')}/v1/responses", json=request)
            return kinds, final, raw.text

    kinds, final, raw = asyncio.run(go())
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") > 1 and kinds.count("response.reasoning_text.delta") > 1
    assert kinds.count("response.function_call_arguments.delta") > 1
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == answer.reasoning and final.output_text == answer.text
    assert final.output[2].arguments == answer.calls[0].arguments and final.usage.output_tokens == 99
    events = list(sse_events(raw))
    numbers = []
    for name, data in events:
        event = EVENTS.validate_python(data)
        assert name == event.type
        numbers.append(event.sequence_number)
    assert numbers == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_at_its_token_cap_is_incomplete_for_max_output_tokens(stream: bool) -> None:
    sessions = ScriptedSessions({"k": [ModelAnswer(text="The answer is", finish="length", usage=Usage(5, 3))]})

    async def go() -> Any:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            if stream:
                async with client.responses.stream(model=MODEL, input="Say a lot.", max_output_tokens=16) as events:
                    seen = [e async for e in events]
                # the SDK's helper keeps a final response from `response.completed` only, as OpenAI's own stream
                assert seen[-1].type == "response.incomplete"
                done = seen[-1].response
            else:
                done = await client.responses.create(model=MODEL, input="Say a lot.", max_output_tokens=16)
            await client.close()
            return done

    done = asyncio.run(go())
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == "The answer is"


def test_reasoning_given_as_a_summary_and_images_by_url_reach_the_session() -> None:
    sessions = ScriptedSessions({"k": [SUNNY]})
    pixel = "data:image/png;base64,iVBORw0KGgo="

    async def go() -> None:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            await client.responses.create(model=MODEL, input=[
                {"role": "developer", "content": "Rules."},
                {"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                             {"type": "input_image", "image_url": pixel, "detail": "auto"}]},
                {"type": "reasoning", "id": "rs_x", "summary": [{"type": "summary_text", "text": "a cat"}]},
                {"type": "message", "id": "msg_x", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "A cat.", "annotations": []}]},
                {"type": "reasoning", "id": "rs_y", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                {"type": "function_call", "call_id": "other-id", "name": "zoom", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "other-id", "output": [
                    {"type": "input_text", "text": "zoomed"}, {"type": "input_image", "image_url": pixel}]},
            ])
            await client.close()

    asyncio.run(go())
    [call] = sessions.calls["k"]
    assert call.messages == (
        Message("system", "Rules."),
        Message("user", (Part("text", "Look:"), Part("image", image=pixel))),
        Message("assistant", "A cat.", reasoning="a cat"),
        Message("assistant", "", reasoning="hm", calls=(CallMade("other-id", "zoom", "{}"),)),
        Message("tool", (Part("text", "zoomed"), Part("image", image=pixel)), call_id="other-id"),
    )


def test_input_tokens_are_counted_by_the_session() -> None:
    sessions = ScriptedSessions({"k": []})

    async def go() -> int:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            counted = await client.responses.input_tokens.count(model=MODEL, input="three words here",
                                                                instructions="two more")
            await client.close()
            return counted.input_tokens

    assert asyncio.run(go()) == 5
    assert sessions.counted[0].messages == (Message("system", "two more"), Message("user", "three words here"))


def test_reasoning_asked_as_encrypted_content_comes_back_from_it_alone() -> None:
    """A harness that keeps no server state (`store: false`, `include` encrypted reasoning) may
    send back a reasoning item with its encrypted content only; another server's ciphertext is
    never read as reasoning."""
    sessions = ScriptedSessions({"k": [CALLING, SUNNY]})

    async def go() -> Any:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            first = await client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], store=False,
                                                  include=["reasoning.encrypted_content"])
            sealed = first.output[0].encrypted_content
            items: list[Any] = [
                {"type": "reasoning", "id": "rs_old", "summary": [], "encrypted_content": "gAAAAB-not-ours"},
                {"type": "message", "role": "assistant", "content": "Earlier."},
                {"role": "user", "content": "Weather?"},
                {"type": "reasoning", "id": first.output[0].id, "summary": [], "encrypted_content": sealed},
                *[{"type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": o.arguments}
                  for o in first.output if o.type == "function_call"],
                {"type": "function_call_output", "call_id": "call_c0", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_c1", "output": "rainy"}]
            await client.responses.create(model=MODEL, input=items, tools=[WEATHER], store=False)
            await client.close()
            return first

    first = asyncio.run(go())
    assert first.output[0].content[0].text == "I need the weather" and first.output[0].encrypted_content
    earlier, _, turn = sessions.calls["k"][1].messages[:3]
    assert earlier == Message("assistant", "Earlier.", reasoning="")
    assert turn == Message("assistant", "", reasoning="I need the weather", calls=CALLING.calls)
