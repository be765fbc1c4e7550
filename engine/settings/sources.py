"""Where settings come from: slime's `args`, and the YAML of `--custom-config-path` that fills them.

slime hands a generate function its argparse namespace; the keys of `--custom-config-path` YAML
become attributes of it (`python -m engine run` builds the same namespace from `--config` and its
flags). `read(cls, args)` builds a declared settings class from it: each field from its key, through
the class's own conversion and checks. An `engine_*` key that nothing declares is warned about once,
with the closest declared key (slime's own keys are not the engine's to judge); in `run --config`
every key is the engine's, so any unknown one is.
"""

from __future__ import annotations

import argparse
import difflib
import types
from collections.abc import Iterable
from typing import Any

import attrs

from engine.settings.declare import NESTED, ROW, SettingsError, declared_keys

ENGINE_PREFIX = "engine_"


def read(cls: type, args: Any, **given: Any) -> Any:
    """An instance of the settings class `cls` from the keys of `args` (absent or None: the default);
    `given` fields are passed as they are. Raises SettingsError naming the first unusable key."""
    values: dict[str, Any] = {}
    for f in attrs.fields(cls):
        if f.name in given:
            continue
        if ROW in f.metadata and f.metadata[ROW].key:
            values[f.name] = getattr(args, f.metadata[ROW].key, None)
        elif NESTED in f.metadata:
            values[f.name] = read(f.metadata[NESTED], args)
    return cls(**values, **given)


# -- unknown keys -----------------------------------------------------------------------------


def closest_key(key: str, known: Iterable[str]) -> str | None:
    """The known key `key` most likely misspells, or None."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_engine_keys(keys: Iterable[str]) -> dict[str, str | None]:
    """`engine_*` keys nothing declares, each with the closest declared key (or None).

    For slime's namespace: slime's own keys (hundreds) are not the engine's to judge.
    """
    declared = declared_keys()
    known = [k for k in declared if k.startswith(ENGINE_PREFIX)]
    return {key: closest_key(key, known) for key in keys if key.startswith(ENGINE_PREFIX) and key not in declared}


def unknown_keys(keys: Iterable[str]) -> dict[str, str | None]:
    """Every key nothing declares, each with the closest declared key: for `run --config`,
    where every key is the engine's (nothing but `run` reads that YAML)."""
    declared = declared_keys()
    return {key: closest_key(key, declared) for key in keys if key not in declared}


def unknown_key_message(key: str, closest: str | None) -> str:
    """The warning for a key nothing reads."""
    hint = f"; did you mean {closest}?" if closest else ""
    what = "engine setting" if key.startswith(ENGINE_PREFIX) else "setting"
    return f"unknown {what} {key} (ignored){hint}"


def namespace_keys(args: Any) -> list[str]:
    """The keys an args object holds (its dict, else its public attributes)."""
    try:
        return list(vars(args))
    except TypeError:
        return [k for k in dir(args) if not k.startswith("_")]


# -- remembering what was read ----------------------------------------------------------------------

_PLAIN_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)


def args_key(args: Any, keys: tuple[str, ...]) -> Any | None:
    """What a read of `keys` from `args` is remembered by: the object and the value (and type) of every
    key; None when a value has no exact key (then nothing is remembered: an id could be reused by another value).

    Built in C where it can (the namespace's dict, `map`): slime asks once per sample.
    """
    if type(args) in _PLAIN_NAMESPACES:  # every attribute is in its __dict__
        values = tuple(map(vars(args).get, keys))
    else:
        values = tuple(getattr(args, key, None) for key in keys)
    kinds = tuple(map(type, values))  # 1, 1.0 and True stay apart: they read differently
    try:
        if list in kinds or tuple in kinds:  # engine_tools from YAML: item by item, with their types
            return (id(args), keys, tuple(map(_hashable, values)))
        key = (id(args), keys, values, kinds)
        hash(key)
    except TypeError:  # a value without an exact key (a dict, a set)
        return None
    return key


def _hashable(value: Any) -> Any:
    """A value as a cache key of its type and value (lists, from YAML, item by item); TypeError
    when it has none (then the settings are read afresh: an id could be reused by another value)."""
    if type(value) in (list, tuple):
        return (type(value), tuple(_hashable(v) for v in value))
    hash(value)  # TypeError for the unhashable
    return (type(value), value)  # 1, 1.0 and True stay apart: they read differently


# -- the YAML of --custom-config-path --------------------------------------------------------


def load_yaml_settings(path: str) -> dict[str, Any]:
    """The mapping in a YAML file, read as slime reads `--custom-config-path` (safe_load, {} when empty).

    Raises SettingsError for a file that cannot be read or is not a mapping of names.
    """
    try:
        import yaml  # PyPI: PyYAML (comes with transformers); only the command line needs it
    except ImportError:
        raise SettingsError("reading a YAML config needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise SettingsError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise SettingsError(f"{path} is not valid YAML{at}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise SettingsError(f"{path} must hold a mapping of setting names to values, as slime's --custom-config-path")
    return data
