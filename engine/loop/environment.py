"""The environments a runtime's samples talk to, and how the loop calls them (see `engine.envs`).

* Which one: a sample's `metadata["environment"]` names it (a name, `{"name", "args"}`, or
  "none"); `engine_environment` is the default. Each is set up once per runtime, when a sample
  first names it (`Environments`).
* How it is called (`call`): a plain function in a worker thread, off the event loop; a
  coroutine on the loop, timed step by step, so one that blocks the loop is caught in the act
  (`BLOCKING_SECONDS`) and named once in the log, and the figure kept with the turn.
* What `respond` sees (`Conversation`): the messages of the episode, recorded as the turns
  happen (only for samples with an environment) and handed over as fresh copies.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import re
import threading
import time
from collections.abc import Callable, Generator, Mapping
from typing import Any

import attrs

from engine import envs
from engine.logs import log_once
from engine.profiles import Profile
from engine.profiles.base import CallResult, Turn
from engine.settings import EngineConfig

log = logging.getLogger(__name__)

KEY = "environment"  # the key of a sample's metadata naming its environment
# One step of an environment's coroutine holding the event loop this long stalls every sample of
# the loop: asyncio's own debug mode calls a callback slow from the same figure.
BLOCKING_SECONDS = 0.1


class UnknownEnvironment(ValueError):
    """A sample (or the settings) names an environment that is not registered, or names it badly."""


@attrs.frozen
class Choice:
    """The environment a sample asked for: `name` (None: the default), its `args` for `start`."""

    name: str | None
    args: Mapping[str, Any] = attrs.field(factory=dict)


DEFAULT = Choice(None)


def read_choice(metadata: Any) -> Choice:
    """The environment a sample's metadata names (`metadata["environment"]`).

    Absent or None: the default (`engine_environment`). A name; `{"name": NAME, "args": {...}}`;
    or "none" for no environment (a plain tool task, whatever the default). Anything else raises
    UnknownEnvironment saying what is accepted.
    """
    value = metadata.get(KEY) if isinstance(metadata, Mapping) else None
    if value is None:
        return DEFAULT
    if isinstance(value, str) and value:
        return Choice(value)
    if isinstance(value, Mapping) and isinstance(value.get("name"), str) and value["name"]:
        extra = set(value) - {"name", "args"}
        args = value.get("args")
        if not extra and (args is None or isinstance(args, Mapping)):
            return Choice(value["name"], dict(args or {}))
    raise UnknownEnvironment(f"metadata['{KEY}'] must be an environment's name, {{\"name\": ..., \"args\": {{...}}}} "
                             f"or \"{envs.NONE}\"; got {str(value)[:80]!r}")


def set_up(cfg: EngineConfig, profile: Profile, name: str, http: Any = None) -> Any:
    """The environment registered as `name`, set up for one runtime, with the runtime's HTTP client
    (`engine.sglang.client.ServiceClient`) when its `setup` takes `http`.

    Raises UnknownEnvironment naming the registered ones for an unknown name, ValueError for a
    profile that cannot render a user turn, and whatever the environment's `setup` raises.
    """
    env = envs.get_environment(name)
    if env is None:
        known = ", ".join(envs.environment_names()) or "none"
        raise UnknownEnvironment(f"unknown environment {name!r}: registered are {known}; "
                                 "name the module that registers it in engine_tool_modules")
    if not callable(getattr(profile, "user_turn_ids", None)):
        raise ValueError(f"the {profile.name} profile cannot append an environment's reply as a user turn")
    return cfg.set_up(env, http=http) if takes_http(env.setup) else cfg.set_up(env)


def takes_http(setup: Callable[..., Any]) -> bool:
    """Whether an environment's `setup` takes `http` (one written before it was offered does not)."""
    try:
        parameters = inspect.signature(setup).parameters
    except (TypeError, ValueError):  # a builtin or a C callable: offer nothing
        return False
    return "http" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


@attrs.define(eq=False)
class Environments:
    """The environments one runtime set up, by name; the default (`engine_environment`) first, at start."""

    cfg: EngineConfig
    profile: Profile
    http: Any = None  # the runtime's client for the environments' services (`ServiceClient`)
    default: Any = None
    _ready: dict[str, Any] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if self.cfg.environment is not None:  # a bad default is one error at start, not one per sample
            try:
                self.default = self.get(self.cfg.environment)
            except UnknownEnvironment as exc:
                raise UnknownEnvironment(f"{exc} (engine_environment)") from None

    def get(self, name: str) -> Any:
        """The environment `name`, set up for this runtime on first use."""
        env = self._ready.get(name)
        if env is None:
            env = self._ready[name] = set_up(self.cfg, self.profile, name, self.http)
        return env

    def chosen(self, choice: Choice) -> Any:
        """The environment a sample's choice names (None: none). Raises as `set_up` does."""
        if choice.name is None:
            return self.default
        if choice.name == envs.NONE:
            return None
        return self.get(choice.name)

    async def aclose(self) -> None:
        """Close every environment set up here (each once, whatever the others do)."""
        ready, self._ready = list(self._ready.values()), {}
        for env in ready:
            try:
                await env.aclose()
            except Exception as exc:  # one environment's close must not keep the others open
                log.warning("closing environment %s: %s: %s", getattr(env, "name", env), type(exc).__name__, exc)


# -- calling an environment --------------------------------------------------------------------


@attrs.define(eq=False, slots=True)
class Timing:
    """One call's figures: its wall time, and the longest it held the event loop at once."""

    seconds: float = 0.0
    blocked: float = 0.0


async def call(env: Any, method: str, *args: Any, timing: Timing) -> Any:
    """`env.method(*args)`, awaited: a plain function in a thread of its own, a coroutine on the
    loop with each of its steps timed (`timing.blocked`: the longest). The time is added to `timing`."""
    fn = getattr(env, method)
    started = time.perf_counter()
    try:
        if inspect.iscoroutinefunction(fn):
            return await _Stepped(fn(*args), timing)
        result = await in_thread(fn, *args)  # a plain def blocks a thread, not the loop
        if inspect.isawaitable(result):  # a plain def handing back a coroutine (a decorated method)
            result = await _Stepped(result, timing)
        return result
    finally:
        timing.seconds += time.perf_counter() - started
        if timing.blocked >= BLOCKING_SECONDS:
            name = getattr(env, "name", type(env).__name__)
            if log_once(f"environment {name}: {method} blocks the event loop", logging.DEBUG, log):  # once per method
                log.warning("environment %s: %s held the event loop for %.2f s at once, and every sample of the loop "
                            "waited (its timeout could not fire either): await its I/O, or make %s a plain def so "
                            "that it runs in a worker thread", name, method, timing.blocked, method)


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a daemon thread of its own. Not the loop's executor: a call that never returns
    (its wait cut by the timeout) must not keep the process from exiting, nor take a pooled thread."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(outcome: Any, failed: bool) -> None:
        if not done.done():
            (done.set_exception if failed else done.set_result)(outcome)

    def work() -> None:
        try:
            outcome, failed = fn(*args), False
        except BaseException as exc:  # handed to the awaiting task, as the loop's executor would
            outcome, failed = exc, True
        try:
            loop.call_soon_threadsafe(settle, outcome, failed)
        except RuntimeError:  # the loop closed while this ran: nobody is waiting any more
            pass

    threading.Thread(target=work, name=f"environment {getattr(fn, '__qualname__', fn)}", daemon=True).start()
    return await done


class _Stepped:
    """Await a coroutine as `await` would, timing each step it runs on the loop (send or throw)."""

    __slots__ = ("coro", "timing")

    def __init__(self, coro: Any, timing: Timing) -> None:
        self.coro, self.timing = coro, timing

    def __await__(self) -> Generator[Any, Any, Any]:
        steps = self.coro.__await__()
        value: Any = None
        error: BaseException | None = None
        while True:
            started = time.perf_counter()
            try:
                yielded = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as stop:
                return stop.value
            finally:
                self.timing.blocked = max(self.timing.blocked, time.perf_counter() - started)
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as exc:  # a cancellation (or any throw) goes on into the coroutine
                value, error = None, exc


# -- the conversation respond sees ------------------------------------------------------------------


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as chat messages (a text prompt is one user message); copies, so nothing is shared."""
    if isinstance(prompt, list):
        return [dict(m) for m in prompt if isinstance(m, dict)]
    return [{"role": "user", "content": str(prompt)}]


@functools.lru_cache(maxsize=8)
def _specials(tokenizer: Any) -> re.Pattern[str] | None:
    from engine.profiles.tokenizer import Codec

    return Codec(tokenizer).special_pattern


def plain(tokenizer: Any, profile: Profile, text: str) -> str:
    """A turn's text without special tokens (`<|im_end|>`), as the conversation shows it."""
    codec = getattr(profile, "codec", None)
    pattern = codec.special_pattern if codec is not None else _specials(tokenizer)
    return pattern.sub("", text) if pattern is not None else text


def assistant_message(content: str, turn: Turn | None) -> dict[str, Any]:
    """A model turn as a chat message: its text, and the calls it made (those that could be read)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = [c for c in (turn.calls if turn is not None else ()) if not c.error]
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message


def tool_messages(results: list[CallResult]) -> list[dict[str, Any]]:
    """The answers to a turn's calls as chat messages, in the turn's call order."""
    return [{"role": "tool", "name": res.call.name, "content": res.text} for res in results]


def conversation(messages: list[dict[str, Any]], prompt_ids: Any, traj: Any, decode: Callable[[list[int]], str],
                 turn: int) -> envs.Conversation:
    """What `respond` receives: fresh copies of the messages, and the token view of the trajectory now."""
    copies = tuple(copy.deepcopy(messages))  # an environment that edits them changes nothing of ours
    segments = tuple((s.kind, s.start, s.end) for s in traj.segments)
    return envs.Conversation(copies, tuple(prompt_ids), tuple(traj.response_ids.tolist()), segments, decode, turn)
