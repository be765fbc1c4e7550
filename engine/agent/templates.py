"""A call's messages as the chat template takes them, and the model's turn read back as an answer.

Both directions of the profile's format for an agent's session: `template_messages` turns the
protocol-neutral history into the dicts `apply_chat_template` renders (a segment's prompt, the
messages a harness adds after a turn); `read_turn` reads a turn's text, as the server sent its
tokens, into a `ModelAnswer`'s parts with the profile's reasoning and tool parsers
(`engine_reasoning_parser`, `engine_tool_parser`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from engine.agent.calls import CallMade, Message, ModelCall
from engine.profiles.base import ToolCall


class Unrenderable(ValueError):
    """A message the profile cannot render (an image without image support); the call is refused."""


def template_messages(messages: Iterable[Message], form: tuple[bool, bool, bool] = (False, False, True),
                      names: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The history as chat-template message dicts.

    `form` is how the template wants a turn with calls (`ChatProfile.call_form`: arguments as
    JSON text or as an object, content None or not). A tool result gets its call's name from
    `names` (call id -> tool name, the history's calls added as they come) where the harness
    sent none. Raises `Unrenderable` for an image: the chat profile renders text.
    """
    as_text, no_content, _ = form
    names = dict(names or {})
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m.content, str) and any(p.kind == "image" for p in m.content):
            raise Unrenderable("an image in a message: this profile renders text only")
        text = m.text()
        if m.role == "assistant":
            item: dict[str, Any] = {"role": "assistant", "content": None if (no_content and m.calls and not text) else text}
            if m.reasoning:
                item["reasoning_content"] = m.reasoning
            if m.calls:
                item["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments if as_text else _as_object(c.arguments)}}
                                      for c in m.calls]
                names.update((c.id, c.name) for c in m.calls)
            out.append(item)
        elif m.role == "tool":
            item = {"role": "tool", "content": text}
            if m.call_id:
                item["tool_call_id"] = m.call_id
            name = m.name or names.get(m.call_id or "")
            if name:
                item["name"] = name
            out.append(item)
        else:
            out.append({"role": m.role, "content": text})
    return out


def _as_object(arguments: str) -> Any:
    """Arguments written as JSON text, as the object templates iterate over ({} for none)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON (or nested past the parser's stack): the template
        return arguments  # shows the text as the harness sent it
    return value


def call_names(messages: Iterable[Message]) -> dict[str, str]:
    """Call id -> tool name, over the assistant messages of a history."""
    return {c.id: c.name for m in messages if m.role == "assistant" for c in m.calls}


def tool_schemas(call: ModelCall) -> list[dict[str, Any]]:
    """The tools the call offers, as the template shows them (OpenAI's function shape)."""
    return [dict(t) for t in call.tools]


def argument_schemas(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Tool name -> its `parameters` schema: what the parser types a call's arguments by."""
    found: dict[str, Any] = {}
    for t in tools:
        function = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            found[function["name"]] = function.get("parameters") or {}
    return found


@attrs.frozen
class TurnRead:
    """A model turn read for the harness: its reasoning, text and well-formed calls.

    `malformed` says the parser found a call it could not read: the turn's text is then given
    as written (the harness sees what the model wrote) with no call.
    """

    reasoning: str | None
    text: str
    calls: tuple[CallMade, ...]
    malformed: bool = False


def read_turn(profile: Any, text: str, schemas: dict[str, Any]) -> TurnRead:
    """Read a turn's text as SGLang serves it (`ChatProfile.read_turn`: the reasoning parser splits
    off the reasoning, the tool parser reads the calls, typed by the call's own tool schemas); a
    call's id is the one the format wrote (Mistral, Kimi K2), else a new one."""
    reading = profile.read_turn(text, schemas=schemas)
    reasoning = reading.reasoning.strip() or None
    if any(c.error for c in reading.calls):  # the turn as the model wrote it, outside its reasoning
        return TurnRead(reasoning, profile.strip_turn_end(profile.split_reasoning(text)[1]).strip(), (), malformed=True)
    calls = tuple(CallMade(c.id or uuid.uuid4().hex[:24], c.name, json.dumps(c.arguments, ensure_ascii=False))
                  for c in reading.calls)
    return TurnRead(reasoning, reading.content.strip(), calls)


def made_calls(calls: Sequence[CallMade]) -> list[ToolCall]:
    """An answer's calls as the profile's `ToolCall`s (a template that shows a result's call renders them)."""
    made = []
    for c in calls:
        arguments = _as_object(c.arguments)
        made.append(ToolCall(c.name, arguments if isinstance(arguments, dict) else {}, id=c.id))
    return made
