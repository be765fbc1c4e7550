"""An outside check of a finished sample: I1-I4 and I6 re-derived from its fields alone.

The engine checks its own `Trajectory` after every transition; this module checks what the
trainer receives instead (the sample's `tokens`, `loss_mask`, `rollout_log_probs`, `response`,
status and metadata), with nothing but the prompt's ids, the budget, a decode function and,
when known, the replies the server sent. It shares no code with the engine's own checks, so
a bug there cannot hide itself here; only the vocabulary (the terminal states, which reason
ends in which status) is read from the machine's definition. Used by `python -m engine soak` and the property tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.machine.states import TERMINALS
from engine.machine.table import MachineSpec

# Termination reason -> the status it must end in (I6): every reason an edge of the machine
# records, read from its table (a new state's reasons need no edit here), and the reasons set
# outside the machine, by the attempts policy and the adapter, written out.
OUTSIDE_REASONS: dict[str, str] = {
    "attempts_exhausted": "FAILED",  # no attempt finished (engine.loop.attempts); remove_sample
    "bad_sample_input": "FAILED",  # never reached the machine: prompt, tools or sampling params unusable
    "engine_setup_failed": "FAILED",  # never reached the machine: settings or tokenizer unusable
    "harness_made_no_call": "FAILED",  # never reached the machine: an agent's harness never called the model
    # an agent's segment a history break closed: one sample, COMPLETED, the break its reason
    "reasoning_dropped": "COMPLETED",
    "turn_rewritten": "COMPLETED",
    "history_compacted": "COMPLETED",
    "history_forked": "COMPLETED",
    "history_contradicts": "COMPLETED",
    # a segment a compaction closed (engine_compaction), and a model turn's own sample (engine_samples: per_turn)
    "summarized": "COMPLETED",
    "oldest_dropped": "COMPLETED",
    "per_turn": "COMPLETED",
}
# A stand-in tool name: every tool's state adds the same reasons (`tool_unavailable`).
REASON_STATUS: dict[str, str] = {**MachineSpec.from_registry(tool_names=("any",)).reason_statuses(), **OUTSIDE_REASONS}
# Reasons of samples that never reached the machine: no trace.
UNROLLED_REASONS = frozenset({"bad_sample_input", "engine_setup_failed", "harness_made_no_call"})
BREAK_DEST = "BUDGET_CHECK"  # where a break's edge leads: the next segment's path begins there
# A sample no attempt finished ends FAILED, its trace (the last attempt's) at ABORTED.
EXHAUSTED = "attempts_exhausted"
# Reasons that are legal for the machine but mean a bug when seen in a test or a soak.
BUG_REASONS = frozenset({"crashed", "cancelled", "invariant_violated"})
TRIMMED_REPLY = "reply_over_budget"  # the only reason whose TRIM may cut into a model turn


def _field(sample: Any, name: str, default: Any = None) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name, default)
    return getattr(sample, name, default)


def _fsm(sample: Any) -> dict[str, Any]:
    """What the engine recorded: `metadata["fsm"]` (read here by hand, sharing nothing with the engine)."""
    metadata = _field(sample, "metadata") or {}
    fsm = metadata.get("fsm") if isinstance(metadata, dict) else None
    return fsm if isinstance(fsm, dict) else {}


def status_name(sample: Any) -> str:
    """The status as an upper-case name, from slime's enum or a sample dict's value string."""
    status = _field(sample, "status")
    return str(getattr(status, "name", status)).upper()


def sample_violations(
    sample: Any,
    *,
    prompt_ids: Sequence[int],
    budget: int | None,
    decode: Callable[[list[int]], str],
    sent: Sequence[tuple[Sequence[int], Sequence[float]]] | None = None,
) -> list[str]:
    """Every invariant the finished `sample` (object or dict) breaks, as readable lines.

    `budget` is the most tokens prompt + response may hold (None: unbounded). `sent` is the
    (ids, logprobs) of each usable reply the server sent for this sample, in order; without
    it, I4 is checked only for what needs no server record (mask-0 logprobs, finite values).
    """
    out: list[str] = []
    tokens = list(_field(sample, "tokens") or [])
    n = int(_field(sample, "response_length") or 0)
    mask = _field(sample, "loss_mask")
    lps = _field(sample, "rollout_log_probs")
    mask = [] if mask is None and n == 0 else mask
    lps = [] if lps is None and n == 0 else lps
    # I1: every per-token array has response_length entries.
    if mask is None or lps is None or not len(mask) == len(lps) == n or n > len(tokens):
        lens = (len(mask) if mask is not None else None, len(lps) if lps is not None else None)
        return [f"I1: response_length={n} loss_mask/logprobs={lens} tokens={len(tokens)}"]
    offsets = _field(sample, "rollout_top_p_token_offsets")
    if offsets is not None and len(offsets) != n + 1:
        out.append(f"I1: {len(offsets)} top-p offsets for {n} tokens")
    response_ids = tokens[len(tokens) - n :]
    # I3: tokens are the prompt then the response ids; the text is their decode.
    if tokens[: len(tokens) - n] != list(prompt_ids):
        out.append(f"I3: tokens do not start with the {len(prompt_ids)} prompt ids")
    text = decode(response_ids) if n else ""
    if _field(sample, "response") != text:
        out.append("I3: response differs from decode(response ids)")
    # I2: the budget, or an empty response that slime drops when the prompt alone is over it.
    if budget is not None:
        if len(prompt_ids) > budget:
            if n or not _field(sample, "remove_sample"):
                removed = _field(sample, "remove_sample")
                out.append(f"I2: prompt over budget but response_length={n}, remove_sample={removed}")
        elif len(tokens) > budget:
            out.append(f"I2: {len(tokens)} tokens > budget {budget}")
    reason = _fsm(sample).get("termination_reason")
    out += _i4(mask, lps, response_ids, sent, trimmed=reason == TRIMMED_REPLY)
    out += _i6(sample, reason)
    return out


def _i4(mask: Sequence[int], lps: Sequence[float], ids: Sequence[int],
        sent: Sequence[tuple[Sequence[int], Sequence[float]]] | None, *, trimmed: bool) -> list[str]:
    """Mask-1 tokens are the server's (id, logprob) pairs in order; mask-0 tokens carry 0.0."""
    out: list[str] = []
    if any(m not in (0, 1) for m in mask):
        out.append("I4: loss_mask holds values other than 0 and 1")
    if any(m == 0 and lp != 0.0 for m, lp in zip(mask, lps)):
        out.append("I4: a mask-0 token has a logprob other than 0.0")
    model = [(t, lp) for t, lp, m in zip(ids, lps, mask) if m == 1]
    if any(math.isnan(lp) or lp > 0.0 for _, lp in model):
        out.append("I4: a mask-1 token has a logprob > 0 or NaN")
    if sent is not None:
        expected = [(int(t), float(lp)) for ids_, lps_ in sent for t, lp in zip(ids_, lps_)]
        ok = model == expected or (trimmed and 0 < len(model) < len(expected) and model == expected[: len(model)])
        if not ok:
            first = next((i for i, (a, b) in enumerate(zip(model, expected)) if a != b), min(len(model), len(expected)))
            out.append(f"I4: mask-1 tokens differ from the server's at token {first} ({len(model)} vs {len(expected)})")
    return out


def _i6(sample: Any, reason: str | None) -> list[str]:
    """The status says why the sample ended, and the trace's last edge leads to it."""
    out: list[str] = []
    status = status_name(sample)
    metadata = _fsm(sample)
    if status not in TERMINALS:
        return [f"I6: status {status} is not terminal"]
    if reason is None or reason in BUG_REASONS:
        out.append(f"I6: termination reason {reason!r} ({metadata.get('engine_error', '')})")
    elif REASON_STATUS.get(reason) != status:
        out.append(f"I6: reason {reason!r} ended in {status}, expected {REASON_STATUS.get(reason)}")
    if metadata.get("invariant_violation"):
        out.append(f"I6: the engine recorded a violation: {metadata['invariant_violation']}")
    trace = [tuple(edge) for edge in metadata.get("trace") or []]
    end = "ABORTED" if reason == EXHAUSTED else status
    # An agent's segments: the first begins at RESET, a later one where the break before it led;
    # each but the last ends on its break's edge.
    segment = metadata.get("segment") if isinstance(metadata.get("segment"), dict) else {}
    start = "RESET" if not segment.get("index") else BREAK_DEST
    if segment.get("ended_by") is not None:
        end = BREAK_DEST
        if segment["ended_by"] != reason:
            out.append(f"I6: the segment ended by {segment['ended_by']!r} has the reason {reason!r}")
    if segment.get("per_turn"):
        # A turn's own sample: its path goes on from where the turn before it stopped, and one that
        # is not its segment's last stops where its reply led (the next turn's path begins there).
        start = trace[0][0] if trace and segment.get("index") else start
        if segment.get("ended_by") == "per_turn":
            end = trace[-1][2] if trace and trace[-1][2] not in TERMINALS else "a state that is not terminal"
    if reason in UNROLLED_REASONS:
        if trace:
            out.append(f"I6: {reason} but the sample has a trace")
    elif not trace or trace[0][0] != start or trace[-1][2] != end:
        out.append(f"I6: trace does not lead from {start} to {end}: {trace[:1]}...{trace[-1:]}")
    elif any(a[2] != b[0] for a, b in zip(trace, trace[1:])):
        out.append("I6: trace is not a connected path")
    elif any(edge[2] in TERMINALS for edge in trace[:-1]):
        out.append("I6: trace passes a terminal state before its end (a status was overwritten)")
    return out
