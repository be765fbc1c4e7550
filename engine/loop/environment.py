"""Setting up the environment a runtime's samples talk to (`engine_environment`; see `engine.envs`)."""

from __future__ import annotations

from typing import Any

from engine import envs
from engine.settings import EngineConfig
from engine.profiles import Profile


def set_up_environment(cfg: EngineConfig, profile: Profile) -> Any:
    """The environment `engine_environment` names, set up for one runtime; None when none is chosen.

    Raises ValueError naming the registered ones for an unknown name, and for a profile that
    cannot render a user turn.
    """
    if cfg.environment is None:
        return None
    env = envs.get_environment(cfg.environment)
    if env is None:
        known = ", ".join(envs.environment_names()) or "none"
        raise ValueError(f"unknown environment {cfg.environment!r} (engine_environment): registered are {known}; "
                         "name the module that registers it in engine_tool_modules")
    if not callable(getattr(profile, "user_turn_ids", None)):
        raise ValueError(f"the {profile.name} profile cannot append an environment's reply as a user turn")
    return cfg.set_up(env)
