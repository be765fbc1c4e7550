"""The slime adapter: the only code that touches slime's `Sample`, its `args` or its globals.

    --custom-generate-function-path engine.slime.generate
    --custom-rm-path engine.slime.reward_func
    --custom-config-path engine.yaml      # engine_profile, engine_max_turns, ...

`generate` reads what the engine needs from the sample (prompt, tools, session id, and with
`--partial-rollout` the checkpoint and the arrays it vouches for), clears the sample, drives
the machine, and writes the outcome back. It never raises into slime's `gather` (except on
cancellation): every failure is a status with its reason in
`sample.metadata["fsm"]["termination_reason"]`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import weakref
from typing import Any

from engine.config import EngineConfig
from engine.loop.driver import drive, new_rollout
from engine.profiles.reward import retool_score
from engine.machine.rollout import Inputs, Record, Rollout
from engine.machine.states import State
from engine.loop.runtime import Runtime
from engine.slime.sample_io import clear_sample, engine_metadata, read_checkpoint, write_sample

log = logging.getLogger(__name__)

# Per event loop (httpx pools and semaphores are loop-bound), per settings.
_runtimes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[EngineConfig, Runtime]] = weakref.WeakKeyDictionary()
_runtimes_lock = threading.Lock()


def runtime_for(cfg: EngineConfig) -> Runtime:
    """The runtime of these settings on the running event loop, made on first use."""
    loop = asyncio.get_running_loop()
    with _runtimes_lock:
        per_loop = _runtimes.setdefault(loop, {})
        rt = per_loop.get(cfg)
        if rt is None:
            rt = per_loop[cfg] = Runtime.create(cfg, abort_check=slime_aborting)
    return rt


async def run_sample(rt: Runtime, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """Roll one sample out through the machine and write the result into it."""
    metadata = getattr(sample, "metadata", None)
    requested = metadata.get("tools") if isinstance(metadata, dict) else None
    saved = read_checkpoint(sample) if rt.cfg.partial_rollout else None
    clear_sample(sample)  # an earlier attempt's fields are gone before anything new is written (I5)
    r = new_rollout(
        rt,
        sample.prompt,
        sampling_params,
        saved=saved,
        routing_key=getattr(sample, "session_id", None),
        tools_requested=requested,
    )
    try:
        await drive(rt, r)
    finally:
        write_sample(sample, r)
    return sample


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime's custom generate function: one sample, multi-turn with tools, returns the sample."""
    try:
        rt = runtime_for(EngineConfig.from_args(args))
    except Exception as exc:  # settings or tokenizer unusable: every sample says so, none crashes
        log.error("engine setup failed: %s", exc)
        return _setup_failed(sample, exc)
    return await run_sample(rt, sample, sampling_params)


def _setup_failed(sample: Any, exc: Exception) -> Any:
    clear_sample(sample)
    r = Rollout(Inputs(EngineConfig()), state=State.FAILED.value,
                record=Record(reason="engine_setup_failed", error=f"{type(exc).__name__}: {exc}"))
    write_sample(sample, r)
    return sample


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> dict[str, Any]:
    """retool's reward: the boxed answer against `sample.label`, nudged towards using tools."""
    tool_calls = int((engine_metadata(sample).get("tool_stats") or {}).get("calls", 0))
    return retool_score(sample.response or "", getattr(sample, "label", None), tool_calls)


def slime_aborting() -> bool:
    """True while slime's rollout is aborting the step (its `GenerateState` singleton says so).

    A dict lookup when slime is not loaded; handed to the runtime as its abort check.
    """
    module = sys.modules.get("slime.rollout.sglang_rollout")
    if module is None:
        return False
    cls = getattr(module, "GenerateState", None)
    instances = getattr(type(cls), "_instances", None) if cls is not None else None
    state = instances.get(cls) if isinstance(instances, dict) else None
    return bool(getattr(state, "aborted", False))
