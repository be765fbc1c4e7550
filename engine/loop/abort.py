"""Cooperative abort: samples between turns stop before their next generation.

A caller that is ending a rollout step (slime sets `GenerateState(args).aborted`, then
aborts the servers and waits for pending samples) should not have to wait for samples that
start new `/generate` requests. The runtime checks its own `AbortSignal` and the abort
check its creator handed in (the slime adapter's reads slime's flag).
"""

from __future__ import annotations


class AbortSignal:
    """A flag a caller raises to stop every sample of a runtime at its next turn."""

    __slots__ = ("_raised",)

    def __init__(self) -> None:
        self._raised = False

    def set(self) -> None:
        """Stop every sample of the runtime before its next generation."""
        self._raised = True

    def is_set(self) -> bool:
        return self._raised

    def clear(self) -> None:
        self._raised = False

    def __bool__(self) -> bool:
        return self._raised
