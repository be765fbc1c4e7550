"""What slime HEAD does with a sample after generate, written out so tests can follow its rules.

From slime's code (see the project's slime-contract reference): `generate_and_rm` returns an
ABORTED sample without a reward; its default synchronous loop then keeps that sample in the
step's data, and reward post-processing / train-data conversion fails on `reward=None`. Only
`abort()` (partial rollout) and the fully-async worker re-queue ABORTED groups. Any other
status gets its reward, and conversion asserts per-token lengths, zeroes the loss mask of a
`remove_sample` sample, checks top-p replay when slime asked for it, and the trainer asserts
one routed-experts row per token but the last under routing replay.
"""

from __future__ import annotations

import asyncio
import sys
import types
from contextlib import contextmanager
from collections.abc import Iterator
from typing import Any

from engine.slime import reward_func


class StepDied(AssertionError):
    """What slime's default loop would do with this sample: kill the training step."""


def generate_and_rm(args: Any, sample: Any) -> Any:
    """slime's reward step after generate: ABORTED gets no reward, anything else is scored."""
    if sample.status.name != "ABORTED":
        sample.reward = asyncio.run(reward_func(args, sample))
    return sample


async def generate_and_rm_group(args: Any, group: list[Any], sampling_params: dict[str, Any]) -> list[Any]:
    """slime HEAD's `generate_and_rm_group` and its `generate_and_rm`, restated for one group:
    nothing while aborting; a session id per sample that has none; the custom generate function
    (`custom_generate_function_path`, handed `evaluation` when it takes it) on a private copy of
    the sampling params per sample, all of the group gathered at once; then, unless slime scores
    the group as a whole (`group_rm`), the custom reward (`custom_rm_path`) of each sample that is
    not ABORTED and has none yet; a generate that returns a list (fan-out) has the reward called
    once with the list of those without one, unless any is ABORTED. A sample already COMPLETED or TRUNCATED is handed back as is."""
    import importlib
    import inspect
    import uuid

    if slime_is_aborting():
        return group

    def load(path: str) -> Any:
        module, name = path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    async def one(sample: Any, params: dict[str, Any]) -> Any:
        if sample.status.name in ("COMPLETED", "TRUNCATED"):
            return sample
        generate = load(args.custom_generate_function_path)
        if "evaluation" in inspect.signature(generate).parameters:
            sample = await generate(args, sample, params, evaluation=False)
        else:
            sample = await generate(args, sample, params)
        if getattr(args, "group_rm", False):
            return sample
        if isinstance(sample, list):  # a fanned-out rollout: scored in one batch unless one is ABORTED
            if any(s.status.name == "ABORTED" for s in sample):
                return sample
            unscored = [s for s in sample if s.reward is None]
            rewards = await load(args.custom_rm_path)(args, unscored)  # slime's batched_async_rm: the list
            for s, reward in zip(unscored, rewards):
                s.reward = reward
            return sample
        if sample.status.name == "ABORTED":
            return sample
        if sample.reward is None:
            sample.reward = await load(args.custom_rm_path)(args, sample)
        return sample

    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    return list(await asyncio.gather(*(one(sample, dict(sampling_params)) for sample in group)))


def flatten_step(groups: list[list[Any]]) -> list[Any]:
    """slime's `_get_rollout_data` after its rollout function: the step's groups flattened while the
    first element is a list. Its shape decides for all: a step mixing `Sample` and `list[Sample]`
    elements fails there (a Sample is not iterable) or leaves lists the trainer cannot take."""
    import itertools

    data: list[Any] = list(groups)
    while isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    if any(isinstance(d, list) for d in data):
        raise StepDied("the step mixes samples and lists of samples: slime leaves the lists nested")
    return data


def slime_is_aborting() -> bool:
    """slime's `GenerateState(args).aborted`, as the engine's adapter reads it."""
    from engine.slime import slime_aborting as engine_reads

    return engine_reads()


def train_view(sample: Any, *, reward_key: str = "score", top_p_asked: bool = False,
               routing_replay: bool = False) -> dict[str, Any]:
    """slime's train-data conversion of one sample in the default synchronous loop."""
    if sample.reward is None:
        raise StepDied(f"{sample.status.name} sample with reward=None reached conversion")
    reward = sample.reward[reward_key] if isinstance(sample.reward, dict) else sample.reward
    float(reward)
    n = sample.response_length
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
    if len(mask) != n or len(sample.rollout_log_probs) != n or n > len(sample.tokens):
        raise StepDied("per-token lengths disagree")
    if sample.remove_sample:
        mask = [0] * n
    if top_p_asked:
        offsets = sample.rollout_top_p_token_offsets
        if sample.rollout_top_p_token_ids is None or offsets is None or len(offsets) != n + 1:
            raise StepDied("top-p replay asked for but missing or misaligned")
    if routing_replay:
        experts = sample.rollout_routed_experts
        if experts is None or experts.shape[0] != len(sample.tokens) - 1:
            raise StepDied("routed experts do not have one row per token but the last")
    return {"tokens": sample.tokens, "loss_mask": mask, "reward": reward}


@contextmanager
def slime_aborting() -> Iterator[None]:
    """slime's `GenerateState(args).aborted = True`, as its `abort()` sets it (a singleton)."""

    class SingletonMeta(type):
        _instances: dict[type, Any] = {}

    class GenerateState(metaclass=SingletonMeta):
        aborted = True

    module = types.ModuleType("slime.rollout.sglang_rollout")
    module.GenerateState = GenerateState  # type: ignore[attr-defined]
    SingletonMeta._instances[GenerateState] = GenerateState()
    saved = sys.modules.get(module.__name__)
    sys.modules[module.__name__] = module
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop(module.__name__, None)
        else:
            sys.modules[module.__name__] = saved


class RecordingLogger:
    """slime's `logging_utils` with its `log(args, metrics, step_key=...)` stubbed: records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], str]] = []

    def log(self, args: Any, metrics: dict[str, Any], step_key: str) -> None:
        self.calls.append((dict(metrics), step_key))


def log_rollout_data(rollout_id: int, args: Any, samples: list[Any], rollout_extra_metrics: Any, rollout_time: float,
                     *, load_function: Any, logging_utils: RecordingLogger) -> None:
    """slime HEAD's rollout logging step, as its contract reads: the custom log function first
    (a True return skips the rest); with debug data loaded nothing is logged; otherwise slime's own
    dict starts from `rollout_extra_metrics`, adds its `rollout/` and `perf/` figures and the step,
    and goes to its logger once. Its own figures are stood in by two it always computes."""
    path = getattr(args, "custom_rollout_log_function_path", None)
    if path is not None and load_function(path)(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
        return
    if getattr(args, "load_debug_rollout_data", None):
        return
    log_dict = {**(rollout_extra_metrics or {})}
    lengths = [s.response_length for s in samples]
    log_dict["rollout/response_len/mean"] = sum(lengths) / len(lengths)
    log_dict["perf/rollout_time"] = rollout_time
    log_dict["rollout/step"] = rollout_id
    logging_utils.log(args, log_dict, step_key="rollout/step")
