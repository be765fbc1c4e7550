"""A recorded sample's response, cut back into its turns: the model's text, the tool calls it
made, and the observation that answered them.

The engine records, per response token segment, `[kind, start, end, weight_version]` in
`metadata["fsm"]["segments"]` (kind "model" or "observation"); the response ids are the last
`response_length` of `tokens`. Decoding each segment gives the turn texts exactly as the
policy saw them, with no extra record of text on the sample.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import attrs

from engine.trace.samples_file import metadata

Decode = Callable[[list[int]], str]

_ERROR_LINE = re.compile(r"^\s*(Error:[^\n]*)", re.MULTILINE)
ERROR_TEXT_CHARS = 120


@attrs.frozen
class Part:
    """One segment of a response: who wrote it, its text, how many tokens, its weight version."""

    kind: str  # "model" or "observation"
    text: str
    tokens: int
    weight_version: Any = None


def response_ids(sample: dict[str, Any]) -> list[int]:
    """The response's token ids (the last `response_length` of `tokens`)."""
    tokens = list(sample.get("tokens") or [])
    n = int(sample.get("response_length") or 0)
    return tokens[len(tokens) - n :] if 0 < n <= len(tokens) else []


def response_parts(sample: dict[str, Any], decode: Decode) -> list[Part]:
    """The response cut at its recorded segments; one model part when none were recorded."""
    ids = response_ids(sample)
    segments = metadata(sample).get("segments") or []
    parts = []
    for seg in segments:
        try:
            kind, start, end = str(seg[0]), int(seg[1]), int(seg[2])
        except (TypeError, ValueError, IndexError):
            continue
        version = seg[3] if len(seg) > 3 else None
        parts.append(Part(kind, decode(ids[start:end]), end - start, version))
    if not parts and ids:
        parts.append(Part("model", decode(ids), len(ids)))
    return parts


def parse_calls(profile: str | None, text: str) -> list[tuple[str, Any]]:
    """The tool calls a model turn's text makes, as (name, arguments), read by its profile's rules."""
    from engine.profiles.base import Turn
    from engine.profiles.chat import parse_hermes_turn
    from engine.profiles.parsers import foreign_format, get_tool_parser
    from engine.profiles.retool import parse_retool_turn

    turn = (parse_hermes_turn if profile == "chat" else parse_retool_turn)(text)
    if profile == "chat" and all(c.error for c in turn.calls):  # none read: maybe another tool-call format (the file does not say which parser ran)
        family = foreign_format(text, "hermes", {})
        if family is not None:
            turn = Turn("tool", calls=get_tool_parser(family).parse(text, {}).calls)
    return [(c.name or f"<{c.error}>", c.arguments if not c.error else c.detail) for c in turn.calls]


def error_texts(sample: dict[str, Any], decode: Decode) -> list[str]:
    """The first line of every `Error: ...` a tool answered with, in the sample's observations."""
    found = []
    for part in response_parts(sample, decode):
        if part.kind == "observation":
            found += [_short(m.group(1)) for m in _ERROR_LINE.finditer(part.text)]
    return found


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_TEXT_CHARS else text[: ERROR_TEXT_CHARS - 1] + "…"


TEXT_CHARS = 2000  # per part printed by `trace --text`; a flood of tool output is cut


def _block(text: str, indent: str = "    ") -> list[str]:
    if len(text) > TEXT_CHARS:
        text = text[:TEXT_CHARS] + f"\n[... {len(text) - TEXT_CHARS} more characters not shown]"
    return [indent + line for line in (text.splitlines() or [""])]


def format_turns(sample: dict[str, Any], decode: Decode) -> str:
    """Each model turn's text with the tool calls it made, each observation with the tools that answered."""
    meta = metadata(sample)
    log = meta.get("turns") or []
    profile = meta.get("profile")
    lines: list[str] = []
    turn = 0
    for part in response_parts(sample, decode):
        if part.kind == "model":
            turn += 1
            version = f", weights {part.weight_version}" if part.weight_version not in (None, "default") else ""
            lines.append(f"turn {turn} (model, {part.tokens} tokens{version}):")
            lines += _block(part.text)
            for name, arguments in parse_calls(profile, part.text):
                shown = json.dumps(arguments, ensure_ascii=False) if not isinstance(arguments, str) else arguments
                lines.append(f"  -> call {name}: {shown}")
            record = log[turn - 1] if 0 < turn <= len(log) and isinstance(log[turn - 1], dict) else {}
            if record.get("reward") is not None:
                lines.append(f"  reward {record['reward']:g} (this turn, by {'its tools' if record.get('tools') else 'the environment'})")
        else:
            record = log[turn - 1] if 0 < turn <= len(log) and isinstance(log[turn - 1], dict) else {}
            if record.get("user_tokens"):
                lines.append(f"  <- user ({part.tokens} tokens, the environment's reply):")
                lines += _block(part.text, "    ")
                continue
            names = [n or "?" for n in record.get("tools") or []]
            source = f"answer to {', '.join(names)}" if names else "note (no call ran)"
            lines.append(f"  <- observation ({part.tokens} tokens, {source}):")
            lines += _block(part.text, "    ")
    env = meta.get("environment")
    if isinstance(env, dict) and meta.get("termination_reason") == "environment_done":
        lines.append(f"episode ended by the environment {env.get('name')}: {env.get('reason') or '(no reason given)'}")
    return "\n".join(lines) if lines else "(the response is empty)"
