"""The machine: pure and synchronous; the table, its guards and actions, and what they move.

Membership: code that decides or records a sample's path and changes its per-token arrays,
with no I/O and no `await` (the loop does those between triggers). A new state, edge or
guard is added here (a state's step, when it does I/O, is the loop's: docs/machine.md,
"Adding a state"); nothing here knows slime, HTTP or a tool's implementation.
"""

from engine.machine.rollout import Rollout
from engine.machine.table import MachineSpec, RolloutMachine, get_machine
from engine.machine.trajectory import InvariantViolation, Trajectory

__all__ = ["InvariantViolation", "MachineSpec", "Rollout", "RolloutMachine", "Trajectory", "get_machine"]
