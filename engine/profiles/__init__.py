"""Profiles: prompt rendering, turn parsing and observation formatting, chosen by name."""

from __future__ import annotations

from typing import Any

from engine.profiles.base import Action, CallResult, Profile, ToolCall, Turn


def make_profile(name: str, tokenizer: Any) -> Profile:
    """The profile called `name` ("retool" or "chat") over `tokenizer`."""
    if name == "retool":
        from engine.profiles.retool import RetoolProfile

        return RetoolProfile(tokenizer)
    if name == "chat":
        from engine.profiles.chat import ChatProfile

        return ChatProfile(tokenizer)
    raise ValueError(f"unknown profile {name!r}: expected 'retool' or 'chat'")


__all__ = ["Action", "CallResult", "Profile", "ToolCall", "Turn", "make_profile"]
