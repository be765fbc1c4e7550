"""The sandbox model-written code runs in: infrastructure no tool author needs to open.

Membership: code that contains untrusted programs (the runner, the launcher that builds the
isolation in the child, the attack suite that proves it). Tools call `run_python`.
"""

from tools.sandbox.runner import (
    LOCK_DIR,
    UID_BASE,
    UID_COUNT,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    filesystem_isolated,
    network_isolated,
    run_python,
)

__all__ = [
    "LOCK_DIR",
    "UID_BASE",
    "UID_COUNT",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "filesystem_isolated",
    "network_isolated",
    "run_python",
]
