"""The door reads of a session's history only what a call adds: what it read last time is reused.

The unit tests read bodies with each protocol module directly and compare, call by call, a read
that reuses the last one with a read from scratch: the same messages, always; the repeated ones
the very objects read before; anything that differs from what was read (a changed item, a number
written another way, a Responses turn still open) read again. The door's tests send real
requests through the SDKs' own wire format on a loopback socket.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.agent import chat, messages, responses, shapes
from engine.agent.calls import ModelAnswer, Usage
from tests.agent.scripted import MODEL, ScriptedSessions, running

pytestmark = pytest.mark.skipif(shapes._orjson is None, reason="the reuse needs orjson (the fast extra)")

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def chat_turns(n: int) -> list[dict[str, Any]]:
    """A chat history of `n` tool turns, as an agent's SDK sends it."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2, then +2"}]
    for k in range(n):
        history.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]})
        history.append({"role": "tool", "tool_call_id": f"call_{k}", "content": str(3 + 2 * k)})
    return history


def chat_body(history: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": history, "tools": [TOOL]}


def reread(read: Any, body: dict[str, Any], last: shapes.History | None) -> shapes.Asked:
    """`read` of `body` reusing `last`, checked against a read of the same body from scratch."""
    reused, fresh = read(copy.deepcopy(body), last), read(copy.deepcopy(body))
    assert reused.call == fresh.call and reused.history is not None
    assert reused.history.texts == fresh.history.texts and reused.history.marks == fresh.history.marks
    return reused


def test_a_call_that_repeats_the_history_reuses_every_message_read_and_reads_what_it_adds() -> None:
    first = reread(chat.read, chat_body(chat_turns(3)), None)
    second = reread(chat.read, chat_body(chat_turns(4)), first.history)
    assert len(first.call.messages) == 8 and len(second.call.messages) == 10
    assert all(a is b for a, b in zip(first.call.messages, second.call.messages))  # the very objects
    assert second.call.messages[8].calls[0].id == "3" and second.call.messages[9].text() == "9"


def test_an_item_changed_in_the_middle_is_read_again_from_there() -> None:
    first = reread(chat.read, chat_body(chat_turns(4)), None)
    changed = chat_turns(5)
    changed[5]["content"] = "7 (checked)"
    second = reread(chat.read, chat_body(changed), first.history)
    assert all(a is b for a, b in zip(first.call.messages[:5], second.call.messages[:5]))
    assert second.call.messages[5] is not first.call.messages[5] and second.call.messages[5].text() == "7 (checked)"
    assert second.call.messages[6] == first.call.messages[6]  # equal as read, read again all the same
    assert second.call.messages[6] is not first.call.messages[6]


def test_a_number_written_another_way_is_another_item() -> None:
    """`1` and `1.0` are equal in Python but not the same JSON: Anthropic's tool input is kept as written."""
    def body(a: Any) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": 8, "messages": [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": a}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}]}]}

    first = reread(messages.read, body(1), None)
    second = reread(messages.read, body(1.0), first.history)
    assert first.call.messages[1].calls[0].arguments == '{"a": 1}'
    assert second.call.messages[1].calls[0].arguments == '{"a": 1.0}'
    assert second.call.messages[0] is first.call.messages[0] and second.call.messages[1] is not first.call.messages[1]


def test_a_responses_turn_still_open_is_read_again_with_what_follows_it() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "add"},
        {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "use the tool"}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"},
    ]
    first = reread(responses.read, {"model": MODEL, "input": items}, None)
    assert first.history is not None and first.history.marks == (0, 1, -1, -1)
    more = [*items, {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "3"}]
    second = reread(responses.read, {"model": MODEL, "input": more}, first.history)
    assert second.call.messages[0] is first.call.messages[0]
    assert [c.id for c in second.call.messages[1].calls] == ["1", "2"]  # one turn, gathered again whole


def test_a_history_that_only_the_standard_library_reads_is_read_whole_and_kept_nowhere() -> None:
    assert shapes.loads(b'{"a": [1, 2.5]}') == ({"a": [1, 2.5]}, True)
    assert shapes.loads(b'{"a": NaN}')[1] is False
    with pytest.raises(ValueError):
        shapes.loads(b"{not json")


ITEMS = st.sampled_from([
    {"role": "user", "content": "hi"}, {"role": "user", "content": "hi "},
    {"role": "assistant", "content": "ok"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "3"},
    {"role": "tool", "tool_call_id": "call_a", "content": [{"type": "text", "text": "3"}]},
    {"role": "system", "content": "be brief"},
])


@settings(max_examples=200, deadline=None)
@given(st.lists(ITEMS, min_size=1, max_size=8), st.lists(ITEMS, min_size=1, max_size=8), st.integers(0, 8))
def test_reading_with_the_last_read_always_gives_what_reading_from_scratch_gives(
        before: list[dict[str, Any]], after: list[dict[str, Any]], kept: int) -> None:
    """Any history after any other: the one that keeps a prefix of it, or parts anywhere."""
    first = reread(chat.read, {"model": MODEL, "messages": before}, None)
    reread(chat.read, {"model": MODEL, "messages": before[:kept] + after}, first.history)


def test_through_the_door_a_sessions_second_call_gets_the_messages_read_for_its_first() -> None:
    answer = ModelAnswer(text="ok", usage=Usage(1, 1), id="a")
    sessions = ScriptedSessions({"k": [answer, answer, answer]})

    async def go() -> None:
        async with running(sessions) as door:
            async with httpx.AsyncClient(base_url=door.session_url("k") + "/v1") as client:
                for turns in (2, 3):
                    reply = await client.post("/chat/completions", json=chat_body(chat_turns(turns)))
                    assert reply.status_code == 200
                # a token count reads with what was kept, and keeps nothing of its own
                counted = await client.post("/responses/input_tokens", json={"model": MODEL, "input": "x"})
                assert counted.status_code == 200
                # NaN is JSON to the standard library alone (a field the door does not read): read whole, not kept
                history = chat_turns(4)
                history[-1]["score"] = float("nan")
                nan = await client.post("/chat/completions", content=json.dumps(chat_body(history)),
                                        headers={"Content-Type": "application/json"})
                assert nan.status_code == 200

    asyncio.run(go())
    first, second, third = sessions.calls["k"]
    assert len(second.messages) == len(first.messages) + 2
    assert all(a is b for a, b in zip(first.messages, second.messages))
    assert third.messages[:-2] == second.messages and third.messages[0] is not second.messages[0]
    kept = sessions.kept["k"]
    assert set(kept) == {"engine.agent.chat"} and kept["engine.agent.chat"].messages == second.messages


def messages_turns(n: int) -> list[dict[str, Any]]:
    """An Anthropic history of `n` tool turns."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "1+2, then +2"}]
    for k in range(n):
        history.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{k}", "name": "add", "input": {"a": 1, "b": 2}}]})
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": str(3 + 2 * k)}]})
    return history


@pytest.mark.parametrize("protocol", ["chat", "messages"])
def test_through_the_door_an_earlier_message_changed_between_calls_is_read_as_changed(protocol: str) -> None:
    """A harness that rewrites an earlier message (a tool result redacted, say) gets it read
    again: the sessions see the new text, never the one kept from the last call, and what came
    before it still the very objects read then."""
    answer = ModelAnswer(text="ok", usage=Usage(1, 1), id="a")
    sessions = ScriptedSessions({"k": [answer, answer]})
    if protocol == "chat":
        path, first, second = "/chat/completions", chat_turns(3), chat_turns(4)
        second[5]["content"] = "redacted"  # the second tool result (5)
        body = chat_body
    else:
        path, first, second = "/messages", messages_turns(3), messages_turns(4)
        second[4]["content"][0]["content"] = "redacted"  # the second tool result (5)

        def body(history: list[dict[str, Any]]) -> dict[str, Any]:
            return {"model": MODEL, "max_tokens": 8, "messages": history}

    async def go() -> None:
        async with running(sessions) as door:
            async with httpx.AsyncClient(base_url=door.session_url("k") + "/v1") as client:
                for history in (first, second):
                    reply = await client.post(path, json=body(history), headers={"x-api-key": "k"})
                    assert reply.status_code == 200, reply.text

    asyncio.run(go())
    before, after = sessions.calls["k"]
    changed = next(i for i, m in enumerate(before.messages) if m.role == "tool" and m.text() == "5")
    assert after.messages[changed].text() == "redacted" and before.messages[changed].text() == "5"
    assert all(a is b for a, b in zip(before.messages[:changed], after.messages[:changed]))
    assert len(after.messages) == len(before.messages) + 2


def test_sessions_without_notes_are_served_each_request_read_whole() -> None:
    """`notes` is optional in the sessions' protocol: without it nothing is kept between calls."""
    answer = ModelAnswer(text="ok", usage=Usage(1, 1), id="a")
    scripted = ScriptedSessions({"k": [answer, answer]})

    class Plain:  # the three methods alone
        call, count_tokens, models = scripted.call, scripted.count_tokens, scripted.models

    async def go() -> None:
        async with running(Plain()) as door:  # type: ignore[arg-type]
            async with httpx.AsyncClient(base_url=door.session_url("k") + "/v1") as client:
                for turns in (2, 3):
                    reply = await client.post("/chat/completions", json=chat_body(chat_turns(turns)))
                    assert reply.status_code == 200, reply.text

    asyncio.run(go())
    first, second = scripted.calls["k"]
    assert second.messages[:len(first.messages)] == first.messages
    assert not any(a is b for a, b in zip(first.messages, second.messages))  # read again, nothing kept
    assert scripted.kept == {}
