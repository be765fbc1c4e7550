"""Figure 5: bytes an in-flight sample holds at a 32k-token context.

Each sample is built the way the engine builds it: a `Rollout`, its prompt reset into
the `Trajectory`, then turns of model tokens (through the `append_model_turn` action,
from a parsed `Reply`, so the turn log is kept too) and observations (through
`append_observation`), until the response holds `memory_tokens` tokens. The sample also
keeps what the driver leaves on it between turns: the last reply (with its raw
`meta_info`) and the response text. Traced bytes (tracemalloc) of everything still
alive, divided by the number of samples, are compared with the raw size of the same
ids, logprobs and mask held as Python lists of boxed ints and floats.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from typing import Any

from engine.machine import actions as a
from engine.local.bench.common import Figure, Sizes
from engine.config import EngineConfig
from engine.machine.rollout import Inputs, Rollout, TurnScratch
from engine.sglang.wire import parse_reply

TURN_TOKENS = 900  # model tokens per turn
OBSERVATION_TOKENS = 124  # tool-output tokens per turn
PROMPT_TOKENS = 400
CHARS_PER_TOKEN = 4  # typical for English text and code with a BPE vocabulary


def _reply_body(turn: int) -> dict[str, Any]:
    ids = [(turn * 131 + i * 17) % 150000 for i in range(TURN_TOKENS)]
    return {
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": "</code>"},
            "weight_version": "default",
            "output_token_logprobs": [[-((i * 7) % 97 + 1) / 64, t, None] for i, t in enumerate(ids)],
        },
    }


def build_sample(cfg: EngineConfig, tokens: int, text: str) -> Rollout:
    """One rollout holding a `tokens`-long response, built through the engine's actions."""
    r = Rollout(Inputs(cfg, prompt="p", sampling_params={"max_new_tokens": TURN_TOKENS}, allowed_tools=frozenset({"code_interpreter"})))
    r.prompt_ids = list(range(PROMPT_TOKENS))
    a.reset_rollout(r)
    turn = 0
    while r.traj.response_length < tokens:
        r.turn = TurnScratch(reply=parse_reply(_reply_body(turn)))
        a.append_model_turn(r)
        r.turn.observation_ids = [(turn + i) % 150000 for i in range(min(OBSERVATION_TOKENS, tokens - r.traj.response_length))]
        a.append_observation(r)
        turn += 1
    r.traj.trim(tokens)
    r.text = text[:-1] + chr(97 + len(r.record.trace) % 26)  # a string of its own, as decode would give
    return r


def list_bytes(ids: list[int], logprobs: list[float], mask: list[int]) -> int:
    """sys.getsizeof of the three lists plus every element object they point to.

    Small ints (-5..256) are shared singletons in CPython, so they add nothing per sample;
    every other int and every float is an object of its own, as after JSON parsing.
    """
    total = sum(sys.getsizeof(x) for x in (ids, logprobs, mask))
    total += sum(sys.getsizeof(i) for i in ids if not -5 <= i <= 256)
    total += sum(sys.getsizeof(f) for f in logprobs)
    return total


def memory_figure(sizes: Sizes) -> Figure:
    """Traced bytes per sample against the same per-token data as Python lists."""
    cfg = EngineConfig(max_turns=10**6, max_tool_calls=10**6)
    tokens, n = sizes.memory_tokens, sizes.memory_samples
    text = "x" * (tokens * CHARS_PER_TOKEN)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        samples = [build_sample(cfg, tokens, text) for _ in range(n)]
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        for r in samples:  # what the last reply (ids, logprobs, raw meta_info) alone holds
            r.turn = TurnScratch()
        gc.collect()
        without_reply = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    per_sample = (after - before) / n
    one = samples[0]
    traj = one.traj
    arrays = sum(x.buffer_info()[1] * x.itemsize for x in (traj.response_ids, traj.logprobs, traj.loss_mask))
    raw = list_bytes(traj.response_ids.tolist(), traj.logprobs.tolist(), traj.loss_mask.tolist())
    return Figure(
        "memory", f"bytes per in-flight sample, {tokens}-token response ({n} samples)", per_sample, "B",
        float(raw), "ids+logprobs+mask as Python lists", "value", "<=", float(1 << 20), 1,
        {"array_payload_bytes": arrays, "text_bytes": sys.getsizeof(one.text), "turns": one.turn_count,
         "last_reply_bytes": (after - without_reply) / n, "bytes_per_token": per_sample / tokens},
    )
