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


async def add_task(base_url: str, api_key: str, sample: Any, *, compact_after: int | None = None,
                   keep_reasoning: bool = True) -> float:
    """The add task: call the model, run `add` for each call, until it answers; reward 1.0."""
    async with client(base_url, api_key) as api:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sample.prompt}]
        for step in range(10):
            reply = await api.chat.completions.create(model="policy", messages=messages, tools=list(TOOLS))  # type: ignore[arg-type]
            message = reply.choices[0].message
            sent_back = message.model_dump(exclude_none=True)
            if not keep_reasoning:
                sent_back.pop("reasoning_content", None)
            messages.append(sent_back)
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


# -- the demo's 5-turn task (engine/local/demo/replay-agent.jsonl), one harness per protocol --------

TASK = "Add 1+2, 3+4, 10+20 and 100+5, one call at a time."
ADD_PARAMETERS = TOOLS[0]["function"]["parameters"]


def _add(arguments: Any) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return str(int(args["a"]) + int(args["b"]))


async def chat_task(base_url: str, api_key: str, sample: Any, *, stream: bool = False) -> str:
    """OpenAI Chat Completions, its tool loop as the SDK's docs write it."""
    async with client(base_url, api_key) as api:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        for _ in range(8):
            if stream:
                async with api.chat.completions.stream(model="policy", messages=messages, tools=list(TOOLS)) as events:  # type: ignore[arg-type]
                    message = (await events.get_final_completion()).choices[0].message
            else:
                message = (await api.chat.completions.create(model="policy", messages=messages, tools=list(TOOLS))).choices[0].message  # type: ignore[arg-type]
            messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
            if not message.tool_calls:
                return message.content or ""
            messages += [{"role": "tool", "tool_call_id": c.id, "content": _add(c.function.arguments)} for c in message.tool_calls]
    return ""


async def chat_stream_task(base_url: str, api_key: str, sample: Any) -> str:
    return await chat_task(base_url, api_key, sample, stream=True)


async def responses_task(base_url: str, api_key: str, sample: Any, *, stream: bool = False) -> str:
    """OpenAI Responses: the output items go back as input, with each call's output."""
    tools = [{"type": "function", "name": "add", "description": "Add two integers.", "parameters": ADD_PARAMETERS}]
    async with client(base_url, api_key) as api:
        items: list[Any] = [{"role": "user", "content": TASK}]
        for _ in range(8):
            if stream:
                async with api.responses.stream(model="policy", instructions=SYSTEM, input=items, tools=tools) as events:  # type: ignore[arg-type]
                    response = await events.get_final_response()
            else:
                response = await api.responses.create(model="policy", instructions=SYSTEM, input=items, tools=tools)  # type: ignore[arg-type]
            items += [item.model_dump(exclude_none=True) for item in response.output]
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return response.output_text
            items += [{"type": "function_call_output", "call_id": c.call_id, "output": _add(c.arguments)} for c in calls]
    return ""


async def responses_stream_task(base_url: str, api_key: str, sample: Any) -> str:
    return await responses_task(base_url, api_key, sample, stream=True)


async def messages_task(base_url: str, api_key: str, sample: Any, *, stream: bool = False) -> str:
    """Anthropic Messages: the content blocks go back as the assistant's, results as a user's tool_result blocks."""
    import anthropic

    tools = [{"name": "add", "description": "Add two integers.", "input_schema": ADD_PARAMETERS}]
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0) as api:
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        for _ in range(8):
            if stream:
                async with api.messages.stream(model="policy", max_tokens=256, system=SYSTEM, messages=messages,  # type: ignore[arg-type]
                                               tools=tools) as events:  # type: ignore[arg-type]
                    message = await events.get_final_message()
            else:
                message = await api.messages.create(model="policy", max_tokens=256, system=SYSTEM, messages=messages,  # type: ignore[arg-type]
                                                    tools=tools)  # type: ignore[arg-type]
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
            uses = [b for b in message.content if b.type == "tool_use"]
            if not uses:
                return "".join(b.text for b in message.content if b.type == "text")
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": _add(b.input)}
                                                         for b in uses]})
    return ""


async def messages_stream_task(base_url: str, api_key: str, sample: Any) -> str:
    return await messages_task(base_url, api_key, sample, stream=True)


async def agents_sdk_task(base_url: str, api_key: str, sample: Any) -> str:
    """The OpenAI Agents SDK runs the task with its own loop and a function tool (Responses, streamed)."""
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    api = client(base_url, api_key)
    try:
        agent = Agent(name="adder", instructions=SYSTEM, tools=[add], model=OpenAIResponsesModel(model="policy", openai_client=api))
        run = Runner.run_streamed(agent, TASK, run_config=RunConfig(tracing_disabled=True), max_turns=8)
        async for _ in run.stream_events():
            pass
        return str(run.final_output)
    finally:
        await api.close()


async def messages_tool_runner_task(base_url: str, api_key: str, sample: Any) -> str:
    """Anthropic's beta tool runner drives the loop; it asks for a server-held thread, which the door refuses."""
    import anthropic
    from anthropic import beta_async_tool

    @beta_async_tool
    async def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    async with anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0) as api:
        runner = api.beta.messages.tool_runner(model="policy", max_tokens=256, system=SYSTEM, tools=[add],
                                               messages=[{"role": "user", "content": TASK}])
        texts = [b.text async for message in runner for b in message.content if b.type == "text"]
        return texts[-1] if texts else ""


async def agents_sdk_chat_task(base_url: str, api_key: str, sample: Any) -> str:
    """The Agents SDK over Chat Completions, not streamed: two tools, one raising on its third call
    (the SDK sends its error text as the result), a tool required on the first turn."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        if a == 2:
            raise ValueError("the adder is out of order")
        return a + b

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    api = client(base_url, api_key)
    try:
        agent = Agent(name="adder", instructions=SYSTEM, tools=[add, multiply],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=api),
                      model_settings=ModelSettings(tool_choice="required"))
        result = await Runner.run(agent, TASK, run_config=RunConfig(tracing_disabled=True), max_turns=8)
        return str(result.final_output)
    finally:
        await api.close()


async def forgetful(base_url: str, api_key: str, sample: Any) -> float:
    """The add task by a harness that sends its history back without the model's reasoning."""
    return await add_task(base_url, api_key, sample, keep_reasoning=False)
