"""The benchmark's table and JSON: one row per figure, value next to floor, verdict against target."""

from __future__ import annotations

import json
import math
from typing import Any

from engine.local.bench.common import Figure


def _num(x: float | None, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if unit == "B":
        return f"{x / 1024:,.0f} KiB" if x < 1 << 20 else f"{x / (1 << 20):,.2f} MiB"
    if abs(x) >= 1000:
        text = f"{x:,.0f}"
    elif abs(x) >= 10:
        text = f"{x:.1f}"
    else:
        text = f"{x:.2f}"
    return f"{text} {unit}".strip()


def _target(f: Figure) -> str:
    if f.target_on is None or f.threshold is None:
        return "(info)"
    threshold = _num(f.threshold, f.unit) if f.target_on == "value" else f"{f.threshold:g}"
    return f"{'ratio' if f.target_on == 'ratio' else 'value'} {f.op} {threshold}"


def _verdict(f: Figure) -> str:
    return {True: "PASS", False: "MISS", None: "info"}[f.passed]


def format_table(figures: list[Figure], header: dict[str, Any]) -> str:
    """A fixed-width table, then the details a reader needs to trust each row."""
    rows = [("#", "figure", "value", "floor", "ratio", "target", "result", "n")]
    for f in figures:
        rows.append((str(f.number or "-"), f.title, _num(f.value, f.unit), f"{_num(f.floor, f.unit)} ({f.floor_label})",
                     "-" if f.ratio is None else f"{f.ratio:.2f}", _target(f), _verdict(f), str(f.repeats)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = [" ".join(f"{k}={v}" for k, v in header.items() if not isinstance(v, dict)),
           "seconds per figure: " + ", ".join(f"{k} {v}" for k, v in header.get("seconds", {}).items()), "", *lines, "",
           "# = figure number; n = repeats whose median is shown (figure 4: calls, p50 of them; figures 5 and 9's memory: one pass)."]
    for f in figures:
        if f.notes:
            out.append(f"  {f.key}: {json.dumps(f.notes, default=_round)}")
    return "\n".join(out)


def _round(x: Any) -> Any:
    return round(x, 3) if isinstance(x, float) else str(x)


def to_json(figures: list[Figure], header: dict[str, Any]) -> str:
    return json.dumps({"meta": header, "figures": [f.to_json() for f in figures],
                       "all_pass": all(f.passed is not False for f in figures)}, indent=2, default=_round)
