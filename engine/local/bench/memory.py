"""Figure 5: bytes an in-flight sample holds at a 32k-token context.

Each sample is built the way the engine builds it: a `Rollout`, its prompt reset into
the `Trajectory`, then turns of model tokens (through the `append_model_turn` action,
from a parsed `Reply`, so the turn log is kept too) and observations (through
`append_observation`), until the response holds `memory_tokens` tokens. The sample also
keeps what the driver leaves on it between turns (the last turn's scratch: the reply, let go
of its ids and logprobs once they are in the trajectory, and the turn's decoded text; the
response text is made only when the sample ends) and what the HTTP client keeps for it: the encoded request body, extended
turn by turn and sent as it is (while a request is in flight, that body is what the
transport holds; the reply's bytes live only until they are parsed). Traced bytes
(tracemalloc) of everything still alive, divided by the number of samples, are compared
with the raw size of the same ids, logprobs and mask held as Python lists of boxed ints
and floats, and judged against 320 KiB.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from typing import Any

from engine.config import EngineConfig, RetryPolicy
from engine.local.bench.common import Figure, Sizes
from engine.machine import actions as a
from engine.machine.rollout import Inputs, Rollout, TurnScratch
from engine.sglang.client import SGLangClient
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


def build_sample(cfg: EngineConfig, tokens: int, client: SGLangClient | None = None) -> Rollout:
    """One rollout holding a `tokens`-long response, built through the engine's actions.

    With a `client`, every turn's request body is built as the driver has it built, so the
    client keeps the sample's last body, as between two turns of a real rollout.
    """
    r = Rollout(Inputs(cfg, prompt="p", sampling_params={"max_new_tokens": TURN_TOKENS}, allowed_tools=frozenset({"code_interpreter"})))
    r.prompt_ids = list(range(PROMPT_TOKENS))
    a.reset_rollout(r)
    turn = 0
    while r.traj.response_length < tokens:
        if client is not None:
            client.body(r.traj, r.inputs.sampling_params, TURN_TOKENS)
        turn_text = "x" * (TURN_TOKENS * CHARS_PER_TOKEN - 1) + chr(97 + turn % 26)  # a string of its own, as decode gives
        r.turn = TurnScratch(reply=parse_reply(_reply_body(turn)), text=turn_text)
        a.append_model_turn(r)
        r.turn.observation_ids = [(turn + i) % 150000 for i in range(min(OBSERVATION_TOKENS, tokens - r.traj.response_length))]
        a.append_observation(r)
        turn += 1
    r.traj.trim(tokens)
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
    """Traced bytes per sample, request body included, against the same per-token data as Python lists."""
    cfg = EngineConfig(max_turns=10**6, max_tool_calls=10**6)
    tokens, n = sizes.memory_tokens, sizes.memory_samples
    client = SGLangClient("http://127.0.0.1:1", None, RetryPolicy())  # type: ignore[arg-type]  # bodies only
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        samples = [build_sample(cfg, tokens, client) for _ in range(n)]
        for r in samples:  # the body of the next request, as the driver would send it now
            client.body(r.traj, r.inputs.sampling_params, TURN_TOKENS)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        client._bodies.clear()
        gc.collect()
        without_body = tracemalloc.get_traced_memory()[0]
        for r in samples:  # what the last turn's scratch (reply, turn text) alone holds
            r.turn = TurnScratch()
        gc.collect()
        without_reply = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    per_sample = (after - before) / n
    one = samples[0]
    traj = one.traj
    arrays = sum(x.buffer_info()[1] * x.itemsize for x in (traj.prompt_ids, traj.response_ids, traj.logprobs, traj.loss_mask))
    raw = list_bytes(traj.response_ids.tolist(), traj.logprobs.tolist(), traj.loss_mask.tolist())
    return Figure(
        "memory", f"bytes per in-flight sample, {tokens}-token response, request body included ({n} samples)",
        per_sample, "B", float(raw), "ids+logprobs+mask as Python lists", "value", "<=", float(320 << 10), 1,
        {"array_payload_bytes": arrays, "request_body_bytes": (after - without_body) / n,
         "last_turn_bytes": (without_body - without_reply) / n,
         "turns": one.turn_count, "bytes_per_token": per_sample / tokens},
    )
