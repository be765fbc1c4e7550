"""Formats: prompt rendering, turn parsing, observation text, the tokenizer and the reward that read them.

Membership: code that turns text into ids and back in a format the model was trained on.
Profiles plug in by registration, as tools do: `register_profile("mine", "my_pkg.fmt:MyProfile")`
(a module path, imported on first use) in a module named in `engine_tool_modules`, then
`engine_profile: mine`. `retool` and `chat` ship; chat reads the tool-call format named by
`engine_tool_parser` (`engine.profiles.parsers`, SGLang's `--tool-call-parser` names).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from engine.profiles.base import CallResult, Profile, ToolCall, Turn, TurnKind, TurnReading

ProfileFactory = Callable[[Any], Profile]
_PROFILES: dict[str, str | ProfileFactory] = {
    "retool": "engine.profiles.retool:RetoolProfile",
    "chat": "engine.profiles.chat:ChatProfile",
}


def register_profile(name: str, factory: str | ProfileFactory, *, replace: bool = False) -> None:
    """Make `engine_profile: name` build `factory(tokenizer)`; `factory` may be "module:attr" (imported on first use)."""
    if name in _PROFILES and not replace:
        raise ValueError(f"a profile named {name!r} is already registered")
    _PROFILES[name] = factory


def profile_names() -> tuple[str, ...]:
    """The registered profiles, sorted."""
    return tuple(sorted(_PROFILES))


def make_profile(name: str, tokenizer: Any, *, tool_parser: str | None = None, reasoning_parser: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> Profile:
    """The profile registered as `name`, over `tokenizer`.

    `tool_parser` and `reasoning_parser` (SGLang parser names) go to a factory that takes them
    (chat does); naming one for a profile that reads a single format of its own is an error,
    not ignored. `template_kwargs` (the chat template's extra variables) go to a factory that
    takes them; a profile that renders no chat template (retool) has no use for them.
    """
    factory = _PROFILES.get(name)
    if factory is None:
        raise ValueError(f"unknown profile {name!r}: registered are {', '.join(profile_names())}")
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    given = {k: v for k, v in (("tool_parser", tool_parser), ("reasoning_parser", reasoning_parser)) if v is not None}
    try:
        takes = set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        takes = set()
    for key in given:
        if key not in takes:
            what = "tool-call" if key == "tool_parser" else "reasoning"
            raise ValueError(f"the {name} profile reads its own {what} format; engine_{key} is for chat")
    if template_kwargs and "template_kwargs" in takes:
        given["template_kwargs"] = template_kwargs
    return factory(tokenizer, **given)


__all__ = ["CallResult", "Profile", "ToolCall", "Turn", "TurnKind", "TurnReading", "make_profile", "profile_names", "register_profile"]
