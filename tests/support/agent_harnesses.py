"""Harnesses `engine_agent` names in the tests: coroutines over the OpenAI SDK, and ones that fail.

Each takes `(base_url, api_key, sample)` as the adapter calls it and runs the add task of
tests.support.agents with an unmodified `openai` client whose base URL is the session's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai

from tests.support.agents import SYSTEM, TOOLS


def client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)


async def add_task(base_url: str, api_key: str, sample: Any, *, compact_after: int | None = None) -> float:
    """The add task: call the model, run `add` for each call, until it answers; reward 1.0."""
    async with client(base_url, api_key) as api:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sample.prompt}]
        for step in range(10):
            reply = await api.chat.completions.create(model="policy", messages=messages, tools=list(TOOLS))  # type: ignore[arg-type]
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return 1.0
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
            if compact_after is not None and step == compact_after:
                messages = [messages[0], {"role": "user", "content": "Summary so far: 1 and 5. Go on adding."}]
    return 0.0


async def compacting(base_url: str, api_key: str, sample: Any) -> float:
    """The add task, its history compacted after the second turn."""
    return await add_task(base_url, api_key, sample, compact_after=1)


async def crashing(base_url: str, api_key: str, sample: Any) -> None:
    """One model call, then the harness fails."""
    async with client(base_url, api_key) as api:
        await api.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Add."}], tools=list(TOOLS))  # type: ignore[arg-type]
    raise RuntimeError("the harness broke")


async def hanging(base_url: str, api_key: str, sample: Any) -> None:
    """One model call, then nothing until it is stopped."""
    async with client(base_url, api_key) as api:
        await api.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Add."}], tools=list(TOOLS))  # type: ignore[arg-type]
    await asyncio.sleep(3600)


async def silent(base_url: str, api_key: str, sample: Any) -> str:
    """Never calls the model."""
    return "nothing to do"
