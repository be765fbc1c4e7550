"""Scripted agents for the sessions' tests: a model that answers each session from a script, and a
harness that runs a tool task through `Sessions.call` (as the door would hand it its calls).

The model writes each family's own call format (with reasoning where the template asks for it)
and records every reply it sent, so a test can hold every trained token and logprob against it.
The harness replays its history verbatim, or changes it the ways harnesses do (drops reasoning,
compacts, forks a sub-agent, rewrites a call, sends a result for a call never made).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from typing import Any

import httpx

from engine.agent.calls import CallMade, Message, ModelAnswer, ModelCall
from engine.profiles.chat import ChatProfile

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                        "b": {"type": "integer"}},
                                                       "required": ["a", "b"]}}}
TOOLS = (ADD,)
SYSTEM = "You add numbers with the add tool, one step at a time."


def call_text(parser: str, a: int, b: int) -> str:
    """A call of `add(a, b)` as the family writes it."""
    if parser in ("glm47", "glm45"):
        return f"<tool_call>add<arg_key>a</arg_key><arg_value>{a}</arg_value><arg_key>b</arg_key><arg_value>{b}</arg_value></tool_call>"
    if parser == "deepseekv31":
        return f'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{{"a": {a}, "b": {b}}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def turn_text(parser: str, reasoning: str, content: str) -> str:
    """A turn with reasoning as the family's generation prompt leaves it to write (DeepSeek-V3.1's
    non-thinking prompt closes `<think>` itself; GLM's opens it)."""
    if parser == "deepseekv31":
        return content
    if parser in ("glm47", "glm45"):
        return f"{reasoning}</think>{content}"
    return f"<think>\n{reasoning}\n</think>\n\n{content}"


class ScriptedModel:
    """A `/generate` side effect: each session (by routing key) gets the turns of its task:
    `steps` calls of `add`, then the answer; every reply is recorded with its logprobs."""

    def __init__(self, profile: ChatProfile, steps: int = 3, seed: int = 0) -> None:
        self.profile = profile
        self.steps = steps
        self.rng = random.Random(seed)
        self.turns: dict[str, int] = defaultdict(int)
        self.replies: dict[str, list[tuple[list[int], list[float]]]] = defaultdict(list)
        self.requests: dict[str, list[list[int]]] = defaultdict(list)

    def text(self, n: int) -> tuple[str, int]:
        parser = self.profile.tool_parser
        if n < self.steps:
            body = turn_text(parser, f"Step {n}: add {n} and {n + 1}.", f"Adding {n}.{call_text(parser, n, n + 1)}")
            return body, self.profile.closer_id if self.profile.closer_id is not None else self.profile.eos_id
        return turn_text(parser, "All done.", f"The sum is {sum(range(2 * self.steps))}."), self.profile.eos_id

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        key = request.headers.get("X-SMG-Routing-Key", "")
        n = self.turns[key]
        self.turns[key] += 1
        self.requests[key].append(body["input_ids"])
        text, end = self.text(n)
        ids = self.profile.codec.encode(text) + [end]
        cap = body["sampling_params"].get("max_new_tokens")
        finish: dict[str, Any] = {"type": "stop", "matched": end}
        if cap is not None and len(ids) > cap:
            ids, finish = ids[:cap], {"type": "length", "length": cap}
        logprobs = [-self.rng.randrange(1, 4096) / 256 for _ in ids]  # exact in float32
        self.replies[key].append((ids, logprobs))
        meta = {"id": f"{key}-{n}", "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": "w0", "e2e_latency": 0.0,
                "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids)]}
        return httpx.Response(200, json={"text": self.profile.decode(ids), "output_ids": ids, "meta_info": meta})


def as_message(answer: ModelAnswer, *, reasoning: bool = True) -> Message:
    """The harness's copy of an answer, as an SDK hands it back."""
    return Message("assistant", answer.text, reasoning=answer.reasoning if reasoning else None, calls=answer.calls)


async def tool_task(sessions: Any, key: str, *, variant: str = "verbatim", max_tokens: int | None = None) -> list[Any]:
    """Run the add task through `sessions` under `key`; returns every answer (or refusal) it got.

    `variant`: "verbatim" (history as sent back by an SDK), "drop_reasoning" (no reasoning echoed),
    "compact" (after the second turn the history becomes the system prompt and a summary),
    "fork" (after the first turn a sub-agent call with its own system prompt, then the main
    history again), "rewrite" (the first call's arguments changed in the history; "rewrite_deep":
    to JSON nested deeper than the parser's stack), "contradict" (a result for a call never made).
    """
    history = [Message("system", SYSTEM), Message("user", "Add the numbers 0 to 5 with the tool.")]
    got: list[Any] = []
    sampling = {"max_new_tokens": max_tokens} if max_tokens else {}
    for step in range(10):
        answer = await sessions.call(key, ModelCall(tuple(history), TOOLS, sampling))
        got.append(answer)
        if not isinstance(answer, ModelAnswer) or not answer.calls:
            return got
        history.append(as_message(answer, reasoning=variant != "drop_reasoning"))
        for call in answer.calls:
            args = json.loads(call.arguments)
            result_id = "never-made" if variant == "contradict" and step == 1 else call.id
            history.append(Message("tool", str(args["a"] + args["b"]), call_id=result_id))
        if variant == "compact" and step == 1:
            history = [history[0], Message("user", "Summary so far: the steps gave 1 and 5. Go on adding.")]
        if variant in ("rewrite", "rewrite_deep") and step == 1:
            first = history[2]
            rewritten = '{"a": 100, "b": 1}' if variant == "rewrite" else '{"a":' * 1500 + "1" + "}" * 1500
            history[2] = Message("assistant", first.content, reasoning=first.reasoning,
                                 calls=tuple(CallMade(c.id, c.name, rewritten) for c in first.calls))
        if variant == "fork" and step == 0:
            sub = await sessions.call(key, ModelCall((Message("system", "You are a sub-agent."),
                                                      Message("user", "Check: add 0 and 1.")), TOOLS, sampling))
            got.append(sub)
    return got
