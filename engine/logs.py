"""Log lines said once per process: what every sample would otherwise repeat.

slime hands the engine thousands of samples; a setting capped, an unknown key, a tool that cannot
work would be one line per sample. `log_once` says each distinct message the first time only.
"""

from __future__ import annotations

import logging
import threading

_said: set[str] = set()
_said_lock = threading.Lock()


def log_once(message: str, level: int = logging.WARNING, logger: logging.Logger | None = None) -> bool:
    """Log `message` the first time this process sees it (on `logger`, else "engine"); True if logged."""
    with _said_lock:
        if message in _said:
            return False
        _said.add(message)
    (logger or logging.getLogger("engine")).log(level, message)
    return True


def warn_once(message: str, logger: logging.Logger | None = None) -> None:
    """A warning, once per process."""
    log_once(message, logging.WARNING, logger)


def forget() -> None:
    """Say everything again from now on (tests, which each expect their own warnings)."""
    with _said_lock:
        _said.clear()
