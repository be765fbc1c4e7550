"""slime's side of an agent's sample (`engine_agent`): the harness runs, its segments come back as samples.

Imported by `engine.slime.generate` only when `engine_agent` is set, so a slime job without an
agent loads neither the front door nor aiohttp. The sample's prompt is handed to the harness
(see `engine.agent.harness`); the harness's model calls are the sample's turns; each segment
is one sample, slime's fan-out: always a `list[Sample]` sharing `rollout_id`, one of one
included, since any session may break into segments and slime flattens a step by its first
element's shape (a step mixing a `Sample` with lists fails there). A coroutine harness that
returns a number (or a dict with a `score`) gives the rollout that reward, each segment its share
by `engine_segment_reward` (shared: all of it; discounted); otherwise slime's reward function
(`engine.slime.reward_func`, or its RM) scores the segments, which carry the harness's outcome in
`metadata["fsm"]["agent"]`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from engine.agent.harness import HarnessSpec
from engine.agent.serving import AgentRun, check_profile, run_agent
from engine.loop.attempts import caller_requeues
from engine.loop.runtime import Runtime
from engine.slime.sample_io import (
    BAD_INPUT,
    BadInput,
    clear_sample,
    read_input,
    reward_weights,
    weighted_reward,
    write_segments,
    write_unrolled,
)

NO_CALL = "harness_made_no_call"  # the harness ended without one model call: nothing to train


async def agent_sample(rt: Runtime, sample: Any, sampling_params: Any,
                           placeholder: Callable[[], tuple[int, str]], **door: Any) -> Any:
    """Run the sample's agent and write its segments; never raises but CancelledError (an
    unusable sample or harness ends FAILED, untrained, with the reason). `placeholder` gives
    the token an unrolled sample is made of (the adapter's). Returns a list of samples, whatever
    their number."""
    spec = HarnessSpec.parse(rt.cfg.agent or "")
    try:
        inp = read_input(sample, sampling_params)
    except BadInput as exc:
        write_unrolled(sample, BAD_INPUT, str(exc), rt.cfg, sampling_params, placeholder())
        return [sample]
    clear_sample(sample)
    run = await run_agent(rt, spec, prompt=inp.prompt, sampling_params=inp.sampling_params, sample=sample,
                          routing_key=inp.routing_key, metadata=inp.metadata, **door)
    record = agent_record(run)
    if run.rollout is None:
        write_unrolled(sample, NO_CALL, f"{run.outcome.reason}: {run.outcome.detail}".rstrip(": "), rt.cfg,
                       sampling_params, placeholder())
        sample.metadata["fsm"]["agent"] = record
        return [sample]
    samples = write_segments(sample, run.rollout, rt.profile.decode, requeued=caller_requeues(rt), agent=record)
    reward = run.outcome.result
    if isinstance(reward, (int, float, dict)) and not isinstance(reward, bool):
        for out, weight in zip(samples, reward_weights(rt.cfg, len(samples))):
            out.reward = weighted_reward(reward, weight)
    return samples


def check_agent(rt: Runtime) -> None:
    """The settings' agent can run: its name reads, the profile renders chat messages (ValueError, one line)."""
    HarnessSpec.parse(rt.cfg.agent or "")
    check_profile(rt)


def agent_record(run: AgentRun) -> dict[str, Any]:
    """What `metadata["fsm"]["agent"]` keeps of the harness: how it ended, what it returned (when
    JSON can hold it), the tail of what it printed, the calls refused and answered again."""
    record: dict[str, Any] = {"reason": run.outcome.reason, "refused": list(run.refused), "retries": run.retries}
    if run.outcome.detail:
        record["detail"] = run.outcome.detail
    if run.outcome.output:
        record["output"] = run.outcome.output
    if run.outcome.result is not None:
        try:
            json.dumps(run.outcome.result)
            record["result"] = run.outcome.result
        except (TypeError, ValueError):
            record["result"] = repr(run.outcome.result)[:1000]
    return record
