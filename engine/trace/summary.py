"""The summary of a batch of rollouts: statuses, reasons, turns, tools, tokens, time."""

from __future__ import annotations

import math
from collections import Counter
from statistics import mean
from typing import Any

from engine.trace.samples_file import metadata


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": 0, "mean": 0, "max": 0, "sum": 0}
    return {"min": min(values), "mean": mean(values), "max": max(values), "sum": sum(values)}


def summarize(samples: list[dict[str, Any]], wall_seconds: float = math.nan) -> dict[str, Any]:
    """Aggregate figures of sample dicts (as written by `run`, or slime's `to_dict`)."""
    metas = [metadata(s) for s in samples]
    errors: Counter[str] = Counter()
    for m in metas:
        errors.update((m.get("tool_stats") or {}).get("errors") or {})
    rewards = [r["score"] if isinstance(r, dict) else r for r in (s.get("reward") for s in samples) if r is not None]
    return {
        "samples": len(samples),
        "status": Counter(str(s.get("status")) for s in samples),
        "termination_reason": Counter(str(m.get("termination_reason")) for m in metas),
        "turns": _stats([len(m.get("turns") or []) for m in metas]),
        "tool_calls": _stats([(m.get("tool_stats") or {}).get("calls", 0) for m in metas]),
        "tool_errors": errors,
        "response_tokens": _stats([s.get("response_length") or 0 for s in samples]),
        "trained_tokens": _stats([sum(s.get("loss_mask") or []) for s in samples]),
        "generation_seconds": _stats([m.get("generation_time", 0.0) for m in metas]),
        "tool_seconds": _stats([m.get("tool_time", 0.0) for m in metas]),
        "reward": _stats([float(r) for r in rewards]),
        "wall_seconds": wall_seconds,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A plain-text table of `summarize`'s figures."""
    lines = [f"samples: {summary['samples']}   wall: {summary['wall_seconds']:.1f} s"]

    def counts(title: str, counter: Counter[str]) -> None:
        lines.append(f"{title}:")
        for key, n in counter.most_common():
            lines.append(f"  {key:<28} {n:>6}")

    counts("status", summary["status"])
    counts("termination reason", summary["termination_reason"])
    lines.append(f"{'':<22}{'min':>10}{'mean':>10}{'max':>10}{'total':>12}")
    for key in ("turns", "tool_calls", "response_tokens", "trained_tokens", "generation_seconds", "tool_seconds", "reward"):
        st = summary[key]
        lines.append(f"{key:<22}{st['min']:>10.4g}{st['mean']:>10.4g}{st['max']:>10.4g}{st['sum']:>12.6g}")
    if summary["tool_errors"]:
        counts("tool errors", summary["tool_errors"])
    return "\n".join(lines)
