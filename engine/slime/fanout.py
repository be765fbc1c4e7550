"""slime's consumers of fan-out, given the shape they read: one sample per rollout in a group.

A generate function that fans out makes each element of a group a `list[Sample]` (one rollout's
segments or turns, sharing `rollout_id`). slime's dynamic-sampling filters read one reward per
element and fail on a list (slime #2374). Set `--dynamic-sampling-filter-path` to the filter here
of the same name: it hands slime's own filter each rollout's last sample (whose reward is the
rollout's whole, shared or discounted: docs/long-rollouts.md).
"""

from __future__ import annotations

from typing import Any


def one_per_rollout(group: list[Any]) -> list[Any]:
    """Each element of a group as one sample: a rollout's last, a plain sample itself."""
    return [element[-1] if isinstance(element, list) else element for element in group]


def check_reward_nonzero_std(args: Any, samples: list[Any], **kwargs: Any) -> Any:
    """slime's `check_reward_nonzero_std` over one sample per rollout."""
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std as slimes

    return slimes(args, one_per_rollout(samples), **kwargs)


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Any], **kwargs: Any) -> Any:
    """slime's `check_reward_nonzero_std_with_fallback` over one sample per rollout."""
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std_with_fallback as slimes

    return slimes(args, one_per_rollout(samples), **kwargs)
