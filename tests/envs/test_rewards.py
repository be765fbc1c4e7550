"""Rewards composed, not summed: the declared rule (`engine_reward_rule`), `acc` the episode's
success, and what slime gets beside the scalar (the per-turn rewards and their spans)."""

from __future__ import annotations

from typing import Any

import pytest

from engine import slime
from engine.settings import EngineConfig, SettingsError
from engine.local.sample import Sample
from engine.profiles.reward import RewardRule, turn_rewards_by_turn
from tests.conftest import run
from tests.support.helpers import make_args

REWARDS = {1: -0.1, 2: 0.0, 3: 1.0}  # by model turn


def rule(name: str, discount: float = 0.9, turn_weight: float = 1.0, answer_weight: float = 1.0) -> RewardRule:
    return RewardRule(name, discount, turn_weight, answer_weight)


@pytest.mark.parametrize("rule, answer, score", [
    (rule("sum"), None, 0.9),
    (rule("sum"), 1.0, 1.9),
    (rule("discounted", discount=0.5), None, -0.1 + 0.25 * 1.0),
    (rule("discounted", discount=0.5), 1.0, -0.1 + 0.25 * 2.0),  # the answer weighs as the last turn
    (rule("last"), None, 1.0),
    (rule("last"), -1.0, 0.0),
    (rule("weighted", turn_weight=0.5, answer_weight=2.0), None, 0.45),
    (rule("weighted", turn_weight=0.5, answer_weight=2.0), -1.0, 0.45 - 2.0),
])
def test_each_rule_makes_its_scalar(rule: RewardRule, answer: float | None, score: float) -> None:
    assert rule.score(REWARDS, 3, answer) == pytest.approx(score)


def test_last_means_the_last_model_turn_even_when_it_was_not_scored() -> None:
    assert rule("last").score({1: 1.0}, 3) == 0.0  # the episode ran on after its one reward
    assert rule("discounted", discount=0.5).score({}, 3, 1.0) == pytest.approx(0.25)
    assert rule("sum").score({}, 0) == 0.0
    with pytest.raises(ValueError):
        rule("median")


def test_recorded_turn_rewards_are_read_by_turn_and_odd_entries_skipped() -> None:
    recorded = [{"turn": 1, "reward": 0.5}, {"turn": 1, "reward": 0.25}, {"turn": "2", "reward": 1}, {"turn": 3, "reward": True},
                "junk", {"turn": 4, "reward": 2}]
    assert turn_rewards_by_turn(recorded) == {1: 0.75, 4: 2.0}


def episode(environment: dict[str, Any] | None, rewards: list[tuple[int, float]], turns: int, text: str = "",
            label: str | None = None) -> Sample:
    """A sample as the engine writes it: `turns` model turns, some scored, one model segment per turn."""
    segments = [("model", 10 * i, 10 * i + 5, "default") for i in range(turns)]
    fsm: dict[str, Any] = {"turns": [{"turn": i + 1} for i in range(turns)], "segments": segments, "final_text": text,
                           "turn_rewards": [{"turn": t, "span": [10 * (t - 1), 10 * (t - 1) + 5], "reward": r} for t, r in rewards],
                           "tool_stats": {"calls": 0}}
    if environment is not None:
        fsm["environment"] = environment
    return Sample(prompt="p", label=label, metadata={"fsm": fsm})


def test_reward_func_composes_by_the_settings_and_says_how() -> None:
    sample = episode({"name": "g", "reason": "guessed", "success": True}, [(1, -0.1), (3, 1.0)], 3)
    by_rule = {rule: run(slime.reward_func(make_args(engine_reward_rule=rule, engine_reward_discount=0.5), sample))
               for rule in ("sum", "discounted", "last")}
    assert by_rule["sum"]["score"] == pytest.approx(0.9)
    assert by_rule["discounted"]["score"] == pytest.approx(-0.1 + 0.25)
    assert by_rule["last"]["score"] == pytest.approx(1.0)
    reward = by_rule["sum"]
    assert (reward["rule"], reward["acc"], reward["turn_reward"]) == ("sum", True, pytest.approx(0.9))
    assert reward["turn_rewards"] == sample.metadata["fsm"]["turn_rewards"] and reward["answer_span"] == [20, 25]
    weighted = run(slime.reward_func(make_args(engine_reward_rule="weighted", engine_reward_turn_weight=2.0), sample))
    assert weighted["score"] == pytest.approx(1.8)


def test_acc_is_the_episodes_success() -> None:
    said_no = episode({"name": "g", "reason": "gave up", "success": False}, [(1, 1.0)], 1)
    unsaid_good = episode({"name": "g", "reason": None, "success": None}, [(1, 0.5)], 1)
    unsaid_bad = episode({"name": "g", "reason": None, "success": None}, [(1, -0.5)], 1)
    right = episode(None, [], 1, text="Answer: \\boxed{4}", label="4")
    wrong = episode(None, [(1, 0.5)], 1, text="Answer: \\boxed{5}", label="4")
    acc = {name: run(slime.reward_func(make_args(), s))["acc"]
           for name, s in dict(said_no=said_no, unsaid_good=unsaid_good, unsaid_bad=unsaid_bad, right=right, wrong=wrong).items()}
    assert acc == dict(said_no=False, unsaid_good=True, unsaid_bad=False, right=True, wrong=False)
    # without an environment the answer's reward counts, and a tool's per-turn reward is added to it
    graded = run(slime.reward_func(make_args(), wrong))
    assert graded["answer_score"] < 0 and graded["score"] == pytest.approx(graded["answer_score"] + 0.5)
    # with one, the environment judges: a boxed answer in a conversation does not count
    judged = episode({"name": "g", "reason": None, "success": None}, [(1, 0.5)], 1, text="Answer: \\boxed{4}", label="4")
    assert run(slime.reward_func(make_args(), judged))["score"] == pytest.approx(0.5)


def test_the_rule_is_a_checked_setting_and_reward_func_never_raises_on_it() -> None:
    with pytest.raises(SettingsError, match="engine_reward_rule must be one of sum, discounted, last, weighted"):
        EngineConfig.from_args(make_args(engine_reward_rule="median"))
    with pytest.raises(SettingsError, match="engine_reward_discount must be a number > 0 and <= 1"):
        EngineConfig.from_args(make_args(engine_reward_discount=0))
    reward = run(slime.reward_func(make_args(engine_reward_rule="median"), episode(None, [], 1)))
    assert reward["score"] == 0.0 and reward["acc"] is False and "engine_reward_rule" in reward["error"]
    assert run(slime.reward_func(None, episode(None, [], 1, text="\\boxed{1}", label="1")))["score"] == 1.0
