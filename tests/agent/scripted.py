"""A scripted stand-in for the sessions behind the front door, the SDK clients on it, a proxy that drops connections.

`ScriptedSessions` records every `ModelCall` it receives and answers each session's calls from
a script; it answers an SDK retry (`retry_of`) with the answer already given to that body, as
the real sessions must, so a test sees whether a retry took a second turn. `DroppingProxy`
forwards loopback connections to the door and drops the first ones after the door answered:
the answer is lost on the wire, as when a connection dies between server and client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Self

import anthropic
import attrs
import httpx
import openai

from engine.agent.app import FrontDoor, serve
from engine.agent.calls import CallMade, CallRefused, ModelAnswer, ModelCall, Usage

MODEL = "scripted-model"
Step = ModelAnswer | CallRefused | Exception

# Answers the protocol tests share: a turn with reasoning, text and two calls (usage with cached
# tokens), and a long one whose every part streams as several deltas.
TWO_CALLS = (CallMade("c0", "get_weather", '{"city": "Paris"}'), CallMade("c1", "get_weather", '{"city": "Rome"}'))
CALLING = ModelAnswer(text="Let me look.", reasoning="I need the weather", finish="tool_calls",
                      usage=Usage(30, 9, 10), id="m1", calls=TWO_CALLS)
LONG = ModelAnswer(text="chunk " * 40, reasoning="think " * 30, finish="tool_calls", usage=Usage(20, 99), id="s1",
                   calls=(CallMade("c0", "get_weather", '{"city": "' + "Paris" * 30 + '"}'),))


@attrs.define(eq=False)
class ScriptedSessions:
    """Sessions answering from a script: `script[key]` is the steps of the session `key`, in order."""

    script: dict[str, list[Step]]
    served: list[str] = attrs.Factory(lambda: [MODEL])
    calls: dict[str, list[ModelCall]] = attrs.Factory(dict)
    counted: list[ModelCall] = attrs.Factory(list)
    answered: dict[str, ModelAnswer] = attrs.Factory(dict)  # by the body's digest
    gate: asyncio.Event | None = None  # when set, each call waits for it before answering
    finished: int = 0  # calls that ran to their answer (a cancelled one does not count)
    kept: dict[str, dict[str, Any]] = attrs.Factory(dict)  # the door's notes, by session key

    def _refusal(self, key: str, call: ModelCall) -> CallRefused | None:
        """What the sessions refuse before a turn: a key never opened, a model not served."""
        if key not in self.script:
            return CallRefused("unauthorized", f"no session {key!r} was opened")
        if call.model not in self.served:
            return CallRefused("not_found", f"the model {call.model!r} is not served here: {', '.join(self.served)}")
        return None

    async def call(self, key: str, call: ModelCall) -> ModelAnswer | CallRefused:
        if refused := self._refusal(key, call):
            return refused
        self.calls.setdefault(key, []).append(call)
        if self.gate is not None:
            await self.gate.wait()
        self.finished += 1
        if call.retry_of is not None and call.retry_of in self.answered:
            return self.answered[call.retry_of]
        if not self.script[key]:
            return CallRefused("closed", "the script is over")
        step = self.script[key].pop(0)
        if isinstance(step, Exception):
            raise step
        if isinstance(step, ModelAnswer):
            self.answered[call.digest] = step
        return step

    async def count_tokens(self, key: str, call: ModelCall) -> int | CallRefused:
        if refused := self._refusal(key, call):
            return refused
        self.counted.append(call)
        return sum(len(m.text().split()) for m in call.messages)  # words: a count the test can predict

    def models(self) -> list[str]:
        return list(self.served)

    def notes(self, key: str) -> dict[str, Any] | None:
        return self.kept.setdefault(key, {}) if key in self.script else None


@attrs.define(eq=False)
class DroppingProxy:
    """A loopback proxy to `target` that drops its first `drops` connections once the door has answered."""

    target: str
    drops: int = 1
    connections: int = 0
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        url = httpx.URL(self.target)
        up_reader, up_writer = await asyncio.open_connection(url.host, url.port)
        self.connections += 1
        try:
            if self.connections <= self.drops:
                await _pass_one(reader, up_writer)
                await _pass_one(up_reader, None)  # the door answers in full; the client gets nothing
                writer.transport.abort()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()


async def _pass_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None) -> None:
    """One HTTP message with a Content-Length, read whole and written on (or swallowed)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length)
    if writer is not None:
        writer.write(head + body)
        await writer.drain()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def sse_events(raw: str) -> Iterator[tuple[str | None, Any]]:
    """The (event name, data) pairs of a server-sent event stream; `[DONE]` as the string."""
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        payload = "\n".join(data)
        yield name, payload if payload == "[DONE]" else json.loads(payload)


@contextlib.asynccontextmanager
async def running(sessions: ScriptedSessions) -> AsyncIterator[FrontDoor]:
    """The front door over `sessions`, on loopback, for the block's duration."""
    door = await serve(sessions)
    try:
        yield door
    finally:
        await door.aclose()


def openai_client(base: str, *, api_key: str = "unused", retries: int = 2) -> openai.AsyncOpenAI:
    """The OpenAI SDK on a session's base URL (or the door's `/v1` with the key as API key)."""
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=retries)


def anthropic_client(base: str, *, api_key: str = "unused", retries: int = 2) -> anthropic.AsyncAnthropic:
    """The Anthropic SDK on a session's base URL."""
    return anthropic.AsyncAnthropic(base_url=base, api_key=api_key, max_retries=retries)
