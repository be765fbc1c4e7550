"""The engine under a name no one else's package takes (the distribution's own name).

`engine` is a common name: a package of a user's called `engine` beside their script, or on
`PYTHONPATH`, takes it, and `import engine.slime` then fails deep in slime with "No module named
'engine.slime'", which names nothing. Importing this module instead checks that `engine` is the
package installed beside it and otherwise stops with one line naming the path that took the name:

    --custom-generate-function-path fsm_rollout_engine.generate
    --custom-rm-path fsm_rollout_engine.reward_func
    --custom-rollout-log-function-path fsm_rollout_engine.log_rollout

The `fsm-rollout` console script starts here too.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

_OURS = Path(__file__).resolve().parent / "engine"


class EngineShadowed(ImportError):
    """The name `engine` belongs to another package than fsm-rollout-engine's."""


def _where(module: Any) -> str:
    file = getattr(module, "__file__", None)
    if file:
        return str(Path(file).resolve().parent)
    paths = list(getattr(module, "__path__", []) or [])
    return str(paths[0]) if paths else repr(module)


def check_engine() -> None:
    """Raise EngineShadowed (one line) unless `import engine` gives the engine installed beside this module."""
    try:
        engine = importlib.import_module("engine")
    except ImportError as exc:
        raise EngineShadowed(f"fsm-rollout-engine: cannot import its package 'engine' ({exc})") from None
    file = getattr(engine, "__file__", None)
    if file is None or Path(file).resolve().parent != _OURS:
        raise EngineShadowed(
            f"fsm-rollout-engine: the name 'engine' is taken by {_where(engine)} (not this engine's {_OURS}); "
            "rename that package or run from another directory"
        ) from None


check_engine()

from engine.slime import generate, log_rollout, reward_func  # noqa: E402


def main() -> int:
    """The `fsm-rollout` console script: `python -m engine`'s commands."""
    from engine.cli import main as cli_main

    return cli_main(sys.argv[1:])


__all__ = ["EngineShadowed", "check_engine", "generate", "log_rollout", "main", "reward_func"]
