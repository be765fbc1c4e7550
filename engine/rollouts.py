"""Rolling samples out without slime: a prompt in, a slime-shaped sample out, attempts policy and all.

    async with Runtime.create(EngineConfig(server_url="http://127.0.0.1:30000")) as rt:
        sample = await roll_out(rt, "What is 6 * 7?", label="42")

Membership: the few functions a caller without slime needs around `Runtime`. Each sample goes
through the adapter's own path (`engine.slime.run_sample`): the same attempts policy (a
transiently failed attempt is re-run, each failure in `metadata["fsm"]["attempts"]`), the same
statuses and termination reasons, the same per-token arrays as under slime. The sample is the
stand-in for slime's `Sample` (`engine.local.sample.Sample`), imported when first needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from engine.loop.runtime import Runtime
from engine.settings import Sampling

# What slime's own generate asks of SGLang besides temperature, top-p and the length cap.
FIXED_PARAMS = {"no_stop_trim": True, "skip_special_tokens": False, "spaces_between_special_tokens": False}
_DEFAULT = Sampling()  # slime's sampling arguments as their declarations default them


def sampling_params(temperature: float = _DEFAULT.rollout_temperature, top_p: float = _DEFAULT.rollout_top_p,
                    max_new_tokens: int = _DEFAULT.rollout_max_response_len) -> dict[str, Any]:
    """The sampling parameters slime's rollout would hand a generate function (defaults: slime's, as declared)."""
    return {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, **FIXED_PARAMS}


async def roll_out(rt: Runtime, prompt: Any, params: dict[str, Any] | None = None, *, label: Any = None,
                   metadata: dict[str, Any] | None = None, index: int | None = None, score: bool = True) -> Any:
    """Roll one prompt (a string or a list of chat messages) out; return the finished sample, or
    its samples sharing `rollout_id` where the runtime's samples fan out (`Runtime.fans_out`:
    compaction, a template's render that drops earlier reasoning, one sample per turn).

    Never raises but CancelledError: whatever goes wrong is the sample's status and
    `metadata["fsm"]["termination_reason"]`. With `score`, `sample.reward` is the retool reward.
    """
    from engine.local.sample import Sample
    from engine.slime import reward_func, run_sample

    sample = Sample(prompt=prompt, label=label, index=index, metadata=dict(metadata or {}))
    out = await run_sample(rt, sample, dict(params if params is not None else sampling_params()))
    for each in out if isinstance(out, list) else [out]:
        if score and each.status.name != "ABORTED":
            each.reward = await reward_func(None, each)
    return out


async def roll_out_all(rt: Runtime, prompts: Iterable[Any], params: dict[str, Any] | None = None, *,
                       n_samples_per_prompt: int = 1, score: bool = True) -> list[Any]:
    """Roll every prompt out `n_samples_per_prompt` times, concurrently; samples (or lists of them,
    as `roll_out` returns) in input order."""
    jobs = [(i, prompt) for i, prompt in enumerate(prompts) for _ in range(n_samples_per_prompt)]
    samples = await asyncio.gather(*(roll_out(rt, prompt, params, index=k, score=score) for k, (_, prompt) in enumerate(jobs)))
    for out, (group, _) in zip(samples, jobs):
        for sample in out if isinstance(out, list) else [out]:
            sample.group_index = group
    return list(samples)


__all__ = ["roll_out", "roll_out_all", "sampling_params"]
