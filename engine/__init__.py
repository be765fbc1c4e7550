"""A state-machine multi-turn rollout engine for LLM RL with tool calls.

Each sample walks one explicit machine (RESET, BUDGET_CHECK, GENERATE, TOOL_CALL, the
registered tools' states, TRIM, and the terminals COMPLETED, TRUNCATED, ABORTED,
FAILED); its per-token arrays live in one `Trajectory` that keeps them aligned.
"""

from engine.config import EngineConfig, RetryPolicy
from engine.loop.driver import drive, new_rollout
from engine.machine.table import MachineSpec, get_machine
from engine.machine.rollout import Rollout
from engine.loop.runtime import Runtime
from engine.machine.trajectory import InvariantViolation, Trajectory

__all__ = [
    "EngineConfig",
    "InvariantViolation",
    "MachineSpec",
    "RetryPolicy",
    "Rollout",
    "Runtime",
    "Trajectory",
    "drive",
    "get_machine",
    "new_rollout",
]
