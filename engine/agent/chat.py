"""OpenAI Chat Completions (`POST /v1/chat/completions`): requests to calls, answers to completions and chunks.

Accepted: system / developer, user (text and `image_url` parts), assistant (text, `tool_calls`,
`reasoning_content`) and tool messages; function tools; `tool_choice`; `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `stop`, the penalties, `seed` (and SGLang's
`top_k`, `min_p`, `repetition_penalty`); `stream` with `stream_options.include_usage`;
`chat_template_kwargs` (SGLang's and vLLM's), when they render the prompt as the job's
`apply_chat_template_kwargs` do (the session refuses others: 400).
Refused (400): audio and file parts, the deprecated `functions` / `function_call`, custom tools,
`n` other than 1, `logprobs`, a `response_format` other than text. The OpenAI error shape is
here too; the Responses module answers errors and `/v1/models` the same way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from engine.agent import shapes
from engine.agent.calls import CallMade, Message, ModelAnswer, ModelCall, Part
from engine.agent.shapes import Asked, BadRequest, Problem

CALL_PREFIX = "call_"
ROLES = ("system", "developer", "user", "assistant", "tool")
SAMPLING = {
    "max_completion_tokens": "max_new_tokens", "max_tokens": "max_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "seed": "sampling_seed",
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                409: "invalid_request_error", 413: "invalid_request_error", 500: "server_error"}
# a session's "not_found" is a model it does not serve (an unknown session key is "unauthorized")
_ERROR_CODES = {"unauthorized": "invalid_api_key", "not_found": "model_not_found",
                "over_budget": "context_length_exceeded", "closed": "session_closed", "too_large": "request_too_large"}


# ---- requests -----------------------------------------------------------------------------

def read(body: Any, last: shapes.History | None = None) -> Asked:
    """A chat completion request as a call, or BadRequest naming the field; `last`: the session's
    previous request's history as read, whose repeated messages are not read again."""
    body = shapes.obj(body, "")
    model = shapes.text(body, "model", "", required=True)
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise BadRequest(f"{key} is deprecated and not served: use tools and tool_choice", key)
    if body.get("n") not in (None, 1):
        raise BadRequest("n must be 1: each request is one turn of the session", "n")
    if body.get("logprobs"):
        raise BadRequest("logprobs are not returned by this server", "logprobs")
    response_format = body.get("response_format")
    if response_format is not None and shapes.obj(response_format, "response_format").get("type") != "text":
        raise BadRequest("response_format other than text is not served: structured output is not enforced",
                         "response_format")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(shapes.array(body, "tools", "")))
    given = shapes.array(body, "messages", "", required=True)
    if not given:
        raise BadRequest("messages must hold at least one message", "messages")
    messages, history = shapes.read_items(given, last, _messages)
    call = ModelCall(
        messages=tuple(messages),
        tools=tools,
        sampling=shapes.sampling(body, SAMPLING),
        protocol="chat",
        model=model or "",
        tool_choice=shapes.openai_tool_choice(body.get("tool_choice"), tools, nested=True),
        template_kwargs=None if body.get("chat_template_kwargs") is None else dict(
            shapes.obj(body["chat_template_kwargs"], "chat_template_kwargs")),
    )
    stream = shapes.flag(body, "stream", "")
    options = body.get("stream_options")
    include_usage = stream and options is not None and shapes.flag(
        shapes.obj(options, "stream_options"), "include_usage", "stream_options")
    return Asked(call=call, stream=stream, usage_in_stream=include_usage, history=history)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    tool = shapes.obj(tool, where)
    if tool.get("type") != "function":
        raise BadRequest(f"{where}.type must be function: only function tools are served", f"{where}.type")
    function = shapes.obj(tool.get("function"), f"{where}.function")
    return shapes.function_tool(function.get("name"), function.get("description"), function.get("parameters"),
                                f"{where}.function")


def _messages(items: list[Any], start: int, messages: list[Message], marks: list[int]) -> None:
    for i in range(start, len(items)):
        messages.append(_message(items[i], f"messages[{i}]"))
        marks.append(len(messages))


def _message(message: Any, where: str) -> Message:
    message = shapes.obj(message, where)
    role = shapes.one_of(message.get("role"), ROLES, f"{where}.role")
    name = shapes.text(message, "name", where)
    if role == "tool":
        call_id = shapes.text(message, "tool_call_id", where, required=True) or ""
        return Message(role="tool", content=_content(message.get("content"), f"{where}.content", images=False),
                       call_id=shapes.session_id(call_id, CALL_PREFIX), name=name)
    if role == "assistant":
        if message.get("function_call") is not None:
            raise BadRequest(f"{where}.function_call is deprecated and not served: use tool_calls",
                             f"{where}.function_call")
        reasoning = shapes.text(message, "reasoning_content", where)
        if reasoning is None:
            reasoning = shapes.text(message, "reasoning", where)  # the spelling some servers use
        calls = tuple(_call(c, f"{where}.tool_calls[{i}]") for i, c in
                      enumerate(shapes.array(message, "tool_calls", where)))
        return Message(role="assistant", content=_content(message.get("content"), f"{where}.content", images=False),
                       reasoning=reasoning, calls=calls, name=name)
    return Message(role="system" if role == "developer" else role,  # type: ignore[arg-type]
                   content=_content(message.get("content"), f"{where}.content", images=role == "user"), name=name)


def _call(call: Any, where: str) -> CallMade:
    call = shapes.obj(call, where)
    if call.get("type", "function") != "function":
        raise BadRequest(f"{where}.type must be function", f"{where}.type")
    function = shapes.obj(call.get("function"), f"{where}.function")
    return shapes.call_made(call.get("id"), function.get("name"), function.get("arguments"), where, CALL_PREFIX)


def _content(value: Any, where: str, *, images: bool) -> str | tuple[Part, ...]:
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a string or an array of parts", where)
    parts = []
    for i, part in enumerate(value):
        part = shapes.obj(part, f"{where}[{i}]")
        kind = part.get("type")
        if kind == "text":
            parts.append(Part(kind="text", text=shapes.text(part, "text", f"{where}[{i}]", required=True) or ""))
        elif kind == "refusal":
            parts.append(Part(kind="text", text=shapes.text(part, "refusal", f"{where}[{i}]", required=True) or ""))
        elif kind == "image_url" and images:
            url = shapes.obj(part.get("image_url"), f"{where}[{i}].image_url").get("url")
            parts.append(shapes.image_part(url, f"{where}[{i}].image_url.url"))
        else:
            allowed = "text and image_url" if images else "text"
            raise BadRequest(f"{where}[{i}].type {kind!r} is not served here (parts: {allowed})", f"{where}[{i}].type")
    return shapes.content(parts)


# ---- replies ------------------------------------------------------------------------------

def _finish(answer: ModelAnswer) -> str:
    if answer.finish == "length":
        return "length"
    return "tool_calls" if answer.calls else "stop"


def usage(answer: ModelAnswer) -> dict[str, Any]:
    u = answer.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _answer_id(answer: ModelAnswer) -> str:
    return "chatcmpl-" + (answer.id or uuid.uuid4().hex)


def reply(answer: ModelAnswer, asked: Asked) -> dict[str, Any]:
    """The chat completion of one answer."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.text or (None if answer.calls else "")}
    if answer.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    if answer.calls:
        message["tool_calls"] = [
            {"id": shapes.wire_id(c.id, CALL_PREFIX), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in answer.calls]
    return {"id": _answer_id(answer), "object": "chat.completion", "created": int(time.time()),
            "model": asked.call.model, "choices": [{"index": 0, "message": message, "finish_reason": _finish(answer),
                                                    "logprobs": None}],
            "usage": usage(answer)}


def events(answer: ModelAnswer, asked: Asked) -> Iterator[bytes]:
    """The answer as chat completion chunks, then `[DONE]`."""
    head = {"id": _answer_id(answer), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": asked.call.model}
    if asked.usage_in_stream:
        head["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return shapes.sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    for piece in shapes.pieces(answer.reasoning or ""):
        yield chunk({"reasoning_content": piece})
    for piece in shapes.pieces(answer.text):
        yield chunk({"content": piece})
    for index, call in enumerate(answer.calls):
        yield chunk({"tool_calls": [{"index": index, "id": shapes.wire_id(call.id, CALL_PREFIX), "type": "function",
                                     "function": {"name": call.name, "arguments": ""}}]})
        for piece in shapes.pieces(call.arguments):
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    yield chunk({}, _finish(answer))
    if asked.usage_in_stream:
        yield shapes.sse({**head, "choices": [], "usage": usage(answer)})
    yield shapes.sse("[DONE]")


def error(problem: Problem) -> dict[str, Any]:
    """OpenAI's error shape (Chat Completions and Responses alike)."""
    return {"error": {"message": problem.message, "type": _ERROR_TYPES.get(problem.status, "invalid_request_error"),
                      "param": problem.param, "code": problem.code or _ERROR_CODES.get(problem.kind)}}


def model_list(names: list[str]) -> dict[str, Any]:
    """`GET /v1/models` in OpenAI's shape."""
    return {"object": "list", "data": [model_card(n) for n in names]}


def model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "fsm-rollout-engine"}
