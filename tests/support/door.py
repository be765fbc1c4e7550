"""A minimal stand-in for the agent front door: OpenAI chat completions, not streamed, on loopback.

Enough of the protocol for the sessions' tests to run a harness over a real socket: a request
becomes a `ModelCall` (messages, tools, `max_tokens`), the answer a chat completion, a refusal
OpenAI's error shape. The session is named by the path (`/s/{key}/v1/...`) or the bearer key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aiohttp import web

from engine.agent.calls import CallMade, CallRefused, Message, ModelCall, Sessions


def _call(body: dict[str, Any], retry: bool) -> ModelCall:
    messages = []
    for m in body["messages"]:
        calls = tuple(CallMade(c["id"].removeprefix("call_"), c["function"]["name"], c["function"]["arguments"])
                      for c in m.get("tool_calls") or ())
        call_id = m.get("tool_call_id")
        messages.append(Message(m["role"], m.get("content") or "", reasoning=m.get("reasoning_content"), calls=calls,
                                call_id=call_id.removeprefix("call_") if call_id else None))
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    sampling = {"max_new_tokens": body["max_tokens"]} if body.get("max_tokens") else {}
    return ModelCall(tuple(messages), tuple(body.get("tools") or ()), sampling, model=body.get("model", ""),
                     digest=digest, retry_of=digest if retry else None)


class StandInDoor:
    """`serve(sessions)`'s stand-in: `.url`, `.session_url(key)`, `await .aclose()`."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> StandInDoor:
        app = web.Application()
        app.router.add_post("/s/{key}/v1/chat/completions", self.chat)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def session_url(self, key: str) -> str:
        return f"{self.url}/s/{key}"

    async def aclose(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def chat(self, request: web.Request) -> web.Response:
        key = request.match_info.get("key") or request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        body = await request.json()
        retry = int(request.headers.get("x-stainless-retry-count", "0") or 0) > 0
        answer = await self.sessions.call(key, _call(body, retry))
        if isinstance(answer, CallRefused):
            return web.json_response({"error": {"type": answer.kind, "message": answer.message}}, status=answer.status)
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.reasoning is not None:
            message["reasoning_content"] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = [{"id": "call_" + c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in answer.calls]
        return web.json_response({
            "id": "chatcmpl-" + answer.id, "object": "chat.completion", "created": 0, "model": body.get("model", ""),
            "choices": [{"index": 0, "message": message, "finish_reason": answer.finish}],
            "usage": {"prompt_tokens": answer.usage.prompt_tokens, "completion_tokens": answer.usage.completion_tokens,
                      "total_tokens": answer.usage.prompt_tokens + answer.usage.completion_tokens}})


async def serve(sessions: Sessions, host: str = "127.0.0.1", port: int = 0) -> StandInDoor:
    return await StandInDoor(sessions).start()
