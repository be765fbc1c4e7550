"""The summary of a batch of rollouts: statuses, reasons, turns, tools, tokens, time, and what went wrong.

Besides the figures, it names the most common error texts (what tools answered with,
what ended samples, how many requests were retried), warns when most tool calls failed
the same way, and says when a batch is a failure as a whole (every sample, or every tool
call, failed): `run` then exits non-zero, so a dead tool never looks like success.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from statistics import mean
from typing import Any

from engine.trace.samples_file import metadata, status_name
from engine.trace.turns import Decode, error_texts

# Error kinds given to calls answered before running (unparsable, unknown, over budget): the
# model's mistakes, not the tool's. A truncated output is a call that worked. Every other
# kind is a call that ran and failed.
PLAN_ERRORS = frozenset({"malformed_call", "unknown_tool", "surplus_call", "error"})
NOT_FAILURES = PLAN_ERRORS | {"output_truncated"}
# For the batch's promises (a warning when most calls of a tool fail the same way, exit 1 when
# every call failed), a call answered with an error without running failed too: a model that
# only calls a tool it is not offered, or only writes calls that cannot be parsed, got nothing.
NOT_ANSWERED_FAILURES = frozenset({"output_truncated"})
SHOWN_TEXTS = 5
ROW = 25  # the figures' names column: the longest, environment_turn_seconds, and a space
ENGINE_ERROR_CHARS = 120


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": 0, "mean": 0, "max": 0, "sum": 0}
    return {"min": min(values), "mean": mean(values), "max": max(values), "sum": sum(values)}


def _short(text: Any) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= ENGINE_ERROR_CHARS else text[: ENGINE_ERROR_CHARS - 1] + "…"


def summarize(samples: list[dict[str, Any]], wall_seconds: float = math.nan, *, decode: Decode | None = None,
              retries: int | None = None) -> dict[str, Any]:
    """Aggregate figures of sample dicts (as written by `run`, or slime's `to_dict`).

    With `decode` (token ids -> text) the tools' error texts are read from the observations.
    """
    metas = [metadata(s) for s in samples]
    errors: Counter[str] = Counter()
    tools_used: Counter[str] = Counter()
    per_tool: Counter[tuple[str, str | None]] = Counter()  # (tool, error kind or None) per call that ran
    for m in metas:
        errors.update((m.get("tool_stats") or {}).get("errors") or {})
        for turn in m.get("turns") or []:
            names = turn.get("tools") or []
            tools_used.update(name for name in names if name)
            kinds = turn.get("errors")  # per result, when the engine records it
            if isinstance(kinds, (list, tuple)) and len(kinds) == len(names):
                per_tool.update((n, k) for n, k in zip(names, kinds) if n)
    texts: Counter[str] = Counter()
    if decode is not None:
        for s in samples:
            texts.update(error_texts(s, decode))
    rewards = [r["score"] if isinstance(r, dict) else r for r in (s.get("reward") for s in samples) if r is not None]
    return {
        "samples": len(samples),
        "status": Counter(status_name(s) for s in samples),
        "termination_reason": Counter(str(m.get("termination_reason")) for m in metas),
        "turns": _stats([len(m.get("turns") or []) for m in metas]),
        "tool_calls": _stats([_answered_calls(m) for m in metas]),
        "tool_errors": errors,
        "tool_error_texts": texts,
        "tools_used": tools_used,
        "per_tool": per_tool,
        "engine_errors": Counter(_short(m["engine_error"]) for m in metas if m.get("engine_error")),
        "foreign_format_answers": foreign_answers(metas),
        "retries": retries,
        "response_tokens": _stats([s.get("response_length") or 0 for s in samples]),
        "trained_tokens": _stats([sum(s.get("loss_mask") or []) for s in samples]),
        "generation_seconds": _stats([m.get("generation_time", 0.0) for m in metas]),
        "tool_seconds": _stats([m.get("tool_time", 0.0) for m in metas]),
        # Only samples an environment answered: the others would pull its mean towards 0.
        "environment_seconds": _stats([m.get("environment_time") or 0.0 for m in metas if m.get("environment")]),
        "environment_turn_seconds": _stats(environment_turn_seconds(metas)),
        "environments": Counter(str(m["environment"].get("name")) for m in metas if isinstance(m.get("environment"), dict)),
        "environment_blocked": _blocked_turns(metas),
        "reward": _stats([float(r) for r in rewards]),
        "wall_seconds": wall_seconds,
    }


def environment_turn_seconds(metas: Sequence[dict[str, Any]]) -> list[float]:
    """How long the environment took to answer, per turn it answered (`turns[i]["environment_seconds"]`)."""
    return [float(t["environment_seconds"]) for m in metas for t in m.get("turns") or []
            if isinstance(t, dict) and isinstance(t.get("environment_seconds"), (int, float))]


def _blocked_turns(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Turns whose environment held the event loop (`environment_blocked_seconds`): how many, the longest, by environment."""
    out: dict[str, Any] = {}
    for m in metas:
        env = m.get("environment")
        for t in m.get("turns") or []:
            held = t.get("environment_blocked_seconds") if isinstance(t, dict) else None
            if isinstance(held, (int, float)) and isinstance(env, dict):
                name = str(env.get("name"))
                turns, longest = out.get(name, (0, 0.0))
                out[name] = (turns + 1, max(longest, float(held)))
    return out


def _answered_calls(m: dict[str, Any]) -> int:
    """Every call the model made, each answered: those that ran and those refused before running."""
    stats = m.get("tool_stats") or {}
    errors = stats.get("errors") or {}
    ran = stats.get("calls", 0)
    refused = sum(n for kind, n in errors.items() if kind in PLAN_ERRORS and isinstance(n, int))
    return (ran if isinstance(ran, int) else 0) + refused
def foreign_answers(metas: Sequence[dict[str, Any]]) -> Counter[str]:
    """Answers that look like calls of another format than configured, by that format (`metadata["fsm"]`s)."""
    return Counter(t["foreign_format"] for m in metas for t in m.get("turns") or [] if isinstance(t, dict) and t.get("foreign_format"))


def failed_calls(summary: dict[str, Any]) -> int:
    """Tool calls that ran and failed (not calls answered before running, not truncated outputs)."""
    return count_failed_calls(summary["tool_errors"])


def count_failed_calls(errors: dict[str, int]) -> int:
    """How many of these error kinds are calls that ran and failed."""
    return sum(n for kind, n in errors.items() if kind not in NOT_FAILURES)


def failed_answers(summary: dict[str, Any]) -> int:
    """Tool calls whose answer was an error, run or not (a cut output is not one)."""
    return sum(n for kind, n in summary["tool_errors"].items() if kind not in NOT_ANSWERED_FAILURES)


def warnings(summary: dict[str, Any]) -> list[str]:
    """Sentences for the reader: an environment held the event loop; most calls of a tool failed the
    same way (per tool when the turn records say which call got which error; else over all calls);
    many answers hold another format's tool call (the tool parser does not match the model)."""
    return _blocking_warnings(summary) + _tool_warnings(summary) + _foreign_warnings(summary)


def _blocking_warnings(summary: dict[str, Any]) -> list[str]:
    """Environments whose coroutines held the event loop: every sample of the loop waited."""
    return [f"environment {name} held the event loop in {n} turns (up to {longest:.2f} s at once): every sample "
            "waited; await its I/O, or make respond a plain def to run it in a thread"
            for name, (n, longest) in sorted((summary.get("environment_blocked") or {}).items())]


def _foreign_warnings(summary: dict[str, Any]) -> list[str]:
    """Many answers holding another format's call: the tool parser likely does not match the model."""
    foreign: Counter[str] = summary.get("foreign_format_answers") or Counter()
    total, samples = sum(foreign.values()), summary["samples"]
    if not total or 4 * total < samples:  # a stray one is the model's; a quarter of the samples is the setup
        return []
    family = foreign.most_common(1)[0][0]
    return [f"{total} answer(s) in {samples} samples hold what reads as a {family} tool call, which the configured "
            f"tool parser does not read: they were taken as answers and no tool ran; if the model writes its "
            f"calls that way, run with --tool-parser {family} (engine_tool_parser)"]


def _tool_warnings(summary: dict[str, Any]) -> list[str]:
    per_tool = summary.get("per_tool") or Counter()
    if per_tool:
        return _per_tool_warnings(summary, per_tool)
    return _call_warnings(summary)


def _call_warnings(summary: dict[str, Any]) -> list[str]:
    calls = int(summary["tool_calls"]["sum"])
    ran = Counter({k: n for k, n in summary["tool_errors"].items() if k not in NOT_ANSWERED_FAILURES})
    out = []
    if calls and ran:
        kind, n = ran.most_common(1)[0]
        if 2 * n > calls:
            tools = ", ".join(summary["tools_used"]) or "the tools"
            text = summary["tool_error_texts"].most_common(1)
            said = f": {text[0][0]}" if text else ""
            out.append(f"{n} of {calls} tool calls ({tools}) failed with '{kind}'{said}")
    return out


def _per_tool_warnings(summary: dict[str, Any], per_tool: Counter[tuple[str, str | None]]) -> list[str]:
    out = []
    for tool in sorted({t for t, _ in per_tool}):
        calls = sum(n for (t, _), n in per_tool.items() if t == tool)
        failed = Counter({k: n for (t, k), n in per_tool.items() if t == tool and k not in NOT_ANSWERED_FAILURES and k})
        if failed:
            kind, n = failed.most_common(1)[0]
            if 2 * n > calls:
                if kind == "unknown_tool":
                    said = ": the tool is not offered (offer it with --tools, or register it with --tool-module)"
                else:
                    text = summary["tool_error_texts"].most_common(1)
                    said = f": {text[0][0]}" if text and len(failed) == 1 and len({t for t, _ in per_tool}) == 1 else ""
                out.append(f"{n} of {calls} calls of {tool} failed with '{kind}'{said}")
    return out


def batch_failure(summary: dict[str, Any]) -> str | None:
    """Why the batch as a whole failed (every sample, or every tool call), else None."""
    n = summary["samples"]
    good = sum(summary["status"].get(s, 0) for s in ("COMPLETED", "TRUNCATED"))
    if n and not good:
        return f"every sample failed ({', '.join(f'{k} {v}' for k, v in summary['status'].most_common())})"
    calls = int(summary["tool_calls"]["sum"])
    if calls and failed_answers(summary) >= calls:
        kinds = Counter({k: n for k, n in summary["tool_errors"].items() if k not in NOT_ANSWERED_FAILURES})
        return f"every tool call failed ({calls} of {calls}: {', '.join(f'{k} {n}' for k, n in kinds.most_common())})"
    return None


def format_summary(summary: dict[str, Any]) -> str:
    """A plain-text table of `summarize`'s figures, then the errors and warnings."""
    wall = summary["wall_seconds"]
    shown = f"{wall:.1f} s" if isinstance(wall, (int, float)) and math.isfinite(wall) else "not measured"
    lines = [f"samples: {summary['samples']}   wall: {shown}"]

    def counts(title: str, counter: Counter[str], limit: int | None = None) -> None:
        lines.append(f"{title}:")
        for key, n in counter.most_common(limit):  # a long text goes last, after its count
            lines.append(f"  {key:<28} {n:>6}" if len(key) <= 28 else f"  {n:>6}  {key}")
        if limit is not None and len(counter) > limit:
            lines.append(f"  ... and {len(counter) - limit} more")

    counts("status", summary["status"])
    counts("termination reason", summary["termination_reason"])
    lines.append(f"{'':<{ROW}}{'min':>10}{'mean':>10}{'max':>10}{'total':>12}")
    shown_rows = ["turns", "tool_calls", "response_tokens", "trained_tokens", "generation_seconds", "tool_seconds", "reward"]
    if summary.get("environments"):  # over the samples an environment answered
        shown_rows[-1:-1] = ["environment_seconds", "environment_turn_seconds"]
    for key in shown_rows:
        st = summary[key]
        lines.append(f"{key:<{ROW}}{st['min']:>10.4g}{st['mean']:>10.4g}{st['max']:>10.4g}{st['sum']:>12.6g}")
    if summary.get("environments"):
        counts("environments", summary["environments"])
    if summary["tool_errors"]:
        counts("tool errors", summary["tool_errors"])
    if summary.get("tool_error_texts"):
        counts("most common tool error texts", summary["tool_error_texts"], SHOWN_TEXTS)
    if summary.get("engine_errors"):
        counts("most common engine errors", summary["engine_errors"], SHOWN_TEXTS)
    if summary.get("foreign_format_answers"):
        counts("answers that look like calls of another format", summary["foreign_format_answers"])
    if summary.get("retries") is not None:
        lines.append(f"requests retried: {summary['retries']}")
    lines += [f"warning: {w}" for w in warnings(summary)]
    return "\n".join(lines)
