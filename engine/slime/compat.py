"""slime's private names, in one place: what the adapter reads of slime that slime does not publish.

One today: whether slime is aborting the rollout step. slime's `abort()` sets `aborted` on its
`GenerateState`, a singleton made by `slime.utils.misc.SingletonMeta`; the public way to reach
it, `GenerateState(args)`, *builds* the state (a tokenizer, a semaphore) when none exists yet,
so the adapter looks the instance up in the singleton's registry instead, the private
`_instances`, read the way `SingletonMeta.__call__` reads it (`cls._instances`: the class's own
after `SingletonMeta.clear_instances(cls)`, else the metaclass's).

Checked against (tests/slime/test_compat.py, one test per shape): slime 0.1.0 to 0.2.3 (the
registry on the metaclass only) and 0.2.4 to 0.3.1 and its main of 2026-08 (`clear_instances`
gives a class its own). A slime whose `GenerateState` has no such registry is told once, by a
warning, that the engine cannot see its abort: samples then stop at slime's abort of the
request (the server's `abort` finish) rather than between turns.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

ROLLOUT_MODULE = "slime.rollout.sglang_rollout"
CHECKED = "slime 0.1.0 to 0.3.1"
_warned: set[str] = set()


def generate_state() -> Any | None:
    """slime's `GenerateState` singleton if slime has made it, without making it; None otherwise.

    A dict lookup when slime is not loaded (the common case outside a slime job).
    """
    module = sys.modules.get(ROLLOUT_MODULE)
    if module is None:
        return None
    cls = getattr(module, "GenerateState", None)
    if cls is None:
        return None
    registry = getattr(cls, "_instances", None)
    if not isinstance(registry, dict):
        _warn_once(f"slime's GenerateState has no singleton registry (_instances): the engine cannot see "
                   f"slime's abort between turns (checked with {CHECKED})")
        return None
    return registry.get(cls)


def aborting() -> bool:
    """True while slime's rollout is aborting the step (its `GenerateState.aborted`)."""
    return bool(getattr(generate_state(), "aborted", False))


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        log.warning("%s", text)
