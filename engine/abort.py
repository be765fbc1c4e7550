"""Cooperative abort: samples between turns stop before their next generation.

slime marks a rollout step as aborting with `GenerateState(args).aborted = True` (then
aborts the servers and waits for pending samples). A sample that is running tools, or
between turns, should not start a new `/generate` that slime must then wait for. The
check reads slime's flag when slime is loaded (a dict lookup), and the engine's own
`AbortSignal` otherwise; when neither is set it costs next to nothing.
"""

from __future__ import annotations

import sys


class AbortSignal:
    """A flag a caller raises to stop every sample of a runtime at its next turn."""

    __slots__ = ("_raised",)

    def __init__(self) -> None:
        self._raised = False

    def raise_(self) -> None:
        self._raised = True

    def clear(self) -> None:
        self._raised = False

    def __bool__(self) -> bool:
        return self._raised


def slime_aborting() -> bool:
    """True while slime's rollout is aborting (its GenerateState singleton says so)."""
    module = sys.modules.get("slime.rollout.sglang_rollout")
    if module is None:
        return False
    cls = getattr(module, "GenerateState", None)
    instances = getattr(type(cls), "_instances", None) if cls is not None else None
    state = instances.get(cls) if isinstance(instances, dict) else None
    return bool(getattr(state, "aborted", False))
