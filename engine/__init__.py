"""A state-machine multi-turn rollout engine for LLM RL with tool calls: the library's face.

Each sample walks one explicit machine (RESET, RESUME, BUDGET_CHECK, GENERATE, TOOL_CALL,
a state per registered tool, TRIM, and the terminals COMPLETED, TRUNCATED, ABORTED, FAILED).

What users call, by who they are:

- slime: `generate`, `reward_func`, `log_rollout` (also as `engine.slime.*`, the paths slime's
  `--custom-*-path` flags name);
- without slime: `EngineConfig` (the settings), `Runtime` (what samples share; an async context
  manager), `roll_out` / `roll_out_all` (a prompt in, a slime-shaped sample out, with the attempts
  policy), `sampling_params`; see docs/without-slime.md;
- tool authors: `engine.tools` (`@tools.tool`, `tools.Tool`, `tools.ToolError`, ...);
- format authors: `register_profile` and `Profile`.

The packages, each with its rule of membership in its own docstring: `engine.machine` (the
pure table), `engine.loop` (the async side), `engine.sglang` (the client of SGLang's
`/generate`), `engine.profiles` (formats), `engine.slime` (the adapter), `engine.trace`
(looking back), `engine.local` (stand-ins for slime and a GPU). What they hold beyond this face
is internal and may change.
"""

import importlib
import importlib.util
import typing

# Each name of the face and the module it lives in, imported on first use: `import engine.tools`
# (the tool author's package, which the sandbox's own processes import) then loads nothing more
# of the engine, and `import engine` stays cheap.
_FACE = {
    "EngineConfig": "engine.settings",
    "RetryPolicy": "engine.settings",
    "Runtime": "engine.loop.runtime",
    "Profile": "engine.profiles",
    "register_profile": "engine.profiles",
    "roll_out": "engine.rollouts",
    "roll_out_all": "engine.rollouts",
    "sampling_params": "engine.rollouts",
    "generate": "engine.slime",
    "log_rollout": "engine.slime",
    "reward_func": "engine.slime",
}
__all__ = sorted(_FACE)

if typing.TYPE_CHECKING:
    from engine.settings import EngineConfig, RetryPolicy  # noqa: F401
    from engine.loop.runtime import Runtime  # noqa: F401
    from engine.profiles import Profile, register_profile  # noqa: F401
    from engine.rollouts import roll_out, roll_out_all, sampling_params  # noqa: F401
    from engine.slime import generate, log_rollout, reward_func  # noqa: F401


def __getattr__(name: str) -> typing.Any:
    module = _FACE.get(name)
    if module is None:  # `engine.tools` and the other packages, as attributes, imported on first use
        if not name.startswith("_") and importlib.util.find_spec(f"engine.{name}") is not None:
            return importlib.import_module(f"engine.{name}")
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
