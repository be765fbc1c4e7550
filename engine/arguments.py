"""argparse types shared by the commands (`run`, `serve`, ...): each failure names what is allowed."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole(low: int) -> Callable[[str], int]:
    """argparse type: a whole number >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}")
        return value

    parse.__name__ = "whole number"
    return parse


def number(low: float, *, above: bool = False, high: float | None = None) -> Callable[[str], float]:
    """argparse type: a finite number >= low (> low with `above`), <= high when given."""
    words = f"{'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value > low if above else value >= low) and (high is None or value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a number {words}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def names(text: str) -> list[str]:
    """argparse type: a comma-separated list of names."""
    items = [n.strip() for n in text.split(",") if n.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"must be one or more comma-separated names, got {text!r}")
    return items
