"""A researcher's tool-call format in its own module: registration is all it takes.

`docs/formats.md` shows this file; a test runs it as written. The model writes
`CALL name {json arguments}` on a line of its own.
"""

from __future__ import annotations

import re

from engine.profiles import register_profile
from engine.profiles.base import ToolCall
from engine.profiles.chat import ChatProfile
from engine.profiles.parsers import ParsedTurn, register_tool_parser
from engine.profiles.parsers.base import call_from_json_text

_CALL = re.compile(r"^CALL (\w+) (\{.*\})", re.MULTILINE)


class ShoutParser:
    """`CALL name {"arg": ...}` lines; the text before the first one is content."""

    name = "shout"

    def parse(self, text: str, schemas: dict) -> ParsedTurn:
        calls: list[ToolCall] = [call_from_json_text(m.group(2), f"the arguments of {m.group(1)}", m.group(1))
                                 for m in _CALL.finditer(text)]
        first = _CALL.search(text)
        return ParsedTurn((text[: first.start()] if first else text).strip(), tuple(calls))


class ShoutChat(ChatProfile):
    """The chat profile reading `shout` calls whatever engine_tool_parser says."""

    name = "shout-chat"

    def __init__(self, tokenizer, tool_parser=None, reasoning_parser=None):
        super().__init__(tokenizer, tool_parser="shout", reasoning_parser=reasoning_parser)


register_tool_parser("shout", ShoutParser(), replace=True)
register_profile("shout-chat", ShoutChat, replace=True)
