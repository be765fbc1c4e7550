"""No request, however malformed, gets past a protocol module as anything but a call or a BadRequest.

Each protocol's full request (every kind of message, part, item and block it accepts) has each of
its fields, at every depth, replaced in turn by values of every JSON type; the module reads the
result or refuses it naming a field, never raises anything else (which the door would answer
with a 500 and a traceback). A sample of them goes through the door to check the 400s.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.agent import chat, messages, responses
from engine.agent.shapes import BadRequest
from tests.agent.scripted import ScriptedSessions, running

JUNK: list[Any] = [None, 0, 1.5, -1, True, "", "x", [], {}, [1], [None], [{}], {"a": 1}, {"type": None},
                   {"type": "text"}, {"type": "image"}, {"type": "function"}, {"type": "tool_result"}]
FULL: dict[str, dict[str, Any]] = {
    "chat": {"model": "m", "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": 5, "stop": ["a"], "temperature": 0.5},
    "responses": {"model": "m", "instructions": "i", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "t"}, {"type": "input_image", "image_url": "u"}]},
        {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "s"}],
         "content": [{"type": "reasoning_text", "text": "c"}], "encrypted_content": "fsm-reasoning:x"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "o"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"}],
        "tools": [{"type": "function", "name": "f", "parameters": {}}], "tool_choice": {"type": "function", "name": "f"},
        "include": ["reasoning.encrypted_content"], "text": {"format": {"type": "text"}}, "max_output_tokens": 9},
    "messages": {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s"}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "x"}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "th", "signature": "s"},
                                          {"type": "text", "text": "a"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "r"}]}]}],
        "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "f"},
        "stop_sequences": ["x"], "top_k": 3},
}
MODULES = {"chat": chat, "responses": responses, "messages": messages}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def _places(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _places(inner, (*at, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from _places(inner, (*at, index))


def variants(protocol: str) -> Iterator[tuple[tuple[Any, ...], Any, Any]]:
    """(where, what, body): the full request with the value at `where` replaced by `what`."""
    for where in _places(FULL[protocol]):
        for what in JUNK:
            body = copy.deepcopy(FULL[protocol])
            if not where:
                yield where, what, copy.deepcopy(what)
                continue
            parent = body
            for step in where[:-1]:
                parent = parent[step]
            parent[where[-1]] = copy.deepcopy(what)
            yield where, what, body


@pytest.mark.parametrize("protocol", list(FULL))
def test_every_field_replaced_by_any_json_is_read_or_refused_never_a_crash(protocol: str) -> None:
    read = MODULES[protocol].read
    read(copy.deepcopy(FULL[protocol]))  # the full request itself is accepted
    crashed, refused = [], 0
    for where, what, body in variants(protocol):
        try:
            read(body)
        except BadRequest as exc:
            refused += 1
            assert exc.problem.status == 400 and exc.problem.message
        except Exception as exc:  # noqa: BLE001 - what the test looks for
            crashed.append((where, what, repr(exc)))
    assert crashed == []
    assert refused > 50  # the variants are not all harmless: many are refused


@pytest.mark.parametrize("protocol", list(FULL))
def test_through_the_door_malformed_requests_are_400s_and_the_door_goes_on(protocol: str) -> None:
    sample = [body for i, (_, _, body) in enumerate(variants(protocol)) if i % 23 == 0]
    headers = {"anthropic-version": "2023-06-01"} if protocol == "messages" else {}

    async def go() -> list[int]:
        async with running(ScriptedSessions({"k": []}, served=["m"])) as door, httpx.AsyncClient() as http:
            statuses = []
            for body in sample:
                got = await http.post(door.session_url("k") + PATHS[protocol], json=body, headers=headers)
                assert got.headers["content-type"].startswith("application/json")
                statuses.append(got.status_code)
            return statuses

    statuses = asyncio.run(go())
    # 400: refused by the door; read and handed on: 404 (a model replaced: not served), 409 (the
    # empty script's session is over). Never a 500.
    assert set(statuses) <= {400, 404, 409} and 400 in statuses
