"""Parsers by SGLang name: the engine's own, registered ones, and SGLang's where it is importable."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ParserRegistry(Generic[T]):
    """One kind of parser (tool-call or reasoning) by name.

    A name is looked up among the registered parsers (an object, or "module:attr" imported on
    first use), then the native ones, then SGLang's names (`bridge(name)`); each is built once.
    """

    def __init__(self, what: str, native: dict[str, Callable[[], T]], sglang_names: Callable[[], tuple[str, ...]],
                 bridge: Callable[[str], T], reserved: tuple[str, ...] = ()) -> None:
        self.what = what  # "tool parser", "reasoning parser": for the messages
        self.native = native
        self.sglang_names = sglang_names
        self.bridge = bridge
        self.reserved = reserved  # names that are no parser (`none`)
        self.registered: dict[str, T | str] = {}
        self.built: dict[str, T] = {}

    def register(self, name: str, parser: T | str, *, replace: bool = False) -> None:
        """Make `name` read with `parser` (or "module:attr" naming one)."""
        if (name in self.registered or name in self.native or name in self.reserved) and not replace:
            raise ValueError(f"a {self.what} named {name!r} is already registered")
        self.registered[name] = parser
        self.built.pop(name, None)

    def native_names(self) -> tuple[str, ...]:
        """The names read without SGLang, sorted."""
        return tuple(sorted(set(self.native) | set(self.registered) | set(self.reserved)))

    def names(self) -> tuple[str, ...]:
        """Every name accepted here: native, registered, and SGLang's where importable."""
        return tuple(sorted(set(self.native_names()) | set(self.sglang_names())))

    def get(self, name: str) -> T:
        """The parser of `name`; ValueError (one line listing the known names) otherwise."""
        parser = self.built.get(name)
        if parser is not None:
            return parser
        if name in self.registered:
            entry = self.registered[name]
            if isinstance(entry, str):
                module, _, attr = entry.partition(":")
                entry = getattr(importlib.import_module(module), attr)
                entry = entry() if isinstance(entry, type) else entry
            parser = entry  # type: ignore[assignment]
        elif name in self.native:
            parser = self.native[name]()
        elif name in self.sglang_names():
            parser = self.bridge(name)
        else:
            more = "" if self.sglang_names() else " (SGLang's other names need sglang importable)"
            raise ValueError(f"unknown {self.what} {name!r}: known are {', '.join(self.names())}{more}")
        self.built[name] = parser  # type: ignore[assignment]
        return parser  # type: ignore[return-value]
