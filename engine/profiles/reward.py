"""Rewards: the retool answer check (the last `\\boxed{}` answer against the label, a tool-use
nudge), and the declared rule that combines an episode's per-turn rewards with it (`RewardRule`)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import attrs

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


RULES = ("sum", "discounted", "last", "weighted")


@attrs.frozen
class RewardRule:
    """How an episode's rewards make the one scalar a trainer gets (`engine_reward_rule`).

    The parts: per model turn t = 1..T the reward an environment or its tools gave it, and, when
    the task has an answer to check, the answer's reward A, which belongs to the last turn T:
    - `sum`: every turn's reward, plus A;
    - `discounted`: turn t weighs `discount`^(t-1), A as turn T (an episode that succeeds in
      fewer turns scores more);
    - `last`: the last turn's reward alone, plus A (an outcome judged at the end);
    - `weighted`: `turn_weight` x the turns' sum + `answer_weight` x A.
    """

    # No defaults here: the settings declare them (engine_reward_*), once.
    name: str = attrs.field(validator=attrs.validators.in_(RULES))
    discount: float
    turn_weight: float
    answer_weight: float

    def score(self, rewards: Mapping[int, float], turns: int, answer: float | None = None) -> float:
        """The scalar of an episode of `turns` model turns, `rewards` by turn number (1-based), `answer` (None: not counted)."""
        last = max([turns, *rewards]) if rewards or turns else 0
        a = 0.0 if answer is None else answer
        if self.name == "discounted":
            return sum(self.discount ** (t - 1) * r for t, r in rewards.items()) + (self.discount ** max(last - 1, 0)) * a
        if self.name == "last":
            return rewards.get(last, 0.0) + a
        if self.name == "weighted":
            return self.turn_weight * sum(rewards.values()) + self.answer_weight * a
        return sum(rewards.values()) + a


def turn_rewards_by_turn(recorded: Sequence[Any]) -> dict[int, float]:
    """`metadata["fsm"]["turn_rewards"]` as {turn number: reward}; entries of another shape are skipped."""
    out: dict[int, float] = {}
    for entry in recorded:
        turn = entry.get("turn") if isinstance(entry, Mapping) else None
        reward = entry.get("reward") if isinstance(entry, Mapping) else None
        if isinstance(turn, int) and not isinstance(turn, bool) and isinstance(reward, (int, float)) and not isinstance(reward, bool):
            out[turn] = out.get(turn, 0.0) + float(reward)
    return out
