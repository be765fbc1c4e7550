"""slime's own code takes the engine's fan-out: its group loop (`generate_and_rm_group`, which calls
`engine.slime.generate` and `engine.slime.reward_func` by path), its check of `rollout_id` on
fanned-out samples, its dynamic-sampling filter through `engine.slime.fanout`, and what its
default reward post-processing makes of a fanned-out step beside `engine.slime.fanout`'s.

slime is not on PyPI: these tests run slime's real functions from a checkout named by
SLIME_CHECKOUT (a clone of THUDM/slime; its `pylatexenc` dependency installed), and skip
with the reason when there is none.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import respx

from tests.support.helpers import SAMPLING, URL, ScriptedServer, encode, make_args, turn

CHECKOUT = os.environ.get("SLIME_CHECKOUT")


def _slime() -> Any:
    if not CHECKOUT or not os.path.isfile(os.path.join(CHECKOUT, "slime", "rollout", "sglang_rollout.py")):
        pytest.skip("no slime checkout: set SLIME_CHECKOUT to a clone of THUDM/slime")
    if CHECKOUT not in sys.path:
        sys.path.insert(0, CHECKOUT)
    try:
        return importlib.import_module("slime.rollout.sglang_rollout")
    except ImportError as exc:  # a dependency of slime's that this environment lacks
        pytest.skip(f"slime's rollout module does not import here: {exc}")


def call(code: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "code_interpreter", "arguments": {"code": code}})}\n</tool_call>'


ANSWER = "Answer: \\boxed{3}"


def args_for(threshold: int) -> argparse.Namespace:
    args = make_args(engine_profile="chat", engine_tools=["code_interpreter"], engine_compaction="summarize",
                     engine_compaction_threshold=threshold)
    for key, value in {"custom_generate_function_path": "engine.slime.generate", "custom_rm_path": "engine.slime.reward_func",
                       "group_rm": False, "partial_rollout": False, "mask_offpolicy_in_partial_rollout": False,
                       "hf_checkpoint": None, "rollout_num_engines": 1, "rollout_temperature": 1.0, "rollout_top_p": 1.0,
                       "rollout_top_k": -1, "rollout_max_response_len": 256, "rollout_stop": None,
                       "rollout_stop_token_ids": None, "rollout_skip_special_tokens": False, "sglang_dp_size": None,
                       "reward_key": "score", "n_samples_per_prompt": 2, "rm_type": None}.items():
        setattr(args, key, value)
    return args


def test_slime_s_group_loop_takes_the_fan_out_and_its_filter_reads_one_sample_per_rollout(fake_interpreter, monkeypatch):
    rollout = _slime()
    from slime.observability.rollout_data_utils import validate_rollout_id_annotated
    from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
    from slime.utils.types import Sample

    from engine.profiles.tokenizer import default_tokenizer_dir
    from engine.slime import fanout

    tokenizer_dir = default_tokenizer_dir()
    summary = "I printed 1."
    # the first rollout compacts once (two samples); the second answers at once (a list of one)
    script = [turn(call("print(1)")), turn(summary), turn(ANSWER), turn("I do not know.")]
    first_turn = len(encode(call("print(1)"))) + 1
    server = ScriptedServer(script)
    args = args_for(threshold=0)
    args.hf_checkpoint = tokenizer_dir
    group = [Sample(index=0, group_index=0, prompt="What is 1 + 2?", label="3"),
             Sample(index=1, group_index=0, prompt="What is 1 + 2?", label="3")]

    async def go() -> Any:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            # one sample at a time, so the script's replies reach the samples in order
            done = [await rollout.generate_and_rm(args, s, dict(SAMPLING)) for s in group]
            return done

    # the threshold after the first rollout's first exchange: its prompt, the turn, the tool's answer
    from engine import tools
    from engine.profiles.chat import ChatProfile
    from engine.profiles.tokenizer import load_tokenizer

    profile = ChatProfile(load_tokenizer(tokenizer_dir))
    prompt = profile.render_prompt("What is 1 + 2?", [tools.get("code_interpreter").schema()])  # type: ignore[union-attr]
    observation = profile.tool_delta(["Output:\nprint(1)"])
    args.engine_compaction_threshold = len(prompt) + first_turn + len(profile.encode(observation)) - 2
    monkeypatch.setattr(rollout.GenerateState, "_instances", {}, raising=False)
    out = asyncio.run(go())
    assert [len(o) for o in out] == [2, 1] and all(isinstance(o, list) for o in out)
    assert [s.rollout_id for s in out[0]] == [0, 0]
    scores = [s.reward["score"] for o in out for s in o]  # slime called the engine's reward, in batch mode for a list
    assert scores[:2] == [1.0, 1.0] and scores[2] < 0
    validate_rollout_id_annotated([out])  # slime's own check of fanned-out samples: rollout ids set and shared
    with pytest.raises(AttributeError):  # slime #2374: its filter reads a reward off each element of the group
        check_reward_nonzero_std(args, out)
    kept = fanout.check_reward_nonzero_std(args, out)
    assert bool(kept.keep) is True  # 1.0 and below 0: the group has a spread of rewards


def slimes_post_process(sample_class: Any) -> Any:
    """slime's `RolloutManager._post_process_rewards`, read from its checkout: its module imports
    SGLang and Ray, so the method alone is compiled, as written, and called with a stand-in self."""
    torch = pytest.importorskip("torch", reason="slime's reward post-processing is written with torch")
    source = Path(CHECKOUT or "", "slime", "ray", "rollout.py").read_text(encoding="utf-8")
    method = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "_post_process_rewards")
    namespace: dict[str, Any] = {"torch": torch, "Sample": sample_class}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "slime/ray/rollout.py", "exec"), namespace)
    return namespace["_post_process_rewards"]


def test_slime_s_default_post_processing_normalizes_a_fanned_out_step_as_one_group_and_ours_per_prompt():
    _slime()
    from slime.utils.types import Sample

    from engine.slime.fanout import normalize_rewards_by_group

    post_process = slimes_post_process(Sample)
    args = argparse.Namespace(advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
                              n_samples_per_prompt=2, rollout_batch_size=2, reward_key=None)
    manager = argparse.Namespace(args=args, custom_reward_post_process_func=None)

    def sample(group: int, rollout: int, reward: float, weight: float | None = None) -> Any:
        s = Sample(index=rollout, group_index=group, rollout_id=rollout, reward=reward)
        s.metadata = {"fsm": {"reward_weight": weight}} if weight is not None else {}
        return s

    # one sample per rollout: slime's group normalization, and ours the same
    plain = [sample(0, 0, 1.0), sample(0, 1, -1.0), sample(1, 2, 0.5), sample(1, 3, 0.0)]
    slimes_raw, slimes = post_process(manager, plain)
    raw, ours = normalize_rewards_by_group(args, plain)
    assert raw == slimes_raw and ours == pytest.approx(slimes, abs=1e-6)
    assert ours == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-4)
    # rollout 0 fans out to two samples (discounted: 0.5 of 1.0, then 1.0): five samples, not 2 x 2
    fanned = [sample(0, 0, 0.5, 0.5), sample(0, 0, 1.0, 1.0), sample(0, 1, -1.0), sample(1, 2, 0.5), sample(1, 3, 0.0)]
    _, slimes = post_process(manager, fanned)
    step = [0.5, 1.0, -1.0, 0.5, 0.0]  # the whole step is one group: both prompts, rollout 0 twice
    assert slimes == pytest.approx([(r - statistics.mean(step)) / (statistics.stdev(step) + 1e-6) for r in step], abs=1e-5)
    _, ours = normalize_rewards_by_group(args, fanned)
    # per prompt, each rollout once; each sample its share of its rollout's
    assert ours == pytest.approx([0.3536, 0.7071, -0.7071, 0.7071, -0.7071], abs=1e-4)
    # where slime does not normalize, the rewards as they are
    args.advantage_estimator = "ppo"
    assert normalize_rewards_by_group(args, fanned) == ([0.5, 1.0, -1.0, 0.5, 0.0],) * 2
