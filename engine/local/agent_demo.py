"""The demo's agent: a small harness that adds numbers with its own `add` tool, over the OpenAI SDK.

`python -m engine agent` runs it per prompt when no command is given. Like any harness it
knows nothing of the engine: it reads its endpoint and key from `OPENAI_BASE_URL` and
`OPENAI_API_KEY` and its task from `ENGINE_AGENT_PROMPT`, calls the model, runs the tool calls
it gets, sends the results back, and stops at the first answer without a call (printing it).
The embedded server's demo replay (`engine/local/demo/replay-agent.jsonl`) teaches the model the task.
Needs the `agent` extra (the openai SDK).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
SYSTEM = "You add numbers with the add tool, one call at a time, then say the sums."
MAX_CALLS = 16


def run_tool(name: str, arguments: str) -> str:
    """The harness's own tool: `add`, or an error the model reads."""
    try:
        args = json.loads(arguments)
        if name == "add":
            return str(int(args["a"]) + int(args["b"]))
        return f"error: no tool named {name}"
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {type(exc).__name__}: {exc}"


def main() -> int:
    import openai

    client = openai.OpenAI(max_retries=2)  # OPENAI_BASE_URL and OPENAI_API_KEY name the session
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": os.environ["ENGINE_AGENT_PROMPT"]}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=256)  # type: ignore[arg-type]
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content)
            return 0
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    print("gave up: too many tool calls", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
