"""The environment author's API: `Environment`, its `Reply`, and the registry (see `engine.envs`)."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs


@attrs.frozen
class Reply:
    """An environment's answer to one model turn.

    `text`: the next user turn (ignored when `done`). `reward`: the turn's reward, if it
    scores turns. `done`: the episode is over; `reason` says why, in the environment's words.
    """

    text: str = ""
    reward: float | None = None
    done: bool = False
    reason: str | None = None


class EnvironmentFailed(Exception):
    """Raised by an environment that cannot go on (its backend refused, answered nonsense).

    The engine ends the sample with `environment_failed` and this message recorded; nothing
    of it is trained. Any other exception is treated the same way.
    """


class Environment:
    """Base class of an environment. Subclasses set `name` and implement `respond`.

    `Settings`, when set, is the environment's own settings class (`engine.settings.settings`,
    under its own prefix, e.g. `engine_guess_`): the engine reads it from slime's args, the YAML
    and `run`'s flags, checks it as it checks its own, and hands the instance to `setup`.
    `setup(cfg, settings)` is called once per engine runtime with the engine's settings (`cfg`, an
    `EngineConfig`: e.g. `cfg.tool_timeout`) and the environment's own (an environment without
    `Settings` is called with `cfg` alone), and returns the environment that runtime uses: by
    default `self`. `aclose` is called when the runtime closes.
    """

    name: ClassVar[str] = ""
    Settings: ClassVar[type | None] = None

    def setup(self, cfg: Any, settings: Any = None) -> Environment:
        """The environment one runtime uses (override to read settings or open clients)."""
        return self

    async def start(self, prompt: Any, metadata: Mapping[str, Any]) -> Any:
        """Begin an episode from the sample's prompt (text or chat messages) and metadata; returns its state."""
        return None

    async def respond(self, episode: Any, text: str) -> Reply | str:  # pragma: no cover
        """Answer the model's turn `text` (decoded, special tokens kept): a `Reply`, or its text alone."""
        raise NotImplementedError

    async def end(self, episode: Any) -> None:
        """The episode is over (finished, truncated, failed or cancelled): free what `start` made."""

    async def aclose(self) -> None:
        """The runtime is closing: close clients opened by `setup`."""


def check_reply(value: Any) -> Reply:
    """`value` as a `Reply`; raises TypeError saying what is wrong with it."""
    if isinstance(value, str):
        return Reply(value)
    if not isinstance(value, Reply):
        raise TypeError(f"respond must return a Reply or a str, not {type(value).__name__}")
    if not isinstance(value.text, str):
        raise TypeError(f"Reply.text must be a str, not {type(value.text).__name__}")
    if value.reward is not None and (isinstance(value.reward, bool) or not isinstance(value.reward, (int, float))
                                     or not math.isfinite(value.reward)):
        raise TypeError(f"Reply.reward must be a finite number or None, not {value.reward!r}")
    if not isinstance(value.done, bool):
        raise TypeError(f"Reply.done must be a bool, not {type(value.done).__name__}")
    if value.reason is not None and not isinstance(value.reason, str):
        raise TypeError(f"Reply.reason must be a str or None, not {type(value.reason).__name__}")
    return value


_NAME = re.compile(r"[a-z][a-z0-9_]*")
_REGISTRY: dict[str, Environment] = {}


def register_environment(env: Environment, *, replace: bool = False) -> Environment:
    """Add an environment instance under `env.name` (lowercase letters, digits and _)."""
    name = env.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"environment name must be lowercase letters, digits and _, starting with a letter; got {name!r}")
    if name in _REGISTRY and not replace and _REGISTRY[name] is not env:
        raise ValueError(f"an environment named {name!r} is already registered")
    _REGISTRY[name] = env
    return env


def unregister_environment(name: str) -> None:
    """Remove an environment (tests use this to undo a registration)."""
    _REGISTRY.pop(name, None)


@contextlib.contextmanager
def registered_environment(env: Environment) -> Iterator[Environment]:
    """Register `env` for the block, then put back what was registered under its name."""
    original = _REGISTRY.get(env.name)
    register_environment(env, replace=True)
    try:
        yield env
    finally:
        if original is not None:
            _REGISTRY[env.name] = original
        else:
            unregister_environment(env.name)


def get_environment(name: str) -> Environment | None:
    """The environment registered as `name`, or None."""
    return _REGISTRY.get(name)


def environment_names() -> tuple[str, ...]:
    """Registered environment names, sorted."""
    return tuple(sorted(_REGISTRY))
