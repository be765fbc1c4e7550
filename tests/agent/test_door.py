"""What the door does whatever the protocol: session keys, refusals, retries, disconnects, models.

Every protocol is asked with its own SDK (`openai` for chat and responses, `anthropic` for
messages) on a real loopback socket; faults live on that socket (a proxy drops a connection
after the door answered; a client walks away mid-stream).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anthropic
import httpx
import openai
import pytest

from engine.agent.app import serve
from engine.agent.calls import CallRefused, ModelAnswer, Usage
from tests.agent.scripted import (
    MODEL,
    DroppingProxy,
    ScriptedSessions,
    anthropic_client,
    openai_client,
    running,
)

PROTOCOLS = ["chat", "responses", "messages"]
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
FIRST = ModelAnswer(text="first answer", usage=Usage(3, 2), id="one")
SECOND = ModelAnswer(text="second answer", usage=Usage(3, 2), id="two")


async def ask(protocol: str, base: str, *, api_key: str = "unused", model: str = MODEL, retries: int = 2,
              text: str = "hi") -> str:
    """One plain request through the protocol's own SDK; the answer's text."""
    if protocol == "messages":
        client = anthropic_client(base, api_key=api_key, retries=retries)
        try:
            message = await client.messages.create(model=model, max_tokens=32,
                                                   messages=[{"role": "user", "content": text}])
            return "".join(b.text for b in message.content if b.type == "text")
        finally:
            await client.close()
    openai_sdk = openai_client(base, api_key=api_key, retries=retries)
    try:
        if protocol == "chat":
            completion = await openai_sdk.chat.completions.create(model=model,
                                                                  messages=[{"role": "user", "content": text}])
            return completion.choices[0].message.content or ""
        return (await openai_sdk.responses.create(model=model, input=text)).output_text
    finally:
        await openai_sdk.close()


def _error_kind(exc: Exception) -> tuple[int, str | None]:
    """The status and the protocol's error code (OpenAI) or type (Anthropic) of an SDK error."""
    assert isinstance(exc, (openai.APIStatusError, anthropic.APIStatusError))
    body: Any = exc.body
    if isinstance(exc, anthropic.APIStatusError):
        assert body["type"] == "error"
        return exc.status_code, body["error"]["type"]
    return exc.status_code, body.get("code")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_unknown_model_the_sessions_refuse_is_a_404_in_the_protocols_shape(protocol: str) -> None:
    sessions = ScriptedSessions({"k": [FIRST]})

    async def go() -> Exception:
        async with running(sessions) as door:
            with pytest.raises((openai.NotFoundError, anthropic.NotFoundError)) as caught:
                await ask(protocol, door.session_url("k"), model="gpt-unknown")
            assert await ask(protocol, door.session_url("k")) == "first answer"  # the session goes on
            return caught.value

    error = asyncio.run(go())
    assert _error_kind(error) == (404, "not_found_error" if protocol == "messages" else "model_not_found")
    assert "gpt-unknown" in str(error) and MODEL in str(error)
    assert [c.model for c in sessions.calls["k"]] == [MODEL]  # the refused call took no turn


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_key_never_opened_is_404_by_path_and_401_by_api_key_and_an_opened_key_works_either_way(
        protocol: str) -> None:
    sessions = ScriptedSessions({"open": [FIRST, SECOND]})

    async def go() -> tuple[Exception, Exception, str, str]:
        async with running(sessions) as door:
            with pytest.raises((openai.NotFoundError, anthropic.NotFoundError)) as by_path:
                await ask(protocol, door.session_url("never"))
            with pytest.raises((openai.AuthenticationError, anthropic.AuthenticationError)) as by_key:
                await ask(protocol, door.url, api_key="never")
            return (by_path.value, by_key.value, await ask(protocol, door.session_url("open")),
                    await ask(protocol, door.url, api_key="open"))

    by_path, by_key, one, two = asyncio.run(go())
    assert _error_kind(by_path)[0] == 404 and _error_kind(by_key)[0] == 401
    if protocol == "messages":
        assert _error_kind(by_key)[1] == "authentication_error"
    assert (one, two) == ("first answer", "second answer")


def test_a_key_in_the_path_may_hold_any_character() -> None:
    key = "run 7/sample #3?"
    sessions = ScriptedSessions({key: [FIRST]})

    async def go() -> str:
        async with running(sessions) as door:
            return await ask("chat", door.session_url(key))

    assert asyncio.run(go()) == "first answer" and len(sessions.calls[key]) == 1


@pytest.mark.parametrize("path, headers, shape", [
    ("/v1/chat/completions", {}, "openai"),
    ("/v1/messages", {"anthropic-version": "2023-06-01"}, "anthropic"),
])
def test_no_key_at_all_is_401(path: str, headers: dict[str, str], shape: str) -> None:
    async def go() -> httpx.Response:
        async with running(ScriptedSessions({})) as door, httpx.AsyncClient() as http:
            return await http.post(door.url + path, json={}, headers=headers)

    response = asyncio.run(go())
    assert response.status_code == 401 and response.headers["x-should-retry"] == "false"
    body = response.json()
    assert ("no session key" in body["error"]["message"]) and (shape == "openai") == ("code" in body["error"])


BAD = [
    ("chat", {"model": MODEL}, "messages", "messages is required"),
    ("chat", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content[0].type", "input_audio"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "n must be 1"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature",
     "must be a number"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "not among the tools"),
    ("chat", {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0]", "JSON text"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "thinking"},
     "chat_template_kwargs", "must be an object"),
    ("responses", {"model": MODEL, "input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
     "whole history"),
    ("responses", {"model": MODEL, "input": [{"type": "web_search_call", "id": "w"}]}, "input[0].type",
     "web_search_call"),
    ("responses", {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "function"),
    ("responses", {"model": MODEL, "input": "x", "text": {"format": {"type": "json_object"}}}, "text.format",
     "structured output"),
    ("messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", "max_tokens is required"),
    ("messages", {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens",
     "at least 1"),
    ("messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]}, "messages[0].content[0].type", "document"),
    ("messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                  "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "custom tools"),
]


@pytest.mark.parametrize("protocol, body, param, words", BAD)
def test_a_request_the_protocol_refuses_is_a_400_naming_the_field_one_line_logged_the_session_kept(
        protocol: str, body: dict[str, Any], param: str, words: str, caplog: pytest.LogCaptureFixture) -> None:
    sessions = ScriptedSessions({"k": [FIRST]})
    headers = {"anthropic-version": "2023-06-01"} if protocol == "messages" else {}

    async def go() -> tuple[httpx.Response, str]:
        async with running(sessions) as door:
            async with httpx.AsyncClient() as http:
                refused = await http.post(door.session_url("k") + PATHS[protocol], json=body, headers=headers)
            return refused, await ask(protocol, door.session_url("k"))

    with caplog.at_level(logging.INFO, logger="engine.agent"):
        refused, after = asyncio.run(go())
    assert refused.status_code == 400 and refused.headers["x-should-retry"] == "false"
    error = refused.json()["error"]
    assert words in error["message"]
    if protocol == "messages":
        assert refused.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["param"] == param and error["type"] == "invalid_request_error"
    lines = [r for r in caplog.records if r.name == "engine.agent"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "400" in lines[0].getMessage()
    assert "/s/{key}/v1/" in lines[0].getMessage()  # the route, not the key that opens the session
    assert after == "first answer" and len(sessions.calls["k"]) == 1  # the refused request never reached it


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_body_that_is_not_json_or_over_the_limit_is_refused_in_the_protocols_shape(protocol: str) -> None:
    headers = {"anthropic-version": "2023-06-01", "content-type": "application/json"}

    async def go() -> tuple[httpx.Response, httpx.Response]:
        door = await serve(ScriptedSessions({"k": [FIRST]}), max_body=4096)
        try:
            async with httpx.AsyncClient() as http:
                url = door.session_url("k") + PATHS[protocol]
                broken = await http.post(url, content=b'{"model": ', headers=headers)
                big = await http.post(url, content=b'{"pad": "' + b"x" * 8192 + b'"}', headers=headers)
            return broken, big
        finally:
            await door.aclose()

    broken, big = asyncio.run(go())
    assert broken.status_code == 400 and "not JSON" in str(broken.json()["error"]["message"])
    assert big.status_code == 413 and "over the limit" in big.json()["error"]["message"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_valid_json_nested_past_the_parsers_stack_is_a_400_not_a_500_and_the_session_answers_after(protocol: str) -> None:
    headers = {"anthropic-version": "2023-06-01", "content-type": "application/json"}
    deep = b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    async def go() -> tuple[httpx.Response, str, ScriptedSessions]:
        sessions = ScriptedSessions({"k": [FIRST]})
        door = await serve(sessions)
        try:
            async with httpx.AsyncClient() as http:
                refused = await http.post(door.session_url("k") + PATHS[protocol], content=deep, headers=headers)
            return refused, await ask(protocol, door.session_url("k")), sessions
        finally:
            await door.aclose()

    refused, after, sessions = asyncio.run(go())
    assert refused.status_code == 400, refused.text  # before: aiohttp's 500 text, which the SDKs retry
    assert refused.headers["x-should-retry"] == "false" and "nested too deep" in refused.json()["error"]["message"]
    assert after == "first answer" and len(sessions.calls["k"]) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("refusal, status", [
    (CallRefused("invalid_request", "images are not supported by this model's template"), 400),
    (CallRefused("over_budget", "the context has 12 tokens left"), 400),
    (CallRefused("closed", "the session has ended"), 409),
])
def test_a_sessions_refusal_reaches_the_harness_once_unretried_and_the_session_answers_after(
        protocol: str, refusal: CallRefused, status: int) -> None:
    sessions = ScriptedSessions({"k": [refusal, FIRST]})

    async def go() -> tuple[Exception, str]:
        async with running(sessions) as door:
            with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
                await ask(protocol, door.session_url("k"), retries=2)
            return caught.value, await ask(protocol, door.session_url("k"))

    error, after = asyncio.run(go())
    code, kind = _error_kind(error)
    assert code == status and refusal.message in str(error)
    if refusal.kind == "over_budget":
        # the words each family's harnesses react to (compaction)
        assert ("prompt is too long" in str(error)) if protocol == "messages" else (kind == "context_length_exceeded")
    assert len(sessions.calls["k"]) == 2 and after == "first answer"  # no retry of the refused request


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_after_a_5xx_the_sdks_retry_is_marked_as_a_retry_of_the_same_body(protocol: str) -> None:
    sessions = ScriptedSessions({"k": [RuntimeError("the session broke"), FIRST]})

    async def go() -> str:
        async with running(sessions) as door:
            return await ask(protocol, door.session_url("k"))

    assert asyncio.run(go()) == "first answer"
    first, retry = sessions.calls["k"]
    assert first.retry_of is None and retry.retry_of == first.digest == retry.digest


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_answer_lost_with_its_connection_is_given_again_to_the_sdks_retry_never_a_second_turn(
        protocol: str) -> None:
    sessions = ScriptedSessions({"k": [FIRST, SECOND]})

    async def go() -> tuple[str, str, int]:
        async with running(sessions) as door, DroppingProxy(door.url, drops=1) as proxy:
            base = proxy.url + door.session_url("k")[len(door.url):]
            lost = await ask(protocol, base)
            return lost, await ask(protocol, base, text="again"), proxy.connections

    lost, next_turn, connections = asyncio.run(go())
    assert connections >= 2 and lost == "first answer"  # the SDK's retry got the answer the dropped one carried
    first, retry, after = sessions.calls["k"]
    assert retry.retry_of == first.digest and after.retry_of is None
    assert next_turn == "second answer"  # the retry took no turn of the script


def test_a_client_that_leaves_mid_stream_breaks_nothing(caplog: pytest.LogCaptureFixture) -> None:
    huge = ModelAnswer(text="x" * 8_000_000, usage=Usage(1, 1))  # far more than the socket buffers hold
    sessions = ScriptedSessions({"k": [huge, FIRST]})
    request = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True}

    async def go() -> str:
        async with running(sessions) as door:
            url = door.session_url("k") + "/v1/chat/completions"
            async with httpx.AsyncClient() as http, http.stream("POST", url, json=request) as got:
                async for _ in got.aiter_bytes():
                    break  # walk away after the first bytes
            await asyncio.sleep(0.5)
            return await ask("chat", door.session_url("k"))

    with caplog.at_level(logging.INFO, logger="engine.agent"):
        assert asyncio.run(go()) == "first answer"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("left mid-stream" in r.getMessage() for r in caplog.records)


def test_a_client_that_hangs_up_while_the_session_works_does_not_cancel_the_turn() -> None:
    sessions = ScriptedSessions({"k": [FIRST, SECOND]})
    request = {"model": MODEL, "messages": [{"role": "user", "content": "go"}]}

    async def go() -> str:
        sessions.gate = asyncio.Event()
        async with running(sessions) as door:
            url = door.session_url("k") + "/v1/chat/completions"
            async with httpx.AsyncClient() as http:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(url, json=request, timeout=0.3)
            assert sessions.finished == 0
            sessions.gate.set()
            for _ in range(100):
                if sessions.finished:
                    break
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient() as http:
                again = await http.post(url, json=request, headers={"x-stainless-retry-count": "1"})
            return again.json()["choices"][0]["message"]["content"]

    assert asyncio.run(go()) == "first answer"  # the retry found the answer of the turn taken meanwhile
    assert sessions.finished == 2 and sessions.script["k"] == [SECOND]


def test_models_are_listed_in_the_shape_of_the_sdk_that_asks() -> None:
    sessions = ScriptedSessions({"k": []}, served=[MODEL, "second-model"])

    async def go() -> tuple[list[str], list[tuple[str, str]], str, Exception]:
        async with running(sessions) as door:
            oa = openai_client(door.session_url("k"))
            an = anthropic_client(door.session_url("k"))
            listed = [m.id async for m in oa.models.list()]
            cards = [(m.id, m.display_name) async for m in an.models.list()]
            one = (await oa.models.retrieve("second-model")).id
            with pytest.raises(openai.NotFoundError) as missing:
                await oa.models.retrieve("gpt-unknown")
            await oa.close()
            await an.close()
            return listed, cards, one, missing.value

    listed, cards, one, missing = asyncio.run(go())
    assert listed == [MODEL, "second-model"] and cards == [(MODEL, MODEL), ("second-model", "second-model")]
    assert one == "second-model" and _error_kind(missing) == (404, "model_not_found")


def test_an_unknown_path_is_a_404_in_json() -> None:
    async def go() -> httpx.Response:
        async with running(ScriptedSessions({})) as door, httpx.AsyncClient() as http:
            return await http.post(door.url + "/v1/completions", json={})

    response = asyncio.run(go())
    assert response.status_code == 404 and "POST /v1/completions" in response.json()["error"]["message"]


def test_the_door_listens_on_loopback_and_stops_listening_when_closed() -> None:
    async def go() -> tuple[str, Exception]:
        door = await serve(ScriptedSessions({}))
        url = door.url
        await door.aclose()
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError) as refused:
                await http.get(url + "/v1/models")
        return url, refused.value

    url, _ = asyncio.run(go())
    assert url.startswith("http://127.0.0.1:")
