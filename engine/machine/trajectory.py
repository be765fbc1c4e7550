"""The per-token arrays of one sample, kept aligned by construction.

`Trajectory` is the only owner of the response ids, rollout logprobs, loss mask, the
optional top-p replay arrays and the optional routed experts (routing replay, R3). Every change goes through one of its methods
(`reset`, `append_model_turn`, `append_observation`, `trim`, `mask_tokens_before`), each
of which moves all arrays together, so no other code can make them disagree.

Arrays are `array.array` rather than lists: a token costs its machine-sized values, not
boxed ints and floats held by lists (the bench's memory figure compares the two), which
matters with tens of thousands of samples in flight. The loss mask is held as its runs of
ones (`LossMask`): a few dozen runs, one per model turn, instead of a byte a token. They become lists only
when handed to slime.

Logprobs are held as float32 while every value the server sent is one exactly (SGLang's
are: its logprobs are float32 tensors made Python floats), so slime gets back the very
numbers the server sent (I4). The first value float32 cannot hold turns the array to
float64 for the rest of the sample. A model segment's fingerprint reads them as stored (and is
taken again when the storage widens); a checkpoint's reads them as float64 either way.

Routed experts are rows of `num_layers x topk` int32, one per token of the whole sequence
(prompt included) except the last, kept as raw bytes (48 layers x top-8 is 1.5 KB a token).
Rows come from the server, so tokens appended after the last request (a trailing observation)
have none until the next request: `routed_rows <= total_length - 1` always, with equality
right after a model turn. `padded_routed_experts` fills the trailing rows for the trainer.
"""

from __future__ import annotations

import itertools
import math
import zlib
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Literal

import attrs

SegmentKind = Literal["model", "observation"]


class InvariantViolation(Exception):
    """A per-token invariant (I1-I4) does not hold. Always a bug, never expected input."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


def as_float64(logprobs: array) -> array:
    """Logprobs as float64, the form a checkpoint's fingerprint reads (storage may be float32)."""
    return logprobs if logprobs.typecode == "d" else array("d", logprobs)


def _float32_exact(values: Sequence[float]) -> array | None:
    """`values` as a float32 array if that changes none of them, else None."""
    narrow = array("f", values)
    return narrow if narrow.tolist() == (values if isinstance(values, list) else list(values)) else None


def narrowed(logprobs: array) -> array:
    """`logprobs` as float32 if every value is exactly a float32 one, else unchanged."""
    if logprobs.typecode == "f":
        return logprobs
    narrow = _float32_exact(logprobs)
    return logprobs if narrow is None else narrow


def _digest(ids: array, logprobs: array) -> int:
    """A cheap fingerprint of a model segment, so `check(full=True)` can prove I4.

    It reads the logprobs as stored (float32 or float64: no conversion a turn), so a
    trajectory that widens its storage fingerprints its model segments again (`_widen`).
    """
    return zlib.crc32(logprobs.tobytes(), zlib.crc32(ids.tobytes()))


class LossMask:
    """A 0/1 mask held as its runs of ones, sorted and apart: `[start, end)` pairs, flat.

    Model turns are runs of ones and observations runs of zeros, so a 32k-token sample's mask
    is a few dozen pairs. Reads that the checks need (is any token in a span trained?) are a
    binary search; `tolist()` gives the per-token list slime takes.
    """

    __slots__ = ("_bounds", "_length")

    def __init__(self) -> None:
        self._bounds = array("i")  # start0, end0, start1, end1, ...: ascending, no two runs touching
        self._length = 0

    @classmethod
    def of(cls, values: Iterable[int]) -> LossMask:
        """The mask of per-token `values`; raises ValueError on anything but 0 and 1."""
        mask = cls()
        for value, run in itertools.groupby(values):
            if value not in (0, 1):
                raise ValueError(f"a loss mask holds 0 and 1 only, not {value!r}")
            mask.push(value, sum(1 for _ in run))
        return mask

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return f"LossMask(length={self._length}, ones={list(self.runs())})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LossMask):
            return NotImplemented
        return self._length == other._length and self._bounds == other._bounds

    __hash__ = None  # type: ignore[assignment]  # it changes

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def runs(self) -> Iterator[tuple[int, int]]:
        """The `(start, end)` spans of ones, in order."""
        b = self._bounds
        return zip(b[::2], b[1::2])

    def push(self, value: int, count: int) -> None:
        """Append `count` tokens of `value` (0 or 1)."""
        if count <= 0:
            return
        b, n = self._bounds, self._length
        if value:
            if b and b[-1] == n:
                b[-1] = n + count
            else:
                b.extend((n, n + count))
        self._length = n + count

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        if length >= self._length:
            return
        b = self._bounds
        while b and b[-2] >= length:
            del b[-2:]
        if b and b[-1] > length:
            b[-1] = length
        self._length = max(0, length)

    def clear_before(self, position: int) -> None:
        """Set every token before `position` to 0."""
        if position <= 0:
            return
        kept = array("i")
        for start, end in self.runs():
            if end > position:
                kept.extend((max(start, position), end))
        self._bounds = kept

    def any_in(self, start: int, end: int) -> bool:
        """Whether any token in `[start, end)` is 1."""
        if end <= start:
            return False
        b = self._bounds
        i = bisect_right(b, start)
        return bool(i % 2) or (i < len(b) and b[i] < end)

    def tolist(self) -> list[int]:
        """One 0 or 1 per token."""
        out = [0] * self._length
        for start, end in self.runs():
            out[start:end] = itertools.repeat(1, end - start)
        return out


@attrs.frozen
class Segment:
    """A run of response tokens of one origin: one model turn or one observation."""

    kind: SegmentKind
    start: int
    end: int
    digest: int = 0  # of ids+logprobs, model segments only
    weight_version: str | None = None  # of the policy that generated a model segment


@attrs.define(eq=False, slots=True)
class Trajectory:
    """Prompt ids plus the aligned per-token arrays of the response."""

    # functools.partial, not a lambda: a factory in C, so a new sample runs no Python frame for it.
    prompt_ids: array = attrs.field(factory=partial(array, "i"))
    response_ids: array = attrs.field(factory=partial(array, "i"))
    logprobs: array = attrs.field(factory=partial(array, "f"))  # float32 while exact; see the module docstring
    loss_mask: LossMask = attrs.field(factory=LossMask)
    segments: list[Segment] = attrs.field(factory=list)
    # Top-p replay (slime's rollout_top_p_token_ids/offsets): token i's kept ids are
    # top_p_ids[top_p_offsets[i]:top_p_offsets[i + 1]]. None when the server sends none.
    top_p_ids: array | None = None
    top_p_offsets: array | None = None
    # Routing replay: `experts` holds routed_rows * expert_row_bytes bytes; None without R3.
    expert_row_bytes: int = 0
    experts: bytearray | None = None

    def __attrs_post_init__(self) -> None:
        if self.expert_row_bytes and self.experts is None:
            self.experts = bytearray()

    # -- reading -----------------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def routed_rows(self) -> int:
        """Rows of routed experts held (0 without routing replay)."""
        return len(self.experts) // self.expert_row_bytes if self.experts is not None and self.expert_row_bytes else 0

    def padded_routed_experts(self) -> bytes | None:
        """The routed experts with one row per token but the last, as the trainer needs them.

        Tokens after the last request (a trailing observation, a turn cut by TRIM) have no row
        from any reply. They come after every trained token, so causal attention keeps their
        routing from reaching a trained position: they get the last real row again (valid,
        distinct expert ids), or slots 0..k-1 when no row exists yet.
        """
        if self.experts is None or not self.expert_row_bytes:
            return None
        missing = max(0, self.total_length - 1) - self.routed_rows
        if missing <= 0:
            return bytes(self.experts)
        if self.experts:
            filler = bytes(self.experts[-self.expert_row_bytes :])
        else:
            width = self.expert_row_bytes // 4
            filler = array("i", range(width)).tobytes()  # callers reshape to (layers, topk); see write_sample
        return bytes(self.experts) + filler * missing

    def input_ids(self) -> list[int]:
        """The ids to send for the next turn: prompt followed by the response so far."""
        return self.prompt_ids.tolist() + self.response_ids.tolist()

    # -- changing ----------------------------------------------------------------
    @classmethod
    def restore(
        cls,
        prompt_ids: Sequence[int],
        ids: array,
        logprobs: array,
        loss_mask: LossMask,
        segments: list[Segment],
        top_p: tuple[array, array] | None = None,
        experts: bytes | None = None,
        expert_row_bytes: int = 0,
    ) -> Trajectory:
        """Rebuild a trajectory from a validated checkpoint (partial rollout).

        Model segments get their fingerprints from the given ids and logprobs (as stored): the
        caller has already proved those are the ones the checkpoint was written for.
        """
        t = cls(array("i", prompt_ids), ids, narrowed(logprobs), loss_mask, expert_row_bytes=expert_row_bytes)
        if expert_row_bytes:
            t.experts = bytearray(experts or b"")
        lps = t.logprobs
        t.segments = [
            attrs.evolve(s, digest=_digest(ids[s.start : s.end], lps[s.start : s.end]) if s.kind == "model" else 0)
            for s in segments
        ]
        if top_p is not None:
            t.top_p_ids, t.top_p_offsets = top_p
        return t

    def turn(self, start: int, end: int) -> Trajectory:
        """The response tokens `[start, end)` (one model turn) as a trajectory of their own: all
        before them its prompt, its arrays theirs (top-p replay and routed experts cut with them).
        A sample per turn (engine_samples: per_turn) is made of one."""
        if not 0 <= start < end <= self.response_length:
            raise ValueError(f"no turn [{start}, {end}) in a response of {self.response_length} tokens")
        prompt = self.prompt_ids.tolist() + self.response_ids[:start].tolist()
        kept = [attrs.evolve(s, start=s.start - start, end=s.end - start)
                for s in self.segments if s.start >= start and s.end <= end]
        top_p = None
        if self.top_p_offsets is not None and self.top_p_ids is not None:
            base = self.top_p_offsets[start]
            top_p = (self.top_p_ids[base:self.top_p_offsets[end]], array("i", (o - base for o in self.top_p_offsets[start:end + 1])))
        experts = None
        if self.experts is not None and self.expert_row_bytes:
            experts = bytes(self.experts[: (len(prompt) + end - start - 1) * self.expert_row_bytes])
        return Trajectory.restore(prompt, self.response_ids[start:end], self.logprobs[start:end],
                                  LossMask.of(self.loss_mask.tolist()[start:end]), kept, top_p, experts, self.expert_row_bytes)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start over from a prompt: every per-token array is emptied together."""
        self.prompt_ids = array("i", prompt_ids)
        self.response_ids = array("i")
        self.logprobs = array("f")
        self.loss_mask = LossMask()
        self.segments = []
        self.top_p_ids = None
        self.top_p_offsets = None
        self.experts = bytearray() if self.expert_row_bytes else None

    def append_model_turn(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        top_p: tuple[Sequence[int], Sequence[int]] | None = None,
        weight_version: str | None = None,
        experts: bytes | None = None,
        experts_start: int = 0,
    ) -> None:
        """Append tokens the server generated, with their logprobs (mask 1).

        `top_p` is the turn's replay data as (kept ids, offsets with len(ids) + 1 entries
        starting at 0). `experts` are the routed-expert rows the reply sent, from row
        `experts_start` to the new sequence's last token but one. Raises ValueError,
        changing nothing, if lengths disagree.
        """
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} logprobs")
        if self.experts is not None and (ids or experts is not None):
            self._check_expert_rows(len(ids), experts, experts_start)
        if top_p is not None:
            kept, offsets = top_p
            if len(offsets) != len(ids) + 1 or (offsets and (offsets[0] != 0 or offsets[-1] != len(kept))):
                raise ValueError("top-p offsets do not match the turn's tokens")
        elif self.top_p_offsets is not None and ids:
            raise ValueError("this trajectory carries top-p replay but the turn has none")
        new_ids, new_logprobs = array("i", ids), self._logprob_array(logprobs)
        start = len(self.response_ids)
        self._extend(new_ids, new_logprobs, 1)
        if self.experts is not None and experts is not None:
            del self.experts[experts_start * self.expert_row_bytes :]
            self.experts.extend(experts)
        if top_p is not None:
            self._extend_top_p(top_p[0], top_p[1])
        if new_ids:
            digest = _digest(new_ids, new_logprobs)
            self.segments.append(Segment("model", start, start + len(new_ids), digest, weight_version))

    def _check_expert_rows(self, new_tokens: int, experts: bytes | None, start: int) -> None:
        rb = self.expert_row_bytes
        if experts is None:
            raise ValueError("this trajectory carries routed experts but the turn has none")
        expected = self.total_length + new_tokens - 1 - start
        if not 0 <= start <= self.routed_rows or len(experts) != expected * rb:
            raise ValueError(f"{len(experts) / rb:g} routed-expert rows from row {start}, expected {expected}")

    def append_observation(self, ids: Sequence[int]) -> None:
        """Append environment tokens (tool output, template glue): mask 0, logprob 0.0."""
        if not ids:
            return
        start = len(self.response_ids)
        lp = self.logprobs
        self._extend(array("i", ids), array(lp.typecode, bytes(lp.itemsize * len(ids))), 0)
        if self.top_p_offsets is not None:
            # Observation tokens keep no nucleus: empty spans, as slime pads them.
            self.top_p_offsets.extend([self.top_p_offsets[-1]] * len(ids))
        self.segments.append(Segment("observation", start, start + len(ids)))

    def trim(self, max_response_length: int) -> int:
        """Cut every per-token array to `max_response_length` tokens; return how many were cut."""
        keep = max(0, max_response_length)
        cut = len(self.response_ids) - keep
        if cut <= 0:
            return 0
        del self.response_ids[keep:]
        del self.logprobs[keep:]
        self.loss_mask.truncate(keep)
        if self.top_p_offsets is not None and self.top_p_ids is not None:
            del self.top_p_offsets[keep + 1 :]
            del self.top_p_ids[self.top_p_offsets[-1] :]
        if self.experts is not None:
            del self.experts[max(0, self.total_length - 1) * self.expert_row_bytes :]
        kept: list[Segment] = []
        for seg in self.segments:
            if seg.start >= keep:
                break
            if seg.end > keep:
                digest = _digest(self.response_ids[seg.start : keep], self.logprobs[seg.start : keep])
                seg = attrs.evolve(seg, end=keep, digest=digest if seg.kind == "model" else 0)
            kept.append(seg)
        self.segments = kept
        return cut

    def mask_tokens_before(self, position: int) -> None:
        """Set the loss mask to 0 for response tokens before `position` (off-policy masking)."""
        self.loss_mask.clear_before(position)

    def _logprob_array(self, values: Sequence[float]) -> array:
        """`values` in the trajectory's storage, turning it to float64 if float32 would change one."""
        if self.logprobs.typecode == "f":
            narrow = _float32_exact(values)
            if narrow is not None:
                return narrow
            self._widen()
        return array("d", values)

    def _widen(self) -> None:
        """Store logprobs as float64 from now on (exactly: they were float32 values), and
        fingerprint each model segment again, from the new storage, only if it still matches
        its old fingerprint: one that does not stays wrong, so `check(full=True)` reports it."""
        wide = array("d", self.logprobs)
        segments = []
        for seg in self.segments:
            if seg.kind == "model":
                ids = self.response_ids[seg.start : seg.end]
                if _digest(ids, self.logprobs[seg.start : seg.end]) == seg.digest:
                    seg = attrs.evolve(seg, digest=_digest(ids, wide[seg.start : seg.end]))
            segments.append(seg)
        self.logprobs, self.segments = wide, segments

    def _extend(self, ids: array, logprobs: array, mask: int) -> None:
        self.response_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.loss_mask.push(mask, len(ids))

    def _extend_top_p(self, kept: Sequence[int], offsets: Sequence[int]) -> None:
        if self.top_p_offsets is None or self.top_p_ids is None:
            # The first replayed turn may follow plain turns: give those empty spans.
            self.top_p_ids = array("i")
            self.top_p_offsets = array("i", [0] * (len(self.response_ids) - len(offsets) + 2))
        base = self.top_p_offsets[-1]
        self.top_p_ids.extend(kept)
        self.top_p_offsets.extend(base + o for o in offsets[1:])

    # -- checking ----------------------------------------------------------------
    def check(
        self,
        *,
        max_total_length: int | None = None,
        full: bool = False,
        decode: Callable[[list[int]], str] | None = None,
        text: str | None = None,
    ) -> None:
        """Raise InvariantViolation unless I1 (and, when asked, I2-I4) hold.

        The cheap form (lengths only, O(1)) runs after every transition; `full=True`
        walks every token (I4 against each model segment's fingerprint) and is meant
        for terminal states. I2 is checked when `max_total_length` is given, I3's text
        half when both `decode` and `text` are given.
        """
        n = len(self.response_ids)
        if not (len(self.logprobs) == n and len(self.loss_mask) == n):
            raise InvariantViolation(
                "I1", f"ids={n} logprobs={len(self.logprobs)} loss_mask={len(self.loss_mask)}"
            )
        if self.top_p_offsets is not None:
            if self.top_p_ids is None or len(self.top_p_offsets) != n + 1:
                raise InvariantViolation("I1", f"top-p offsets={len(self.top_p_offsets)} for {n} tokens")
            if self.top_p_offsets[0] != 0 or self.top_p_offsets[-1] != len(self.top_p_ids):
                raise InvariantViolation("I1", "top-p offsets do not span the kept ids")
        if self.experts is not None:
            self._check_experts()
        last_end = self.segments[-1].end if self.segments else 0
        if last_end != n:
            raise InvariantViolation("I1", f"segments cover {last_end} of {n} tokens")
        if max_total_length is not None and self.total_length > max_total_length:
            raise InvariantViolation("I2", f"prompt+response={self.total_length} > budget {max_total_length}")
        if full:
            self._check_segments()
            if decode is not None and text is not None and decode(self.response_ids.tolist()) != text:
                raise InvariantViolation("I3", "response text differs from decode(response_ids)")

    def _check_experts(self) -> None:
        """I1 for routed experts: whole rows, never past the last token but one, and up to it
        right after a model turn (rows of later tokens come with the next request)."""
        rb, rows, most = self.expert_row_bytes, self.routed_rows, max(0, self.total_length - 1)
        assert self.experts is not None
        if not rb or len(self.experts) % rb:
            raise InvariantViolation("I1", f"routed experts hold {len(self.experts)} bytes, not whole rows of {rb}")
        if rows > most or (self.segments and self.segments[-1].kind == "model" and rows != most):
            raise InvariantViolation("I1", f"{rows} routed-expert rows for {self.total_length} tokens")

    def _check_segments(self) -> None:
        expected_start = 0
        for seg in self.segments:
            if seg.start != expected_start or seg.end <= seg.start:
                raise InvariantViolation("I1", f"segment {seg} does not follow {expected_start}")
            expected_start = seg.end
            lps = self.logprobs[seg.start : seg.end]
            # Whole-array scans in C (count, sum, max): this walk runs once per sample, over every token.
            if seg.kind == "observation":
                if self.loss_mask.any_in(seg.start, seg.end) or lps.count(0.0) != len(lps):
                    raise InvariantViolation("I4", f"observation {seg.start}:{seg.end} has mask 1 or logprob != 0")
            else:
                if _digest(self.response_ids[seg.start : seg.end], lps) != seg.digest:
                    raise InvariantViolation("I4", f"model turn {seg.start}:{seg.end} differs from the server's")
                if math.isnan(sum(lps)) or max(lps) > 0.0:  # a NaN anywhere makes the sum NaN
                    raise InvariantViolation("I4", f"model turn {seg.start}:{seg.end} has a logprob > 0 or NaN")
        if self.top_p_offsets is not None and any(
            b < a for a, b in zip(self.top_p_offsets, self.top_p_offsets[1:])
        ):
            raise InvariantViolation("I1", "top-p offsets decrease")
