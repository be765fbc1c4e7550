"""A state-machine multi-turn rollout engine for LLM RL with tool calls: the library's face.

Each sample walks one explicit machine (RESET, RESUME, BUDGET_CHECK, GENERATE, TOOL_CALL,
a state per registered tool, TRIM, and the terminals COMPLETED, TRUNCATED, ABORTED,
FAILED); its per-token arrays live in one `Trajectory` that keeps them aligned. slime uses
`engine.slime.generate`; this face is for driving the engine without slime. A trajectory's loss
mask is a `LossMask` (its runs of ones; `tolist()` gives one 0 or 1 per token).

The packages, each with its rule of membership in its own docstring: `engine.machine` (the
pure table), `engine.loop` (the async side), `engine.sglang` (the client of SGLang's
`/generate`), `engine.profiles` (formats), `engine.slime` (the adapter), `engine.trace`
(looking back), `engine.local` (stand-ins for slime and a GPU).
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

# The face is loaded on first use (PEP 562): `engine.tools`, which a sandbox host or a bare
# interpreter imports, must not pull in the engine's client, the machine and their dependencies.
_FACE = {
    "EngineConfig": "engine.config",
    "RetryPolicy": "engine.config",
    "drive": "engine.loop.driver",
    "new_rollout": "engine.loop.driver",
    "Runtime": "engine.loop.runtime",
    "Rollout": "engine.machine.rollout",
    "State": "engine.machine.states",
    "Trigger": "engine.machine.states",
    "MachineSpec": "engine.machine.table",
    "get_machine": "engine.machine.table",
    "InvariantViolation": "engine.machine.trajectory",
    "LossMask": "engine.machine.trajectory",
    "Trajectory": "engine.machine.trajectory",
}

if _TYPE_CHECKING:
    from engine.config import EngineConfig, RetryPolicy
    from engine.loop.driver import drive, new_rollout
    from engine.loop.runtime import Runtime
    from engine.machine.rollout import Rollout
    from engine.machine.states import State, Trigger
    from engine.machine.table import MachineSpec, get_machine
    from engine.machine.trajectory import InvariantViolation, LossMask, Trajectory


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
    "InvariantViolation",
    "LossMask",
    "MachineSpec",
    "RetryPolicy",
    "Rollout",
    "Runtime",
    "State",
    "Trajectory",
    "Trigger",
    "drive",
    "get_machine",
    "new_rollout",
]
