"""The shipped demo, by path: its prompts and its replay scripts (one per turn format)."""

from __future__ import annotations

import os
from importlib import resources


def demo_file(name: str) -> str:
    """Path of a file of the shipped demo (prompts.jsonl, replay.jsonl, replay-chat.jsonl)."""
    return str(resources.files("engine.local") / "demo" / name)


def demo_replay(profile: str, tool_parser: str | None = None) -> str:
    """The demo replay written in `profile`'s turn format (chat: in the tool parser's family's, where the demo has it)."""
    if profile != "chat":
        return demo_file("replay.jsonl")
    family = demo_file(f"replay-chat-{tool_parser}.jsonl") if tool_parser else ""
    return family if family and os.path.isfile(family) else demo_file("replay-chat.jsonl")
