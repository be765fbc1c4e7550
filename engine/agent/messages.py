"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`): requests to calls, answers to messages.

Accepted: `system` (a string or text blocks: the first system message); user content as text,
`image` (base64 or URL; kept as a data URL or URL, never flattened) and `tool_result` blocks
(`is_error` kept, their content text and images); assistant content as `text`, `thinking` and
`tool_use` blocks; custom tools (`input_schema`) and `tool_choice` (auto, any, tool, none);
`max_tokens`, `temperature`, `top_p`, `top_k`, `stop_sequences`; `stream`. A user message's
tool results become tool messages, in order, before its other content. Refused (400): documents,
redacted thinking, server tools (web search, code execution, ...), images by file id, structured
output (`output_config.format`, the beta's `output_format`), and a `thread` (server-held state: the
refusal carries `thread_unsupported_request`, on which the SDK's thread and tool runner send the
whole conversation again).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

from engine.agent import shapes
from engine.agent.calls import CallMade, Message, ModelAnswer, ModelCall, Part
from engine.agent.shapes import Asked, BadRequest, Problem

log = logging.getLogger("engine.agent")

CALL_PREFIX = "toolu_"
SAMPLING = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "stop_sequences": "stop"}
_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
# The error code (`error.details.error_code`) on which the SDK's message threads (its beta tool runner
# uses one) drop `thread` and send the whole conversation: the door keeps no state between calls.
THREAD_UNSUPPORTED = "thread_unsupported_request"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                409: "invalid_request_error", 413: "request_too_large", 500: "api_error"}


# ---- requests -----------------------------------------------------------------------------

def read(body: Any, last: shapes.History | None = None, *, counting: bool = False) -> Asked:
    """A Messages request (or a count_tokens request, which has no `max_tokens`) as a call, or BadRequest;
    `last`: the session's previous request's history as read, whose repeated messages are not read again."""
    body = shapes.obj(body, "")
    model = shapes.text(body, "model", "", required=True)
    if not counting:
        shapes.integer(body, "max_tokens", "", low=1, required=True)
    if body.get("thread") is not None:
        raise BadRequest("thread is not served: the door keeps no state between calls, send the whole "
                         "conversation in messages", "thread", code=THREAD_UNSUPPORTED)
    _no_structured_output(body)
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(shapes.array(body, "tools", "")))
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        text = _texts(system, "system")
        if text:
            messages.append(Message(role="system", content=text))
    given = shapes.array(body, "messages", "", required=True)
    if not given:
        raise BadRequest("messages must hold at least one message", "messages")
    read, history = shapes.read_items(given, last, _messages)
    messages.extend(read)
    call = ModelCall(messages=tuple(messages), tools=tools, sampling=shapes.sampling(body, SAMPLING),
                     protocol="messages", model=model or "", tool_choice=_tool_choice(body.get("tool_choice"), tools))
    return Asked(call=call, stream=shapes.flag(body, "stream", ""), history=history)


def _no_structured_output(body: dict[str, Any]) -> None:
    """Refuse an output schema (`output_config.format`, the beta's `output_format`): nothing enforces it on
    the sampled turn, and the SDK's `parse` would fail on the free text."""
    config = body.get("output_config")
    if config is not None and shapes.obj(config, "output_config").get("format") is not None:
        raise BadRequest("output_config.format is not served: structured output is not enforced",
                         "output_config.format")
    if body.get("output_format") is not None:
        raise BadRequest("output_format is not served: structured output is not enforced", "output_format")


def _tool(tool: Any, where: str) -> dict[str, Any]:
    tool = shapes.obj(tool, where)
    if tool.get("type") not in (None, "custom"):
        raise BadRequest(f"{where}.type {tool.get('type')!r} is not served: only custom tools (input_schema) are",
                         f"{where}.type")
    if tool.get("input_schema") is None:
        raise BadRequest(f"{where}.input_schema is required", f"{where}.input_schema")
    return shapes.function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), where)


def _tool_choice(choice: Any, tools: tuple[dict[str, Any], ...]) -> str:
    if choice is None:
        return "auto"
    choice = shapes.obj(choice, "tool_choice")
    kind = shapes.one_of(choice.get("type"), ("auto", "any", "tool", "none"), "tool_choice.type")
    if kind == "tool":
        return shapes.named_choice(choice.get("name"), tools, "tool_choice.name")
    return "required" if kind == "any" else kind


def _texts(value: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (system prompts)."""
    if isinstance(value, str):
        return value
    blocks = shapes.array({"v": value}, "v", where)
    texts = []
    for j, block in enumerate(blocks):
        block = shapes.obj(block, f"{where}[{j}]")
        if block.get("type") != "text":
            raise BadRequest(f"{where}[{j}].type must be text", f"{where}[{j}].type")
        texts.append(shapes.text(block, "text", f"{where}[{j}]", required=True) or "")
    return "\n".join(texts)


def _messages(items: list[Any], start: int, messages: list[Message], marks: list[int]) -> None:
    for i in range(start, len(items)):
        messages.extend(_message(items[i], f"messages[{i}]"))
        marks.append(len(messages))


def _message(message: Any, where: str) -> list[Message]:
    message = shapes.obj(message, where)
    role = shapes.one_of(message.get("role"), ("user", "assistant"), f"{where}.role")
    value = message.get("content")
    if isinstance(value, str):
        return [Message(role=role, content=value)]  # type: ignore[arg-type]
    blocks = shapes.array(message, "content", where, required=True)
    return _assistant(blocks, f"{where}.content") if role == "assistant" else _user(blocks, f"{where}.content")


def _assistant(blocks: list[Any], where: str) -> list[Message]:
    texts: list[Part] = []
    thinking: list[str] = []
    calls: list[CallMade] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        block = shapes.obj(block, at)
        kind = block.get("type")
        if kind == "text":
            texts.append(Part(kind="text", text=shapes.text(block, "text", at, required=True) or ""))
        elif kind == "thinking":
            thinking.append(shapes.text(block, "thinking", at, required=True) or "")
        elif kind == "tool_use":
            arguments = json.dumps(shapes.obj(block.get("input"), f"{at}.input"), ensure_ascii=False)
            calls.append(shapes.call_made(block.get("id"), block.get("name"), arguments, at, CALL_PREFIX))
        else:
            raise BadRequest(f"{at}.type {kind!r} is not served in an assistant message (text, thinking, tool_use)",
                             f"{at}.type")
    return [Message(role="assistant", content=shapes.content(texts) if texts else "",
                    reasoning="\n".join(thinking) if thinking else None, calls=tuple(calls))]


def _user(blocks: list[Any], where: str) -> list[Message]:
    results: list[Message] = []
    parts: list[Part] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        block = shapes.obj(block, at)
        kind = block.get("type")
        if kind == "tool_result":
            call_id = shapes.text(block, "tool_use_id", at, required=True) or ""
            results.append(Message(role="tool", content=_result(block.get("content"), f"{at}.content"),
                                   call_id=shapes.session_id(call_id, CALL_PREFIX),
                                   error=shapes.flag(block, "is_error", at)))
        else:
            parts.append(_part(block, at))
    return results + ([Message(role="user", content=shapes.content(parts))] if parts else [])


def _result(value: Any, where: str) -> str | tuple[Part, ...]:
    if value is None or isinstance(value, str):
        return value or ""
    return shapes.content([_part(shapes.obj(b, f"{where}[{j}]"), f"{where}[{j}]")
                           for j, b in enumerate(shapes.array({"v": value}, "v", where))])


def _part(block: dict[str, Any], at: str) -> Part:
    kind = block.get("type")
    if kind == "text":
        return Part(kind="text", text=shapes.text(block, "text", at, required=True) or "")
    if kind == "image":
        source = shapes.obj(block.get("source"), f"{at}.source")
        if source.get("type") == "base64":
            media = shapes.text(source, "media_type", f"{at}.source", required=True)
            data = shapes.text(source, "data", f"{at}.source", required=True)
            return shapes.image_part(f"data:{media};base64,{data}", f"{at}.source")
        if source.get("type") == "url":
            return shapes.image_part(source.get("url"), f"{at}.source.url")
        raise BadRequest(f"{at}.source.type must be base64 or url", f"{at}.source.type")
    raise BadRequest(f"{at}.type {kind!r} is not served in a user message (text, image, tool_result)", f"{at}.type")


# ---- replies ------------------------------------------------------------------------------

def _usage(answer: ModelAnswer) -> dict[str, Any]:
    u = answer.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _signature(thinking: str) -> str:
    """A stand-in for Anthropic's signature, which clients keep and send back (it is not checked)."""
    return uuid.uuid5(uuid.NAMESPACE_OID, thinking).hex


def _blocks(answer: ModelAnswer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": _signature(answer.reasoning)})
    if answer.text:
        blocks.append({"type": "text", "text": answer.text})
    for call in answer.calls:
        arguments = shapes.arguments_object(call.arguments)
        if arguments is None:
            log.warning("call %s of %s: arguments are not a JSON object; sent as {}", call.id, call.name)
        blocks.append({"type": "tool_use", "id": shapes.wire_id(call.id, CALL_PREFIX), "name": call.name,
                       "input": arguments or {}})
    return blocks


def _stop(answer: ModelAnswer) -> str:
    if answer.calls and answer.finish != "length":
        return "tool_use"
    return "stop_sequence" if answer.finish == "stop" and answer.stop_sequence is not None else _STOP[answer.finish]


def _stop_sequence(answer: ModelAnswer) -> str | None:
    """The request's stop sequence the turn ended on (None unless the stop reason is `stop_sequence`)."""
    return answer.stop_sequence if _stop(answer) == "stop_sequence" else None


def _message_id(answer: ModelAnswer) -> str:
    return "msg_" + (answer.id or uuid.uuid4().hex)


def reply(answer: ModelAnswer, asked: Asked) -> dict[str, Any]:
    """The message of one answer."""
    return {"id": _message_id(answer), "type": "message", "role": "assistant", "model": asked.call.model,
            "content": _blocks(answer), "stop_reason": _stop(answer), "stop_sequence": _stop_sequence(answer),
            "usage": _usage(answer)}


def events(answer: ModelAnswer, asked: Asked) -> Iterator[bytes]:
    """The answer as Anthropic's event sequence: message_start, each block's start, deltas and stop,
    message_delta, message_stop."""
    usage = _usage(answer)
    start = {"id": _message_id(answer), "type": "message", "role": "assistant", "model": asked.call.model,
             "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    yield shapes.sse({"type": "message_start", "message": start}, "message_start")
    yield shapes.sse({"type": "ping"}, "ping")
    for index, block in enumerate(_blocks(answer)):
        kind = block["type"]
        opened = {"thinking": {**block, "thinking": "", "signature": ""}, "text": {**block, "text": ""},
                  "tool_use": {**block, "input": {}}}[kind]
        yield shapes.sse({"type": "content_block_start", "index": index, "content_block": opened},
                         "content_block_start")
        if kind == "thinking":
            deltas = [{"type": "thinking_delta", "thinking": p} for p in shapes.pieces(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "text":
            deltas = [{"type": "text_delta", "text": p} for p in shapes.pieces(block["text"])]
        else:
            written = json.dumps(block["input"], ensure_ascii=False)
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in shapes.pieces(written)]
        for delta in deltas:
            yield shapes.sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
        yield shapes.sse({"type": "content_block_stop", "index": index}, "content_block_stop")
    yield shapes.sse({"type": "message_delta", "delta": {"stop_reason": _stop(answer),
                                                         "stop_sequence": _stop_sequence(answer)},
                      "usage": usage}, "message_delta")
    yield shapes.sse({"type": "message_stop"}, "message_stop")


def error(problem: Problem) -> dict[str, Any]:
    """Anthropic's error shape. Over budget it says `prompt is too long`, the words harnesses compact on."""
    message = problem.message
    if problem.kind == "over_budget" and not message.startswith("prompt is too long"):
        message = f"prompt is too long: {message}"
    shaped: dict[str, Any] = {"type": _ERROR_TYPES.get(problem.status, "invalid_request_error"), "message": message}
    if problem.code == THREAD_UNSUPPORTED:
        shaped["details"] = {"error_code": problem.code}
    return {"type": "error", "error": shaped}


def token_count(count: int) -> dict[str, Any]:
    """`POST /v1/messages/count_tokens`'s reply."""
    return {"input_tokens": count}


def model_list(names: list[str]) -> dict[str, Any]:
    """`GET /v1/models` in Anthropic's shape."""
    cards = [model_card(n) for n in names]
    return {"data": cards, "has_more": False, "first_id": names[0] if names else None,
            "last_id": names[-1] if names else None}


def model_card(name: str) -> dict[str, Any]:
    return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z",
            "lifecycle": "active"}

