"""The sandbox model-written code runs in: infrastructure no tool author needs to open.

Membership: code that contains untrusted programs (the runner, its zygote and the zygote's
forker, the child that builds the isolation, the Landlock rules and the seccomp allowlist, the
probe that checks it works here, the attack suite that proves it). Tools call `run_python`; the
engine calls `probe()` before rolling out.
"""

from engine.sandbox.probing import SandboxProbe, probe, probe_sync
from engine.sandbox.runner import (
    LOCK_DIR,
    UID_BASE,
    UID_COUNT,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    capabilities,
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
    "SandboxProbe",
    "SandboxResult",
    "capabilities",
    "filesystem_isolated",
    "network_isolated",
    "probe",
    "probe_sync",
    "run_python",
]
