"""The environment author's API: `Environment`, what it is handed (`Task`, `Conversation`), what it
returns (`Opening`, `Reply`), and the registry (see `engine.envs`)."""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import attrs

NONE = "none"  # a sample's `metadata["environment"]` naming no environment (a plain tool task)


@attrs.frozen
class Reply:
    """An environment's answer to one model turn.

    `text`: the next user turn (ignored when `done`). `reward`: the turn's reward, if it
    scores turns. `done`: the episode is over; `reason` says why, in the environment's words;
    `success` whether its goal was reached (what the reward's `acc` reports; None: not said).
    """

    text: str = ""
    reward: float | None = None
    done: bool = False
    reason: str | None = None
    success: bool | None = None


@attrs.frozen
class Task:
    """What `start` begins an episode from: the sample's prompt (text or chat messages), its own
    `metadata` (the dataset's, read-only) and the environment's `args` for it (from
    `metadata["environment"]["args"]`; {} when none)."""

    prompt: Any
    metadata: Mapping[str, Any] = attrs.field(factory=dict)
    args: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Opening:
    """What `start` may return instead of the episode's state alone: the state, and the prompt the
    policy starts from instead of the sample's (a system message with the rules, a scenario)."""

    state: Any = None
    prompt: str | list[dict[str, Any]] | None = None  # None: the sample's own prompt


@attrs.frozen
class Conversation:
    """The episode so far, as `respond` receives it.

    `messages`: chat messages, as text without special tokens: the prompt's (after `start`
    shaped it), then per model turn `{"role": "assistant", "content": ...}` (with
    `"tool_calls": [{"type": "function", "function": {"name", "arguments"}}]` when it called
    tools), the tools' answers `{"role": "tool", "name", "content"}`, and this environment's
    replies `{"role": "user", "content"}`. The last message is the turn to answer (`text`).
    Fresh copies each turn: change them freely.

    The token view, for those who want it: `prompt_ids` and `response_ids` are the sequence the
    policy sees, `segments` its `(kind, start, end)` spans of `response_ids` ("model" or
    "observation", as in `metadata["fsm"]["segments"]`), `decode` turns ids into text with the
    special tokens kept. `turn` counts the model's turns so far.
    """

    messages: tuple[dict[str, Any], ...]
    prompt_ids: Sequence[int] = ()
    response_ids: Sequence[int] = ()
    segments: tuple[tuple[str, int, int], ...] = ()
    decode: Callable[[list[int]], str] = attrs.field(default=lambda ids: "", eq=False, repr=False)
    turn: int = 0

    @property
    def text(self) -> str:
        """The model turn to answer: the last assistant message's content."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return str(message.get("content") or "")
        return ""


class EnvironmentFailed(Exception):
    """Raised by an environment that cannot go on (its backend refused, answered nonsense).

    The engine ends the sample with `environment_failed` and this message recorded; nothing
    of it is trained. Any other exception is treated the same way.
    """


class HttpClient(Protocol):
    """The engine's HTTP client, as `setup` hands it: the pool, reply cap and retry policy of `/generate`."""

    async def post_json(self, url: str, body: Any, *, timeout: float) -> Any:
        """POST `body` as JSON to `url` and return the reply's JSON, all attempts within `timeout`
        seconds (transient failures are retried). Raises on failure, saying what happened."""
        ...  # pragma: no cover


class Environment:
    """Base class of an environment. Subclasses set `name` and implement `respond`.

    `Settings`, when set, is the environment's own settings class (`engine.settings.settings`,
    under its own prefix, e.g. `engine_guess_`): the engine reads it from slime's args, the YAML
    and `run`'s flags, checks it as it checks its own, and hands the instance to `setup`.
    `setup(cfg, settings)` is called once per engine runtime with the engine's settings (`cfg`, an
    `EngineConfig`: e.g. `cfg.tool_timeout`) and the environment's own (an environment without
    `Settings` is called with `cfg` alone), and returns the environment that runtime uses: by
    default `self`. A `setup` that takes `http` also gets the engine's HTTP client (`HttpClient`;
    None when the settings are only being checked): an environment that asks a service (a second
    model, a judge) keeps it and asks through it. `aclose` is called when the runtime closes.

    `start`, `respond` and `end` may be plain functions instead of coroutines: a plain one runs
    in a worker thread, off the event loop, so a blocking call in it (a solver, a database, a
    synchronous HTTP client) stalls no other sample. A coroutine runs on the event loop: one that
    blocks it is timed, and the engine says so (`environment_blocked_seconds` on the turn, one
    warning per environment).
    """

    name: ClassVar[str] = ""
    Settings: ClassVar[type | None] = None

    def setup(self, cfg: Any, settings: Any = None, http: HttpClient | None = None) -> Environment:
        """The environment one runtime uses (override to read settings or keep `http`)."""
        return self

    async def start(self, task: Task) -> Any:
        """Begin an episode (the sample's prompt, metadata and this environment's args for it): its
        state, or an `Opening` holding the state and the prompt the policy starts from instead."""
        return None

    async def respond(self, episode: Any, conversation: Conversation) -> Reply | str:  # pragma: no cover
        """Answer the model's last turn (`conversation.text`), the conversation so far at hand: a `Reply`, or its text alone."""
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
    if value.success is not None and not isinstance(value.success, bool):
        raise TypeError(f"Reply.success must be a bool or None, not {type(value.success).__name__}")
    return value


def check_opening(value: Any, prompt: Any) -> tuple[Any, Any]:
    """What `start` returned as (the episode's state, the prompt to render); raises TypeError for
    a prompt that is neither text nor chat messages."""
    if not isinstance(value, Opening):
        return value, prompt
    shaped = value.prompt
    if shaped is None:
        return value.state, prompt
    if isinstance(shaped, str) and shaped:
        return value.state, shaped
    if (isinstance(shaped, list) and shaped
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in shaped)):
        return value.state, shaped
    raise TypeError("Opening.prompt must be non-empty text or a list of chat messages with a string 'role', "
                    f"not {str(shaped)[:80]!r}")


_NAME = re.compile(r"[a-z][a-z0-9_]*")
_REGISTRY: dict[str, Environment] = {}


def _check_signatures(env: Environment) -> None:
    """Refuse an environment written for the older API (`start(prompt, metadata)`), with what changed."""
    try:
        params = inspect.signature(env.start).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: it will say so when called
        return
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 1:
        raise ValueError(f"environment {env.name!r}: start takes one argument now, start(task) (task.prompt, "
                         "task.metadata, task.args), and respond(episode, conversation) gets the conversation "
                         "(conversation.text is the turn to answer); see docs/environments.md")


def register_environment(env: Environment, *, replace: bool = False) -> Environment:
    """Add an environment instance under `env.name` (lowercase letters, digits and _; not "none")."""
    name = env.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"environment name must be lowercase letters, digits and _, starting with a letter; got {name!r}")
    if name == NONE:
        raise ValueError(f"{NONE!r} cannot name an environment: a sample's metadata names it to have none")
    if name in _REGISTRY and not replace and _REGISTRY[name] is not env:
        raise ValueError(f"an environment named {name!r} is already registered")
    _check_signatures(env)
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
