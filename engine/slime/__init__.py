"""The slime adapter: the only code that touches slime's `Sample`, its `args` or its globals.

    --custom-generate-function-path engine.slime.generate
    --custom-rm-path engine.slime.reward_func
    --custom-config-path engine.yaml      # engine_profile, engine_max_turns, ...
    --custom-rollout-log-function-path engine.slime.log_rollout   # the engine's figures on the dashboard

`generate` reads what the engine needs from the sample (prompt, tools, session id, and with
`--partial-rollout` the checkpoint and the arrays it vouches for), clears the sample, drives
the machine, and writes the outcome back. It never raises into slime's `gather` (except on
cancellation): every failure is a status with its reason in
`sample.metadata["fsm"]["termination_reason"]`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import Any

from engine.loop.attempts import caller_requeues, run_attempts
from engine.loop.driver import new_rollout
from engine.loop.environment import UnknownEnvironment, read_choice
from engine.loop.preflight import log_tool_problems
from engine.loop.runtime import Runtime
from engine.machine.rollout import Rollout
from engine.profiles.reward import RewardRule, retool_score, turn_rewards_by_turn
from engine.settings import EngineConfig
from engine.slime import compat
from engine.slime.dashboard import log_rollout  # noqa: F401  (slime loads it by this path)
from engine.slime.sample_io import (
    ADAPTER_CRASHED,
    BAD_INPUT,
    FSM,
    SETUP_FAILED,
    BadInput,
    clear_sample,
    engine_metadata,
    read_checkpoint,
    read_input,
    write_sample,
    write_segments,
    write_unrolled,
)

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


async def run_sample(rt: Runtime, sample: Any, sampling_params: Any) -> Any:
    """Roll one sample out through the machine and write the result into it. Never raises but
    CancelledError: bad input and adapter bugs end the sample FAILED with the reason recorded."""
    async with rt.in_flight():
        return await _run_sample(rt, sample, sampling_params)


async def _run_sample(rt: Runtime, sample: Any, sampling_params: Any) -> Any:
    try:
        inp = read_input(sample, sampling_params)
    except BadInput as exc:
        return _fanned(rt, _unrolled(sample, BAD_INPUT, str(exc), rt.cfg, sampling_params, _placeholder(rt)))
    except Exception as exc:  # a sample object whose attributes raise
        return _fanned(rt, _unrolled(sample, BAD_INPUT, f"{type(exc).__name__}: {exc}", rt.cfg, sampling_params,
                                     _placeholder(rt)))
    try:
        choice = read_choice(inp.metadata)
        environment = rt.environments.chosen(choice)
    except UnknownEnvironment as exc:  # the dataset names one that is not registered, or names it badly
        return _fanned(rt, _unrolled(sample, BAD_INPUT, str(exc), rt.cfg, sampling_params, _placeholder(rt)))
    except Exception as exc:  # its setup failed (a setting it needs): every sample naming it says so
        _log_setup_failure(exc)
        return _fanned(rt, _unrolled(sample, SETUP_FAILED, f"environment {choice.name}: {type(exc).__name__}: {exc}",
                                     rt.cfg, sampling_params, _placeholder(rt)))
    current: list[Rollout] = []
    try:
        saved = read_checkpoint(sample) if rt.cfg.partial_rollout else None
        clear_sample(sample)  # an earlier attempt's fields are gone before anything new is written (I5)
        offered = rt.allowed_tools(inp.tool_names)
        try:  # a prompt the format cannot render is the sample's problem, not an engine crash
            await rt.prompt_ids(inp.prompt, offered, inp.tool_schemas)
        except Exception as exc:
            return _fanned(rt, _unrolled(sample, BAD_INPUT, f"prompt: the {rt.cfg.profile} format cannot render it "
                                         f"({type(exc).__name__}: {exc})", rt.cfg, sampling_params, _placeholder(rt)))

        def make(number: int) -> Rollout:
            # Only the first attempt may resume a checkpoint; a re-run starts from RESET.
            return new_rollout(rt, inp.prompt, inp.sampling_params, saved=saved if number == 1 else None,
                               routing_key=inp.routing_key, tools_requested=inp.tool_names,
                               tool_schemas=inp.tool_schemas, metadata=inp.metadata, environment=environment,
                               environment_args=dict(choice.args))

        outcome = await run_attempts(rt, make, on_start=current.append)
    except asyncio.CancelledError:
        if current:
            write_sample(sample, current[-1])  # the attempt in flight
        raise
    except Exception as exc:  # an adapter bug: the sample still comes back, FAILED, not trained
        log.exception("engine adapter failed on a sample")
        return _fanned(rt, _unrolled(sample, ADAPTER_CRASHED, f"{type(exc).__name__}: {exc}", rt.cfg, sampling_params,
                                     _placeholder(rt)))
    samples = [sample]
    try:
        r = outcome.rollout
        if rt.fans_out() and not outcome.exhausted:  # its segments (or turns), each a sample
            samples = write_segments(sample, r, rt.profile.decode, requeued=caller_requeues(rt),
                                     per_turn=rt.cfg.samples == "per_turn")
            if outcome.attempts:
                for each in samples:
                    each.metadata[FSM]["attempts"] = outcome.attempts
        else:
            write_sample(sample, r, attempts=outcome.attempts, exhausted=outcome.exhausted)
        unserved = sorted((inp.tool_names or frozenset()) - offered)
        if unserved:
            for each in samples:
                each.metadata[FSM]["tools_unavailable"] = unserved
    except Exception as exc:
        log.exception("engine adapter failed writing a sample")
        samples = [_unrolled(sample, ADAPTER_CRASHED, f"{type(exc).__name__}: {exc}", rt.cfg, sampling_params,
                             _placeholder(rt))]
    return samples if rt.fans_out() else sample


def _fanned(rt: Runtime, sample: Any) -> Any:
    """One sample in the shape this runtime hands back: a list of one where samples may fan out,
    so every sample of a batch has the one shape slime's loop flattens."""
    return [sample] if rt.fans_out() else sample


def _placeholder(rt: Runtime | None, args: Any = None) -> tuple[int, str]:
    """The placeholder's token (pad, else end of sequence) and its text as the engine decodes it.

    Without a runtime (its settings were unusable) the job's tokenizer is tried (`hf_checkpoint`);
    (0, "") only when none loads.
    """
    if rt is None:
        path = getattr(args, "hf_checkpoint", None)
        key = (type(path), path) if path is None or isinstance(path, str) else None
        if key in _placeholders:
            return _placeholders[key]
    try:
        if rt is not None:
            tokenizer, decode = rt.tokenizer, rt.profile.decode
        else:
            from engine.profiles.tokenizer import Codec, load_tokenizer

            tokenizer = load_tokenizer(path if key is not None else None)
            decode = Codec(tokenizer).decode
        token = next((t for t in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
                      if isinstance(t, int) and not isinstance(t, bool) and t >= 0), 0)
        found = token, decode([token])
    except Exception:  # no tokenizer at all: the sample is still well-formed and untrained
        found = 0, ""
    if rt is None and key is not None:
        _placeholders[key] = found  # one load (or failure) per path, not one per sample
    return found


_placeholders: dict[Any, tuple[int, str]] = {}


def _unrolled(sample: Any, reason: str, error: str, cfg: EngineConfig | None, sampling_params: Any,
              placeholder: tuple[int, str] = (0, "")) -> Any:
    """End a sample that never finished the machine; a sample that cannot even be written is logged."""
    try:
        write_unrolled(sample, reason, error, cfg, sampling_params, placeholder)
    except Exception:  # the sample refuses its fields: nothing more can be done than to say so
        log.exception("could not write the outcome (%s: %s) into the sample", reason, error)
    return sample


async def generate(args: Any, sample: Any, sampling_params: Any, evaluation: bool = False) -> Any:
    """slime's custom generate function: one sample, multi-turn with tools, returns the sample.

    Where a rollout may come back as several samples (an agent's session, `engine_agent`; a
    compaction; a template that drops earlier reasoning; `engine_samples: per_turn`), every sample
    comes back as a list sharing `rollout_id`, one of one included: the one shape slime flattens.

    Never raises into slime's `gather` (only CancelledError passes): every failure is a status
    with its reason in `sample.metadata["fsm"]["termination_reason"]`.
    """
    try:
        cfg = EngineConfig.from_args(args)
        rt = runtime_for(cfg)
        if cfg not in _probed and cfg.agent is None:  # once per settings: one clear error at start-up for a tool that cannot work
            _probed.add(cfg)
            await log_tool_problems(rt.allowed_tools())
        if cfg.agent is not None:  # the agent a setting names, and a profile that renders its messages
            from engine.slime.agent import check_agent

            check_agent(rt)
    except Exception as exc:  # settings or tokenizer unusable: every sample says so, none crashes
        _log_setup_failure(exc)
        return _unrolled(sample, SETUP_FAILED, f"{type(exc).__name__}: {exc}", None, sampling_params,
                         _placeholder(None, args))
    if cfg.agent is not None:
        return await run_agent_sample(rt, sample, sampling_params)
    return await run_sample(rt, sample, sampling_params)


async def run_agent_sample(rt: Runtime, sample: Any, sampling_params: Any) -> Any:
    """Run the agent `engine_agent` names for one sample: its segments, one sample each, as a list
    sharing `rollout_id` (one of one included). Never raises but CancelledError."""
    from engine.slime.agent import agent_sample  # the front door loads only when an agent is configured

    async with rt.in_flight():
        try:
            return await agent_sample(rt, sample, sampling_params, lambda: _placeholder(rt))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an adapter bug: the sample still comes back, FAILED, not trained
            log.exception("engine adapter failed on an agent's sample")
            return [_unrolled(sample, ADAPTER_CRASHED, f"{type(exc).__name__}: {exc}", rt.cfg, sampling_params,
                              _placeholder(rt))]


_setup_errors: set[str] = set()
_probed: set[EngineConfig] = set()


def _log_setup_failure(exc: Exception) -> None:
    """Log each distinct setup error once, not once per sample."""
    text = f"{type(exc).__name__}: {exc}"
    if text not in _setup_errors:
        _setup_errors.add(text)
        log.error("engine setup failed: %s", text)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> Any:
    """The episode's reward: its per-turn rewards and its answer's, combined by the declared rule.

    The answer's reward (`answer_score`): retool's check of the boxed answer in the model's own
    final text against `sample.label`, nudged towards using tools (tool output never counts: a
    program that prints an answer earns the no-answer reward). It counts for a sample without an
    environment; with one, the environment judges the episode (a conversation has no boxed answer
    to check). The per-turn rewards an environment or a tool gave (`turn_rewards`, each with its
    model turn's token `span` in the response) and that answer make `score`, the scalar slime
    trains on (`--reward-key score`), by `engine_reward_rule` (sum, discounted, last, weighted;
    see `engine.profiles.reward.RewardRule`). `acc`: the episode succeeded: the right answer
    without an environment; with one, what it said when it ended the episode (`Reply.success`),
    else a positive score. `answer_span` is the last model turn's span, where the answer's
    reward belongs. Never raises: unusable settings give score 0.0 with the `error`.

    A rollout that came back as several samples (slime's fan-out: segments, or one per turn) is
    scored as a whole from each of them: its last words, all its turns and their rewards; each
    sample then gets its `reward_weight` of that (engine_segment_reward), and a turn's own sample
    where the environment scored turns gets that turn's reward. Given a list (slime calls a custom
    reward in batch mode for a fanned-out rollout's samples), the list of each one's reward.
    """
    if isinstance(sample, list):
        return [await reward_func(args, each, **kwargs) for each in sample]
    fsm = engine_metadata(sample)
    tool_calls = (fsm.get("tool_stats") or {}).get("calls", 0)
    text = next((fsm[k] for k in ("rollout_final_text", "final_text") if isinstance(fsm.get(k), str)), None)
    text = _own_text(sample, fsm) if text is None else text
    result = retool_score(text, getattr(sample, "label", None), int(tool_calls) if isinstance(tool_calls, int) else 0)
    own = fsm.get("turn_rewards") if isinstance(fsm.get("turn_rewards"), list) else []
    whole = fsm.get("rollout_turn_rewards")
    recorded = whole if isinstance(whole, list) else own
    rewards = turn_rewards_by_turn(recorded)
    environment = fsm.get("environment") if isinstance(fsm.get("environment"), dict) else None
    turns = fsm.get("rollout_turns")
    if not isinstance(turns, int) or isinstance(turns, bool):
        turns = len(fsm["turns"]) if isinstance(fsm.get("turns"), (list, tuple)) else 0
    result["answer_score"] = result["score"]
    result["turn_reward"] = sum(rewards.values())
    result["turn_rewards"] = [dict(t) for t in own if isinstance(t, dict)]
    result["answer_span"] = _last_model_span(fsm)
    try:
        rule = reward_rule(args)
    except Exception as exc:  # settings slime's job cannot use: its samples already say so
        return {**result, "score": 0.0, "acc": False, "error": f"{type(exc).__name__}: {exc}"}
    result["rule"] = rule.name
    result["score"] = rule.score(rewards, turns, None if environment else result["answer_score"])
    if environment is not None:
        success = environment.get("success")
        result["acc"] = success if isinstance(success, bool) else result["score"] > 0
    if (fsm.get("segment") or {}).get("per_turn") and own:  # a turn's own sample: the environment scored it
        result["score"] = sum(turn_rewards_by_turn(own).values())
    weight = fsm.get("reward_weight")
    if isinstance(weight, (int, float)) and not isinstance(weight, bool):
        result["score"] *= float(weight)
    return result


def reward_rule(args: Any) -> RewardRule:
    """The rule `args` declare (`engine_reward_*`)."""
    cfg = EngineConfig.from_args(args)
    return RewardRule(cfg.reward_rule, cfg.reward_discount, cfg.reward_turn_weight, cfg.reward_answer_weight)


def _last_model_span(fsm: dict[str, Any]) -> list[int] | None:
    """The last model turn's [start, end) in the response tokens, from the recorded segments."""
    for seg in reversed(fsm.get("segments") or []):
        if isinstance(seg, (list, tuple)) and len(seg) >= 3 and seg[0] == "model":
            return [int(seg[1]), int(seg[2])]
    return None


def _own_text(sample: Any, fsm: dict[str, Any]) -> str:
    """A sample the engine did not roll out: its response is all the text there is."""
    response = getattr(sample, "response", "")
    return response if isinstance(response, str) and not fsm else ""


def slime_aborting() -> bool:
    """True while slime's rollout is aborting the step (its `GenerateState` singleton says so).

    A dict lookup when slime is not loaded; handed to the runtime as its abort check. The one
    private name of slime it needs is read in `engine.slime.compat`.
    """
    return compat.aborting()
