"""The retool reward: the last `\\boxed{}` answer checked against the label, a tool-use nudge."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, braces balanced; None if there is none."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_DROP = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\$|\\text\{\s*\}|\s+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def normalize_answer(answer: str) -> str:
    """A canonical form for comparing math answers: spacing, delimiters and \\dfrac forms removed."""
    s = _DROP.sub("", answer.strip())
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.rstrip(".").replace("{", "").replace("}", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", s):  # 12,345 -> 12345
        s = s.replace(",", "")
    return s


def _as_number(s: str) -> Fraction | None:
    m = re.fullmatch(r"\(?(-?\d+(?:\.\d+)?)\)?(?:/\(?(-?\d+(?:\.\d+)?)\)?)?", s)
    if not m:
        return None
    try:
        value = Fraction(m.group(1))
        return value / Fraction(m.group(2)) if m.group(2) else value
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, label: str) -> bool:
    """True when the two answers are the same string or the same number once normalized."""
    a, b = normalize_answer(predicted), normalize_answer(label)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and x == y


def retool_score(response: str, label: Any, tool_calls: int) -> dict[str, Any]:
    """+1 for a right boxed answer, -1 otherwise; a wrong one gains 0.05 per tool call past 2, capped at -0.6."""
    pred = last_boxed(response[-300:] if len(response) > 300 else response)
    correct = pred is not None and label is not None and answers_match(pred, str(label))
    score = 1.0 if correct else -1.0
    if score < 0:
        score = min(-0.6, score + (tool_calls - 2) / 2 * 0.1)
    return {"score": score, "acc": correct, "pred": pred or ""}
