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

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

# The face is loaded on first use (PEP 562): `engine.tools`, which a sandbox host or a tool
# author's module imports, must not pull in the engine's client, the machine and their dependencies.
_FACE = {
    "EngineConfig": "engine.config",
    "RetryPolicy": "engine.config",
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

if _TYPE_CHECKING:
    from engine.config import EngineConfig, RetryPolicy
    from engine.loop.runtime import Runtime
    from engine.profiles import Profile, register_profile
    from engine.rollouts import roll_out, roll_out_all, sampling_params
    from engine.slime import generate, log_rollout, reward_func


def __getattr__(name: str) -> _Any:
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FACE))

__all__ = [
    "EngineConfig",
    "Profile",
    "RetryPolicy",
    "Runtime",
    "generate",
    "log_rollout",
    "register_profile",
    "reward_func",
    "roll_out",
    "roll_out_all",
    "sampling_params",
]
