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

from engine.config import EngineConfig, RetryPolicy
from engine.loop.driver import drive, new_rollout
from engine.loop.runtime import Runtime
from engine.machine.rollout import Rollout
from engine.machine.states import State, Trigger
from engine.machine.table import MachineSpec, get_machine
from engine.machine.trajectory import InvariantViolation, LossMask, Trajectory

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
