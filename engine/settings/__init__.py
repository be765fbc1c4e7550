"""The settings: each declared once, as an attrs field, and everything else made from the declarations.

- `engine.settings.declare`: how a setting is declared (`setting`, `settings`, `Flag`, `SettingsError`),
  the engine's and a plugin's alike;
- `engine.settings.core`: the engine's own (`EngineConfig`, `RetryPolicy`, `Sampling`);
- `engine.settings.sources`: reading them from slime's args and the YAML of `--custom-config-path`;
- `engine.settings.page`: docs/settings.md (`python -m engine settings`).

A plugin declares its settings in a class of its own under its own prefix, names it as its
`Settings`, and gets the instance in `setup`:

    from engine.settings import Flag, setting, settings

    @settings(prefix="engine_guess_")
    class GuessSettings:
        '''The guess environment.'''

        tries: int = setting(3, low=1, high=100, help="guesses before the episode ends", flag=Flag("--guess-tries"))
"""

from engine.settings.core import EngineConfig, RetryPolicy, Sampling
from engine.settings.declare import Flag, Kind, SettingsError, derived, nested, setting, settings

__all__ = ["EngineConfig", "Flag", "Kind", "RetryPolicy", "Sampling", "SettingsError", "derived", "nested", "setting", "settings"]
