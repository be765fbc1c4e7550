"""How a setting is declared: one attrs field, whose metadata says everything about it.

    from engine.settings import Flag, setting, settings

    @settings(prefix="engine_guess_")
    class GuessSettings:
        '''The guess environment (engine_environment: guess).'''

        tries: int = setting(3, low=1, high=100, help="guesses before the episode ends", flag=Flag("--guess-tries"))

`setting(...)` makes the field and is the whole declaration: its key (the class's prefix and the
field's name, unless `key=` names another, as slime's own arguments do), its kind (read from the
annotation: int, float, bool, str, `tuple[str, ...]` for a list of names; `kind="url"` for a URL),
its default, the range it must lie in, what it means, and, where `run` offers it, its flag. A class
made by `settings` converts and checks every field on every construction, so `GuessSettings(tries=0)`
raises the same sentence as `engine_guess_tries: 0` in slime's YAML. The rest is read from the
fields (`rows`): slime's args and the YAML (`engine.settings.sources`), `run`'s flags
(`engine.cli`), docs/settings.md (`engine.settings.page`), and a default another module needs
(`attrs.fields(EngineConfig).tool_timeout.default`).

A value computed from other settings when its own is unset is `setting(derive=...)` (or, without a
key of its own, `derived(...)`); a group of settings read together is `nested(cls)`. A class
declared with a prefix is a plugin's (a tool's, an environment's, ...): from its module's import on
its keys are read, not warned about, and the plugin gets the instance in `setup` (`plugins()`).
"""

from __future__ import annotations

import math
import threading
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import attrs

from engine.logs import warn_once

T = TypeVar("T")

_DECLARATION, ROW, NESTED = "engine.setting", "engine.setting.row", "engine.setting.nested"
URL = "url"  # a kind: an http(s) URL, kept without its trailing slash
NAMES = "names"  # a kind: a list of names, or one comma-separated string (`tuple[str, ...]`)


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the key and what is allowed."""


@attrs.frozen
class Flag:
    """How `python -m engine run` offers a setting on its command line.

    `help` and `unset` are `run`'s own words where they differ from the setting's (what the option
    means to a person at a terminal; what `run` does when neither the flag nor the YAML sets it).
    `group`: the section of `run --help` (a plugin's flags: its title). `repeatable`: the flag may
    be given once per item (`--tool-module`).
    """

    name: str
    metavar: str = "N"
    group: str | None = None
    help: str | None = None
    unset: str | None = None
    repeatable: bool = False
    dest: str | None = None

    @property
    def destination(self) -> str:
        """The attribute of `run`'s parsed arguments."""
        return self.dest or self.name.lstrip("-").replace("-", "_")


@attrs.frozen
class Kind:
    """A kind of value of a plugin's own (a server entry, a schedule): `convert` reads a value (raising
    TypeError or ValueError saying why not), `allowed` says what it accepts. `quote`: whether a refusal
    may show the value; a kind whose values may hold a secret says False, and its refusal gives
    `convert`'s reason instead."""

    allowed: str
    convert: Callable[[Any], Any] = attrs.field(eq=False)
    quote: bool = True


@attrs.frozen
class Setting:
    """One declared setting, as its field's metadata holds it (made by `settings` from `setting(...)`).

    `key`: what slime's args and the YAML call it (None: a value derived from other settings, with
    no key of its own). `kind` is int, float, bool, str, NAMES, URL or a `Kind`. Numbers must lie in
    [low, high] (`above_low`: low itself is refused, a timeout of 0); with `cap` a number above
    `high` is lowered to it with a warning instead of refused. `choices` limits a str. None means
    the default (`derive` first, when there is one: the value computed from the settings declared
    before it); for a setting whose default is None an empty text means None too. `unset` says in
    words what None means. `run_default`: `run`'s own default where it differs (a person is
    waiting: fewer connections and retries).
    """

    name: str
    key: str | None
    kind: Any
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    cap: bool = False
    choices: tuple[str, ...] | None = None
    above_low: bool = False
    unset: str | None = None
    flag: Flag | None = None
    run_default: Any = None
    derive: Callable[[Any], Any] | None = attrs.field(default=None, eq=False)

    @property
    def label(self) -> str:
        """How messages name it: its key, or the field's name for a derived value."""
        return self.key or self.name

    def allowed(self) -> str:
        """What the setting accepts, in words."""
        if isinstance(self.kind, Kind):
            return self.kind.allowed
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.kind is bool:
            return "true or false"
        if self.kind == NAMES:
            return "a list of names (or one comma-separated string)"
        if self.kind == URL:
            return "an http:// or https:// URL"
        what = "a whole number" if self.kind is int else "a number" if self.kind is float else "text"
        if self.low is not None and self.high is not None and not self.cap:
            if self.above_low:
                return f"{what} > {number_text(self.low)} and <= {number_text(self.high)}"
            return f"{what} from {number_text(self.low)} to {number_text(self.high)}"
        if self.low is not None:
            return f"{what} {'>' if self.above_low else '>='} {number_text(self.low)}"
        return what

    def refuse(self, value: Any) -> NoReturn:
        """Raise the one sentence that names the key, what it allows and what it got."""
        raise SettingsError(f"{self.label} must be {self.allowed()}, got {value!r}")

    def convert(self, value: Any) -> Any:
        """`value` as the setting's kind (None and, with a None default, empty text: the default); range not checked.

        An empty list stays empty: `engine_tools: []` offers no tool (an environment-only episode).
        """
        if value is None:
            return self.default
        try:
            converted = self.kind.convert(value) if isinstance(self.kind, Kind) else _CONVERT[self.kind](value)
        except (TypeError, ValueError) as exc:
            if isinstance(self.kind, Kind) and not self.kind.quote:  # the value may hold a secret: say why, not what
                raise SettingsError(f"{self.label}: {exc}") from None
            self.refuse(value)
        if self.default is None and converted == "":
            return None
        return converted

    def fits(self, value: Any) -> bool:
        """Whether a converted value is in range (above a cap counts: it is usable, and lowered when read)."""
        if value is None:
            return True
        if self.choices and value not in self.choices:
            return False
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.low is not None and (value <= self.low if self.above_low else value < self.low):
                return False
            if self.high is not None and value > self.high and not self.cap:
                return False
        return True

    def read(self, value: Any) -> Any:
        """The value converted and checked (a capped one lowered, with one warning); raises SettingsError."""
        converted = self.convert(value)
        if not self.fits(converted):
            self.refuse(value)
        if self.cap and self.high is not None and isinstance(converted, (int, float)) and converted > self.high:
            warn_once(f"{self.label}={value!r} is more than the engine uses; capped at {number_text(self.high)}")
            converted = type(converted)(self.high)
        return converted

    def default_text(self, for_run: bool = False) -> str:
        """The default in words: the value, or what leaving it unset means."""
        if for_run and self.flag is not None and self.flag.unset is not None:
            return self.flag.unset
        default = self.run_default if for_run and self.run_default is not None else self.default
        if default is None or default == ():
            return self.unset or "none"
        if isinstance(default, bool):
            return "true" if default else "false"
        if isinstance(default, int) and default >= 1 << 20 and default & (default - 1) == 0:
            text = f"2^{default.bit_length() - 1}"
        else:
            text = number_text(default) if isinstance(default, (int, float)) else str(default)
        return f"{self.unset}, else {text}" if self.derive is not None and self.unset else text


def number_text(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) and not x.is_integer() else f"{int(x)}"


# -- reading a value as its kind ----------------------------------------------------------------


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a count")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not whole")
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    if isinstance(value, int):
        return value
    raise TypeError(type(value).__name__)


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("a bool is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("not finite")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _names(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(n, str) for n in items):
        raise TypeError("not a list of names")
    return tuple(n.strip() for n in items if n.strip())


def _url(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")) or len(value) < 10:
        raise ValueError("not an http(s) URL")
    return value.rstrip("/")


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("not text")
    return value


_CONVERT: dict[Any, Callable[[Any], Any]] = {int: _int, float: _float, bool: _bool, str: _str, NAMES: _names, URL: _url}
_KINDS = {"int": int, "float": float, "bool": bool, "str": str, "tuple[str,...]": NAMES}


def _kind_of(annotation: Any, where: str) -> Any:
    """The kind a field's annotation names (`int | None` is int, `tuple[str, ...]` NAMES)."""
    if isinstance(annotation, str):
        parts = [p for p in annotation.replace(" ", "").split("|") if p != "None"]
        if len(parts) == 1 and parts[0] in _KINDS:
            return _KINDS[parts[0]]
    else:
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            options = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = options[0] if len(options) == 1 else annotation
        if annotation in (int, float, bool, str):
            return annotation
        if typing.get_origin(annotation) is tuple and typing.get_args(annotation) == (str, ...):
            return NAMES
    raise TypeError(f"{where}: no setting kind for the annotation {annotation!r}; declare kind=")


# -- declaring ----------------------------------------------------------------------------------


def setting(default: Any = None, *, help: str, key: str | None = None, kind: Any = None, low: float | None = None,
            high: float | None = None, cap: bool = False, above_low: bool = False, choices: tuple[str, ...] | None = None,
            unset: str | None = None, flag: Flag | None = None, run_default: Any = None,
            derive: Callable[[Any], Any] | None = None) -> Any:
    """A field of a `settings` class that declares one setting (see the module docstring and `Setting`)."""
    declared = {"key": key, "kind": kind, "help": help, "low": low, "high": high, "cap": cap, "above_low": above_low,
                "choices": choices, "unset": unset, "flag": flag, "run_default": run_default, "derive": derive}
    return attrs.field(default=default, metadata={_DECLARATION: declared})


def derived(derive: Callable[[Any], Any], *, help: str, kind: Any = None, low: float | None = None,
            high: float | None = None) -> Any:
    """A value computed by `derive(settings)` from the settings declared before it, with no key of its own.

    A direct construction may give it (checked as a setting is); otherwise it is computed.
    """
    declared = {"key": False, "kind": kind, "help": help, "low": low, "high": high, "cap": False, "above_low": False,
                "choices": None, "unset": None, "flag": None, "run_default": None, "derive": derive}
    return attrs.field(default=None, metadata={_DECLARATION: declared})


def nested(cls: type, *, complete: Callable[[Any, Any], Any] | None = None) -> Any:
    """A field holding another `settings` class, read from the same keys (`complete(value, settings)`
    may fill what it leaves to the outer settings)."""

    def build(value: Any, instance: Any, field: attrs.Attribute) -> Any:  # type: ignore[type-arg]
        value = cls() if value is None else value
        if not isinstance(value, cls):
            raise SettingsError(f"{field.name} must be a {cls.__name__}, got {value!r}")
        return complete(value, instance) if complete is not None else value

    return attrs.field(factory=cls, converter=attrs.Converter(build, takes_self=True, takes_field=True),
                       metadata={NESTED: cls})


def _convert(value: Any, instance: Any, field: attrs.Attribute) -> Any:  # type: ignore[type-arg]
    """Every construction's conversion and check of a declared field (slime's args, YAML, flags, code alike)."""
    row: Setting = field.metadata[ROW]
    if value is None and row.derive is not None:
        value = row.derive(instance)
    return row.read(value)


def _binder(prefix: str, plugin: bool) -> Callable[[type, list[attrs.Attribute]], list[attrs.Attribute]]:  # type: ignore[type-arg]
    def bind(cls: type, fields: list[attrs.Attribute]) -> list[attrs.Attribute]:  # type: ignore[type-arg]
        bound = []
        for a in fields:
            declared = a.metadata.get(_DECLARATION)
            if declared is None:
                bound.append(a)
                continue
            where = f"{cls.__qualname__}.{a.name}"
            key = declared["key"]
            key = None if key is False else key or prefix + a.name
            if plugin and key is not None and not key.startswith(prefix):
                raise TypeError(f"{where}: the key {key} is not under the plugin's prefix {prefix}")
            flag = declared["flag"]
            if plugin and flag is not None and flag.group is None:
                flag = attrs.evolve(flag, group=title_of(cls))
            row = Setting(name=a.name, key=key, kind=declared["kind"] or _kind_of(a.type, where), default=a.default,
                          help=declared["help"], low=declared["low"], high=declared["high"], cap=declared["cap"],
                          choices=declared["choices"], above_low=declared["above_low"], unset=declared["unset"],
                          flag=flag, run_default=declared["run_default"], derive=declared["derive"])
            if not row.help or not row.fits(row.convert(row.default)) or row.convert(row.default) != row.default:
                raise TypeError(f"{where}: a setting needs help words and a default its own declaration allows")
            # A derived value's field defaults to None, so that every construction computes it.
            bound.append(a.evolve(converter=attrs.Converter(_convert, takes_self=True, takes_field=True),
                                  default=None if row.derive is not None else a.default, metadata={**a.metadata, ROW: row}))
        return bound

    return bind


@typing.dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(attrs.field, setting, derived, nested))
def settings(prefix: str = "", *, plugin: bool = True) -> Callable[[type[T]], type[T]]:
    """Make a class of settings: frozen attrs, keyword-only, every `setting` field converted and checked.

    A plugin's class (`plugin=True`, the default) needs a prefix of its own, `engine_<name>_`: every
    key is under it, and from now on the engine reads them (`plugins()`). The engine's own classes
    say `plugin=False`.
    """
    if plugin and not (prefix.startswith("engine_") and prefix.endswith("_") and len(prefix) > len("engine__")):
        raise TypeError(f"a plugin's settings need a prefix of their own, engine_<name>_; got {prefix!r}")

    def make(cls: type[T]) -> type[T]:
        made = attrs.frozen(kw_only=True, field_transformer=_binder(prefix, plugin))(cls)
        made.__settings_prefix__ = prefix  # type: ignore[attr-defined]
        _declare(made, plugin)
        return made

    return make


# -- what is declared -----------------------------------------------------------------------------

_lock = threading.Lock()
_owners: dict[str, type] = {}  # key -> the class declaring it
_plugins: dict[str, type] = {}  # "module.qualname" -> a plugin's settings class, in declaration order
_version = 0


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _declare(cls: type, plugin: bool) -> None:
    """Record `cls`'s keys; a key another class declares already is refused (a class declared again, as a
    reloaded module does, replaces its earlier self)."""
    global _version
    own = [f.metadata[ROW].key for f in attrs.fields(cls) if ROW in f.metadata and f.metadata[ROW].key]
    with _lock:
        for key in own:
            owner = _owners.get(key)
            if owner is not None and _name(owner) != _name(cls):
                raise TypeError(f"{key} is declared twice: by {_name(owner)} and by {_name(cls)}")
        _owners.update(dict.fromkeys(own, cls))
        if plugin:
            _plugins[_name(cls)] = cls
        _version += 1


def rows(cls: type) -> Iterator[Setting]:
    """Every setting `cls` declares, nested classes' included, in field order."""
    for f in attrs.fields(cls):
        if ROW in f.metadata:
            yield f.metadata[ROW]
        elif NESTED in f.metadata:
            yield from rows(f.metadata[NESTED])


def keyed(cls: type) -> dict[str, Setting]:
    """`cls`'s settings that have a key, by key."""
    return {row.key: row for row in rows(cls) if row.key}


def plugins() -> tuple[type, ...]:
    """Every plugin's settings class declared so far, in declaration order."""
    return tuple(_plugins.values())


def declared_keys() -> frozenset[str]:
    """Every key a settings class declares (the engine's, and the plugins' imported so far)."""
    return frozenset(_owners)


def owner(key: str) -> type | None:
    """The class that declares `key`, or None."""
    return _owners.get(key)


def read_key(key: str, value: Any) -> Any:
    """`value` read as the setting declared under `key` reads it (converted and checked)."""
    cls = _owners.get(key)
    if cls is None:
        raise KeyError(key)
    return keyed(cls)[key].read(value)


def version() -> int:
    """Moves whenever a class is declared; what is read from slime's args is remembered per version."""
    return _version


def title_of(cls: type) -> str:
    """A settings class in a few words: the first line of its docstring."""
    return (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")


def default_of(cls: type, name: str) -> Any:
    """The declared default of `cls`'s field `name` (for a module that needs it: never restate it)."""
    return getattr(attrs.fields(cls), name).metadata[ROW].default
