"""OpenAI Responses (`POST /v1/responses`): input items to calls, answers to responses and their event stream.

Accepted: `input` as a string or items: messages (user, system, developer: `input_text`,
`input_image` by URL; assistant: `output_text`, `refusal`), `function_call`,
`function_call_output` and `reasoning` items; `instructions` (the first system message);
function tools and `tool_choice`; `max_output_tokens`, `temperature`, `top_p`; `stream`.
Consecutive reasoning, assistant message and function calls form one assistant turn, as this
door writes a turn's output. Refused (400): state kept by the server (`previous_response_id`,
`conversation`, stored `prompt`s, `background`): a session needs the whole history in each
request; files, built-in and custom tools, structured output (`text.format` other than text).
`POST /v1/responses/input_tokens` counts a request's prompt.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from engine.agent import shapes
from engine.agent.calls import CallMade, Message, ModelAnswer, ModelCall, Part
from engine.agent.chat import error, model_card, model_list  # OpenAI answers errors and models alike
from engine.agent.shapes import Asked, BadRequest

__all__ = ["error", "events", "model_card", "model_list", "read", "reply", "token_count"]

CALL_PREFIX = "call_"
SAMPLING = {"max_output_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p"}
SERVER_STATE = ("previous_response_id", "conversation", "prompt")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# Harnesses that keep no server state (`store: false`) ask for reasoning as `encrypted_content`
# and send back only that: the door puts the text there, marked so it never reads another
# server's ciphertext as reasoning.
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
SEALED = "fsm-reasoning:"


# ---- requests -----------------------------------------------------------------------------

def read(body: Any, last: shapes.History | None = None) -> Asked:
    """A Responses request as a call, or BadRequest naming the field; `last`: the session's previous
    request's history as read, whose repeated items are not read again."""
    body = shapes.obj(body, "")
    model = shapes.text(body, "model", "", required=True)
    for key in SERVER_STATE:
        if body.get(key) is not None:
            raise BadRequest(f"{key} is not served: send the whole history as input in each request", key)
    if shapes.flag(body, "background", ""):
        raise BadRequest("background responses are not served", "background")
    text_config = body.get("text")
    if text_config is not None:
        form = shapes.obj(text_config, "text").get("format")
        if form is not None and shapes.obj(form, "text.format").get("type") != "text":
            raise BadRequest("text.format other than text is not served: structured output is not enforced",
                             "text.format")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(shapes.array(body, "tools", "")))
    messages: list[Message] = []
    instructions = shapes.text(body, "instructions", "")
    if instructions:
        messages.append(Message(role="system", content=instructions))
    given = body.get("input")
    history = None
    if isinstance(given, str):
        messages.append(Message(role="user", content=given))
    else:
        read, history = shapes.read_items(shapes.array(body, "input", "", required=True), last, _items)
        messages.extend(read)
    if not messages:
        raise BadRequest("input must hold at least one item", "input")
    call = ModelCall(messages=tuple(messages), tools=tools, sampling=shapes.sampling(body, SAMPLING),
                     protocol="responses", model=model or "",
                     tool_choice=shapes.openai_tool_choice(body.get("tool_choice"), tools, nested=False))
    echo = {"instructions": instructions, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": shapes.flag(body, "parallel_tool_calls", "", default=True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "reasoning": body.get("reasoning"), "store": shapes.flag(body, "store", "", default=True),
            "sealed_reasoning": ENCRYPTED_INCLUDE in shapes.array(body, "include", "")}
    return Asked(call=call, stream=shapes.flag(body, "stream", ""), echo=echo, history=history)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    tool = shapes.obj(tool, where)
    if tool.get("type") != "function":
        raise BadRequest(f"{where}.type {tool.get('type')!r} is not served: only function tools are",
                         f"{where}.type")
    return shapes.function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), where)


class _Turn:
    """An assistant turn being gathered from consecutive output items."""

    def __init__(self) -> None:
        self.reasoning: str | None = None
        self.texts: list[Part] = []
        self.calls: list[CallMade] = []

    def message(self) -> Message:
        return Message(role="assistant", content=shapes.content(self.texts) if self.texts else "",
                       reasoning=self.reasoning, calls=tuple(self.calls))


def _items(items: list[Any], start: int, messages: list[Message], marks: list[int]) -> None:
    """Items from `start` on (where no turn is open) as messages; a mark after each (-1 while a turn is open)."""
    turn: _Turn | None = None

    def close() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn.message())
            turn = None

    for i in range(start, len(items)):
        where, item = f"input[{i}]", items[i]
        item = shapes.obj(item, where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            if turn is not None and (turn.reasoning is not None or turn.texts or turn.calls):
                close()
            turn = turn or _Turn()
            turn.reasoning = _reasoning(item, where)
        elif kind == "function_call":
            turn = turn or _Turn()
            turn.calls.append(shapes.call_made(item.get("call_id"), item.get("name"), item.get("arguments"), where,
                                               CALL_PREFIX))
        elif kind == "message" and item.get("role") == "assistant":
            if turn is not None and (turn.texts or turn.calls):
                close()
            turn = turn or _Turn()
            turn.texts = _assistant_parts(item.get("content"), f"{where}.content")
        elif kind == "message":
            close()
            role = shapes.one_of(item.get("role"), MESSAGE_ROLES, f"{where}.role")
            messages.append(Message(role="system" if role == "developer" else role,  # type: ignore[arg-type]
                                    content=_input_content(item.get("content"), f"{where}.content")))
        elif kind == "function_call_output":
            close()
            call_id = shapes.text(item, "call_id", where, required=True) or ""
            messages.append(Message(role="tool", content=_input_content(item.get("output"), f"{where}.output"),
                                    call_id=shapes.session_id(call_id, CALL_PREFIX)))
        else:
            raise BadRequest(f"{where}.type {kind!r} is not served (items: message, function_call, "
                             "function_call_output, reasoning)", f"{where}.type")
        marks.append(-1 if turn is not None else len(messages))
    close()


def _reasoning(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else what this door sealed in its
    encrypted_content, else its summary."""
    parts = shapes.array(item, "content", where)
    sealed = shapes.text(item, "encrypted_content", where) or ""
    if not parts and sealed.startswith(SEALED):
        return sealed[len(SEALED):]
    for key in ("content", "summary"):
        parts = shapes.array(item, key, where)
        if parts:
            texts = [shapes.text(shapes.obj(p, f"{where}.{key}[{j}]"), "text", f"{where}.{key}[{j}]", required=True)
                     for j, p in enumerate(parts)]
            return "\n".join(t or "" for t in texts)
    return ""


def _assistant_parts(value: Any, where: str) -> list[Part]:
    if isinstance(value, str):
        return [Part(kind="text", text=value)]
    parts = []
    for j, part in enumerate(shapes.array({"c": value}, "c", where, required=True)):
        part = shapes.obj(part, f"{where}[{j}]")
        kind = part.get("type")
        key = {"output_text": "text", "input_text": "text", "refusal": "refusal"}.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise BadRequest(f"{where}[{j}].type {kind!r} is not served in an assistant message", f"{where}[{j}].type")
        parts.append(Part(kind="text", text=shapes.text(part, key, f"{where}[{j}]", required=True) or ""))
    return parts


def _input_content(value: Any, where: str) -> str | tuple[Part, ...]:
    if isinstance(value, str):
        return value
    parts = []
    for j, part in enumerate(shapes.array({"c": value}, "c", where, required=True)):
        part = shapes.obj(part, f"{where}[{j}]")
        kind = part.get("type")
        if kind in ("input_text", "output_text"):
            parts.append(Part(kind="text", text=shapes.text(part, "text", f"{where}[{j}]", required=True) or ""))
        elif kind == "input_image":
            if part.get("image_url") is None:
                raise BadRequest(f"{where}[{j}] names an uploaded file: send the image by URL or data URL",
                                 f"{where}[{j}]")
            parts.append(shapes.image_part(part.get("image_url"), f"{where}[{j}].image_url"))
        else:
            raise BadRequest(f"{where}[{j}].type {kind!r} is not served (parts: input_text, input_image)",
                             f"{where}[{j}].type")
    return shapes.content(parts)


# ---- replies ------------------------------------------------------------------------------

def _usage(answer: ModelAnswer) -> dict[str, Any]:
    u = answer.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                                                      "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _output(answer: ModelAnswer, rid: str, sealed: bool) -> list[dict[str, Any]]:
    """The answer's output items, finished: reasoning, the message, the function calls."""
    status = "incomplete" if answer.finish == "length" else "completed"
    items: list[dict[str, Any]] = []
    if answer.reasoning is not None:
        items.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [], "status": status,
                      "content": [{"type": "reasoning_text", "text": answer.reasoning}]})
        if sealed:
            items[-1]["encrypted_content"] = SEALED + answer.reasoning
    if answer.text or not answer.calls:
        items.append({"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": answer.text, "annotations": [], "logprobs": []}]})
    for call in answer.calls:
        items.append({"type": "function_call", "id": f"fc_{call.id}", "call_id": shapes.wire_id(call.id, CALL_PREFIX),
                      "name": call.name, "arguments": call.arguments, "status": status})
    return items


def _response(answer: ModelAnswer, asked: Asked, rid: str, created: float, *, done: bool) -> dict[str, Any]:
    incomplete = answer.finish == "length"
    echo = asked.echo
    return {"id": f"resp_{rid}", "object": "response", "created_at": created,
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if done and incomplete else None,
            "instructions": echo.get("instructions"), "model": asked.call.model,
            "output": _output(answer, rid, echo.get("sealed_reasoning", False)) if done else [],
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "temperature": echo.get("temperature"), "top_p": echo.get("top_p"),
            "tool_choice": echo.get("tool_choice", "auto"), "tools": echo.get("tools", []),
            "max_output_tokens": echo.get("max_output_tokens"), "metadata": echo.get("metadata", {}),
            "reasoning": echo.get("reasoning"), "store": echo.get("store", True),
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": _usage(answer) if done else None}


def reply(answer: ModelAnswer, asked: Asked) -> dict[str, Any]:
    """The response object of one answer."""
    return _response(answer, asked, answer.id or uuid.uuid4().hex, time.time(), done=True)


def events(answer: ModelAnswer, asked: Asked) -> Iterator[bytes]:
    """The answer as Responses' event sequence: created, in progress, each item's parts and deltas, completed
    (or incomplete)."""
    rid = answer.id or uuid.uuid4().hex
    created = time.time()
    number = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal number
        payload = {"type": kind, "sequence_number": number, **fields}
        number += 1
        return shapes.sse(payload, kind)

    yield event("response.created", response=_response(answer, asked, rid, created, done=False))
    yield event("response.in_progress", response=_response(answer, asked, rid, created, done=False))
    for index, item in enumerate(_output(answer, rid, asked.echo.get("sealed_reasoning", False))):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            yield event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})
            for piece in shapes.pieces(item["arguments"]):
                yield event("response.function_call_arguments.delta", **at, delta=piece)
            yield event("response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"])
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "content": [], "status": "in_progress"})
            part = item["content"][0]
            at["content_index"] = 0
            yield event("response.content_part.added", **at, part={**part, "text": ""})
            if part["type"] == "reasoning_text":
                for piece in shapes.pieces(part["text"]):
                    yield event("response.reasoning_text.delta", **at, delta=piece)
                yield event("response.reasoning_text.done", **at, text=part["text"])
            else:
                for piece in shapes.pieces(part["text"]):
                    yield event("response.output_text.delta", **at, delta=piece, logprobs=[])
                yield event("response.output_text.done", **at, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **at, part=part)
        yield event("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if answer.finish == "length" else "response.completed"
    yield event(final, response=_response(answer, asked, rid, created, done=True))


def token_count(count: int) -> dict[str, Any]:
    """`POST /v1/responses/input_tokens`'s reply."""
    return {"object": "response.input_tokens", "input_tokens": count}
