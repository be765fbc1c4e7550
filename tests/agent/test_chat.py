"""Chat Completions through the front door, with the `openai` SDK on a real loopback socket.

Each test asserts both sides: what the SDK got (and that the wire body validates strictly against
the SDK's own types, which its lenient parser would not check) and what call the session got.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.agent.calls import CallMade, Message, ModelAnswer, Part, Usage
from tests.agent.scripted import MODEL, ScriptedSessions, openai_client, running, sse_events

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
THINKING = ModelAnswer(text="The sum is 5.", reasoning="2 and 3 make 5", usage=Usage(12, 7, 4), id="a1")
CALLING = ModelAnswer(text="", reasoning="I need the weather", finish="tool_calls", usage=Usage(30, 9), id="a2",
                      calls=(CallMade("c0", "get_weather", '{"city": "Paris"}'),))
SUNNY = ModelAnswer(text="It is sunny in Paris.", usage=Usage(50, 6), id="a3")


def test_a_completion_carries_text_reasoning_usage_and_the_call_carries_the_history_and_sampling() -> None:
    sessions = ScriptedSessions({"k": [THINKING]})

    async def go() -> tuple[Any, dict[str, Any]]:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
                max_completion_tokens=50, temperature=0.5, top_p=0.9, stop=["END"], seed=3,
                extra_body={"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}})
            await client.close()
            return raw.parse(), raw.http_response.json()

    done, body = asyncio.run(go())
    ChatCompletion.model_validate(body)
    choice = done.choices[0]
    assert choice.message.content == "The sum is 5." and choice.finish_reason == "stop"
    assert choice.message.model_extra["reasoning_content"] == "2 and 3 make 5"
    assert done.id == "chatcmpl-a1" and done.model == MODEL
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (12, 7, 19)
    assert done.usage.prompt_tokens_details.cached_tokens == 4
    [call] = sessions.calls["k"]
    assert call.messages == (Message("system", "Be brief."), Message("user", "2+3?"))
    assert call.sampling == {"max_new_tokens": 50, "temperature": 0.5, "top_p": 0.9, "stop": ["END"],
                             "sampling_seed": 3, "top_k": 20}
    assert call.protocol == "chat" and call.model == MODEL and call.tool_choice == "auto"
    assert call.retry_of is None and len(call.digest) == 64
    assert call.template_kwargs == {"enable_thinking": False}  # the session decides whether it serves them


def test_tool_calls_go_out_in_openai_style_and_come_back_to_the_session_as_its_own() -> None:
    sessions = ScriptedSessions({"k": [CALLING, SUNNY]})

    async def go() -> tuple[Any, Any]:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
            first = await client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                                         tool_choice="required")
            message = first.choices[0].message
            history.append({"role": "assistant", "content": message.content,
                            "reasoning_content": message.model_extra["reasoning_content"],
                            "tool_calls": [c.model_dump() for c in message.tool_calls]})
            history.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 24 C"})
            second = await client.chat.completions.create(
                model=MODEL, messages=history, tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            await client.close()
            return first, second

    first, second = asyncio.run(go())
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    [tool_call] = message.tool_calls
    assert (tool_call.id, tool_call.function.name, tool_call.function.arguments) == \
        ("call_c0", "get_weather", '{"city": "Paris"}')
    assert second.choices[0].message.content == "It is sunny in Paris."
    one, two = sessions.calls["k"]
    assert one.tools == (WEATHER,) and one.tool_choice == "required"
    assert two.tool_choice == "get_weather"
    assert two.messages[1:] == (
        Message("assistant", "", reasoning="I need the weather", calls=(CallMade("c0", "get_weather", '{"city": "Paris"}'),)),
        Message("tool", "sunny, 24 C", call_id="c0"),
    )


@pytest.mark.parametrize("usage", [True, False])
def test_a_stream_is_the_whole_answer_in_chunks_then_done(usage: bool) -> None:
    long_text = "word " * 40  # several deltas
    answer = ModelAnswer(text=long_text, reasoning="think " * 30, finish="tool_calls", usage=Usage(40, 90, 8), id="s1",
                         calls=(CallMade("c0", "get_weather", '{"city": "Paris"}'),
                                CallMade("c1", "get_weather", '{"city": "' + "Rome" * 30 + '"}')))
    sessions = ScriptedSessions({"sdk": [answer], "raw": [answer]})
    request: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "tools": [WEATHER],
                               "stream": True}
    if usage:
        request["stream_options"] = {"include_usage": True}

    async def go() -> tuple[list[Any], str]:
        async with running(sessions) as door:
            client = openai_client(door.session_url("sdk"))
            stream = await client.chat.completions.create(**request)
            chunks = [chunk async for chunk in stream]
            await client.close()
            async with httpx.AsyncClient() as http:
                raw = await http.post(f"{door.session_url('raw')}/v1/chat/completions", json=request)
            assert raw.headers["content-type"].startswith("text/event-stream")
            return chunks, raw.text

    chunks, raw = asyncio.run(go())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    assert text == long_text and reasoning == answer.reasoning
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            slot = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += delta.id or ""
            slot["name"] += (delta.function.name or "") if delta.function else ""
            slot["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert calls == {0: {"id": "call_c0", "name": "get_weather", "arguments": answer.calls[0].arguments},
                     1: {"id": "call_c1", "name": "get_weather", "arguments": answer.calls[1].arguments}}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert len(chunks) > 6  # deltas, not one lump
    if usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 90
    else:
        assert all(c.usage is None for c in chunks)
    events = list(sse_events(raw))
    assert events[-1] == (None, "[DONE]")
    for _, data in events[:-1]:
        ChatCompletionChunk.model_validate(data)
    assert {data["id"] for _, data in events[:-1]} == {"chatcmpl-s1"}


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_at_its_token_cap_finishes_length(stream: bool) -> None:
    sessions = ScriptedSessions({"k": [ModelAnswer(text="The answer is", finish="length", usage=Usage(5, 3))]})

    async def go() -> str | None:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            messages: Any = [{"role": "user", "content": "Say a lot."}]
            if stream:
                got = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)
                reasons = [c.choices[0].finish_reason async for c in got if c.choices]
                finish = [r for r in reasons if r][-1]
            else:
                finish = (await client.chat.completions.create(model=MODEL, messages=messages,
                                                               max_tokens=3)).choices[0].finish_reason
            await client.close()
            return finish

    assert asyncio.run(go()) == "length"
    assert sessions.calls["k"][0].sampling == {"max_new_tokens": 3}


def test_images_reach_the_session_as_image_parts_in_order() -> None:
    sessions = ScriptedSessions({"k": [SUNNY]})
    pixel = "data:image/png;base64,iVBORw0KGgo="

    async def go() -> None:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is here?"},
                {"type": "image_url", "image_url": {"url": pixel, "detail": "low"}},
                {"type": "text", "text": "And here?"},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}]}])
            await client.close()

    asyncio.run(go())
    [call] = sessions.calls["k"]
    assert call.messages[0].content == (Part("text", "What is here?"), Part("image", image=pixel),
                                        Part("text", "And here?"), Part("image", image="https://example.invalid/cat.png"))


def test_text_parts_alone_are_one_string() -> None:
    sessions = ScriptedSessions({"k": [SUNNY]})

    async def go() -> None:
        async with running(sessions) as door:
            client = openai_client(door.session_url("k"))
            await client.chat.completions.create(model=MODEL, messages=[
                {"role": "system", "content": [{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}]},
                {"role": "user", "content": "Go."}])
            await client.close()

    asyncio.run(go())
    assert sessions.calls["k"][0].messages[0] == Message("system", "One.\nTwo.")
