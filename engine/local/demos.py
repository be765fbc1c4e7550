"""The shipped demos, by path: their prompts, their replay scripts (one per turn format) and settings."""

from __future__ import annotations

import os
from importlib import resources


# `run --demo NAME`: the prompts, the replay script and the settings (a --config YAML) of each
# demo; None where `run`'s own default applies (the replay: the demo's in the profile's format).
DEMOS: dict[str, tuple[str, str | None, str | None]] = {
    "tools": ("prompts.jsonl", None, None),
    # one prompt, 99 code calls and an answer under a 4k context: compacted twice, three samples
    "long": ("long-prompts.jsonl", "replay-long.jsonl", "long.yaml"),
}


def demo_file(name: str) -> str:
    """Path of a file of the shipped demo (prompts.jsonl, replay.jsonl, replay-chat.jsonl)."""
    return str(resources.files("engine.local") / "demo" / name)


def demo_replay(profile: str, tool_parser: str | None = None) -> str:
    """The demo replay written in `profile`'s turn format (chat: in the tool parser's family's, where the demo has it)."""
    if profile != "chat":
        return demo_file("replay.jsonl")
    family = demo_file(f"replay-chat-{tool_parser}.jsonl") if tool_parser else ""
    return family if family and os.path.isfile(family) else demo_file("replay-chat.jsonl")
