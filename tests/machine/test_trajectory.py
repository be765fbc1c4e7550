"""The Trajectory keeps every per-token array aligned; check() catches what it must."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.machine.trajectory import InvariantViolation, LossMask, Trajectory


def make() -> Trajectory:
    t = Trajectory()
    t.reset([1, 2, 3])
    t.append_model_turn([10, 11], [-0.5, -0.25])
    t.append_observation([20, 21, 22])
    t.append_model_turn([12], [-1.0])
    return t


def test_appends_keep_arrays_aligned_with_masks_and_zero_logprobs():
    t = make()
    assert t.response_ids.tolist() == [10, 11, 20, 21, 22, 12]
    assert t.logprobs.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert t.input_ids() == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert t.total_length == 9
    t.check(full=True, max_total_length=9)


def test_mismatched_turn_is_refused_and_changes_nothing():
    t = make()
    with pytest.raises(ValueError):
        t.append_model_turn([1, 2], [-0.1])
    assert t.response_length == 6
    t.check(full=True)


def test_trim_cuts_every_array_and_segment_together():
    t = make()
    assert t.trim(3) == 3
    assert t.response_ids.tolist() == [10, 11, 20]
    assert t.logprobs.tolist() == [-0.5, -0.25, 0.0]
    assert t.loss_mask.tolist() == [1, 1, 0]
    assert [(s.kind, s.start, s.end) for s in t.segments] == [("model", 0, 2), ("observation", 2, 3)]
    t.check(full=True)
    assert t.trim(10) == 0


def test_trim_inside_a_model_turn_keeps_its_fingerprint_valid():
    t = Trajectory()
    t.reset([1])
    t.append_model_turn([5, 6, 7], [-0.1, -0.2, -0.3])
    t.trim(2)
    t.check(full=True)
    assert t.logprobs.tolist() == [-0.1, -0.2]


def test_reset_forgets_everything():
    t = make()
    t.append_model_turn([13], [-0.5], top_p=([7, 8], [0, 2]))
    t.reset([4])
    assert (t.prompt_ids.tolist(), t.response_length, t.segments, t.top_p_ids, t.top_p_offsets) == ([4], 0, [], None, None)
    t.check(full=True)


def test_top_p_replay_is_padded_for_observations_and_trimmed_with_the_rest():
    t = Trajectory()
    t.reset([1])
    t.append_model_turn([5], [-0.1])  # a turn before replay started: empty span
    t.append_model_turn([6, 7], [-0.2, -0.3], top_p=([60, 61, 70], [0, 2, 3]))
    t.append_observation([8, 9])
    assert t.top_p_offsets.tolist() == [0, 0, 2, 3, 3, 3]
    assert t.top_p_ids.tolist() == [60, 61, 70]
    t.check(full=True)
    t.trim(2)
    assert t.top_p_offsets.tolist() == [0, 0, 2]
    assert t.top_p_ids.tolist() == [60, 61]
    t.check(full=True)


@pytest.mark.parametrize(
    "corrupt, invariant",
    [
        (lambda t: t.logprobs.append(-1.0), "I1"),
        (lambda t: t.loss_mask.truncate(len(t.loss_mask) - 1), "I1"),
        (lambda t: t.response_ids.append(5), "I1"),
    ],
)
def test_cheap_check_catches_length_desync(corrupt, invariant):
    t = make()
    corrupt(t)
    with pytest.raises(InvariantViolation) as err:
        t.check()
    assert err.value.invariant == invariant


def test_full_check_catches_changed_tokens_and_masks():
    t = make()
    t.response_ids[0] = 99  # not what the server sent
    with pytest.raises(InvariantViolation, match="I4"):
        t.check(full=True)
    t = make()
    mask = t.loss_mask.tolist()
    mask[3] = 1  # an observation token marked trainable
    t.loss_mask = LossMask.of(mask)
    with pytest.raises(InvariantViolation, match="I4"):
        t.check(full=True)
    t = make()
    t.logprobs[2] = -0.1  # an observation token with a logprob
    with pytest.raises(InvariantViolation, match="I4"):
        t.check(full=True)


def test_budget_and_text_checks():
    t = make()
    with pytest.raises(InvariantViolation, match="I2"):
        t.check(max_total_length=8)
    with pytest.raises(InvariantViolation, match="I3"):
        t.check(full=True, decode=lambda ids: "x" * len(ids), text="wrong")


def test_arrays_are_compact():
    t = Trajectory()
    t.reset([])
    t.append_model_turn(list(range(1000, 33000)), [-0.5] * 32000)
    assert isinstance(t.response_ids, array) and t.response_ids.itemsize == 4
    assert t.logprobs.itemsize == 4  # -0.5 is a float32 value
    assert t.response_ids.buffer_info()[1] * 4 + len(t.logprobs) * 4 < 32000 * 9
    assert list(t.loss_mask.runs()) == [(0, 32000)]  # one run, not a byte a token


# -- the loss mask as runs: every operation against a plain list of 0/1 ---------------------------
MASK_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 1), st.integers(0, 6)),
        st.tuples(st.just("truncate"), st.integers(-2, 40)),
        st.tuples(st.just("clear_before"), st.integers(-2, 40)),
    ),
    max_size=30,
)


@given(MASK_OPS, st.integers(0, 40), st.integers(0, 40))
def test_a_loss_mask_behaves_as_the_list_it_stands_for(ops, a, b):
    mask, model = LossMask(), []
    for op, *args in ops:
        if op == "push":
            mask.push(args[0], args[1])
            model += [args[0]] * args[1]
        elif op == "truncate":
            mask.truncate(args[0])
            model = model[: max(0, args[0])]
        else:
            mask.clear_before(args[0])
            model = [0 if i < args[0] else v for i, v in enumerate(model)]
        assert len(mask) == len(model)
        assert mask.tolist() == model
    assert mask.any_in(a, b) == any(model[a:b])
    assert LossMask.of(model).tolist() == model == list(mask)
    assert LossMask.of(model) == mask and (LossMask.of([*model, 1]) != mask)
    runs = list(mask.runs())
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(runs, runs[1:]))  # sorted and apart
    assert all(s < e for s, e in runs)


def test_a_loss_mask_takes_only_zeros_and_ones():
    with pytest.raises(ValueError, match="0 and 1"):
        LossMask.of([1, 0, 2])


# -- routed experts (routing replay, R3): rows of 2 layers x top-1, aligned with tokens[:-1] ----
RB = 8  # bytes per row: 2 layers x 1 expert x int32


def rows(*values: int) -> bytes:
    """Rows whose two layers both route to `v`, so a row names its token."""
    return array("i", [v for v in values for _ in range(2)]).tobytes()


def routed() -> Trajectory:
    t = Trajectory(expert_row_bytes=RB)
    t.reset([1, 2, 3])
    t.append_model_turn([10, 11], [-0.5, -0.25], experts=rows(1, 2, 3, 10), experts_start=0)
    return t


def test_routed_rows_cover_every_token_but_the_last_and_grow_from_the_row_asked():
    t = routed()
    assert t.routed_rows == 4 == t.total_length - 1
    t.append_observation([20, 21])
    assert t.routed_rows == 4  # the observation's rows come with the next request
    t.check(full=True)
    t.append_model_turn([12], [-1.0], experts=rows(11, 20, 21), experts_start=4)
    assert t.routed_rows == 7 == t.total_length - 1
    assert bytes(t.experts) == rows(1, 2, 3, 10, 11, 20, 21)
    t.check(full=True)


def test_a_turn_with_the_wrong_rows_changes_nothing():
    t = routed()
    before = (bytes(t.experts), t.response_ids.tolist())
    for experts, start in ((rows(11), 4), (rows(11, 12, 13), 4), (None, 4), (rows(11, 12), 5)):
        with pytest.raises(ValueError):
            t.append_model_turn([12, 13], [-1.0, -1.0], experts=experts, experts_start=start)
    assert (bytes(t.experts), t.response_ids.tolist()) == before


def test_trailing_tokens_get_the_last_real_row_and_trim_cuts_rows_with_tokens():
    t = routed()
    t.append_observation([20, 21, 22])
    padded = t.padded_routed_experts()
    assert padded == rows(1, 2, 3, 10, 10, 10, 10) and len(padded) == (t.total_length - 1) * RB
    t.trim(1)  # keep one response token: rows for the prompt and it, minus the last
    assert t.routed_rows == 3 == t.total_length - 1 and bytes(t.experts) == rows(1, 2, 3)
    t.check(full=True)


def test_reset_clears_the_rows_and_an_empty_sample_pads_with_distinct_slots():
    t = routed()
    t.reset([1, 2, 3])
    assert t.routed_rows == 0 and t.experts == bytearray()
    assert t.padded_routed_experts() == array("i", [0, 1]).tobytes() * 2  # slots 0..k-1 per row


def test_check_catches_rows_that_do_not_match_the_tokens():
    t = routed()
    t.experts.extend(rows(99))  # a row past the last token but one
    with pytest.raises(InvariantViolation, match="I1"):
        t.check()
    t = routed()
    del t.experts[-RB:]  # a model turn whose last row is missing
    with pytest.raises(InvariantViolation, match="I1"):
        t.check()
    t = routed()
    t.experts.append(0)  # not whole rows
    with pytest.raises(InvariantViolation, match="I1"):
        t.check()


# -- logprob storage: float32 while exact, float64 from the first value float32 cannot hold ----
def test_float32_logprobs_are_held_in_four_bytes_and_come_back_exactly():
    t = Trajectory()
    t.reset([1])
    values = array("f", [-0.1, -2.5e-7, -13.75]).tolist()  # what SGLang sends: float32 values as Python floats
    t.append_model_turn([5, 6, 7], values)
    t.append_observation([8])
    assert t.logprobs.itemsize == 4
    assert t.logprobs.tolist() == values + [0.0]
    t.check(full=True)


def test_a_value_float32_cannot_hold_turns_the_storage_to_float64_keeping_every_value():
    t = Trajectory()
    t.reset([1])
    first = array("f", [-0.1, -0.3]).tolist()
    t.append_model_turn([5, 6], first)
    t.append_observation([7])
    t.append_model_turn([8], [-0.1])  # -0.1 as a double is not a float32 value
    assert t.logprobs.itemsize == 8
    assert t.logprobs.tolist() == first + [0.0, -0.1]
    t.check(full=True)  # the first turn's fingerprint, taken as float32, still holds
    t.append_observation([9])
    assert t.logprobs.tolist()[-1] == 0.0 and t.logprobs.itemsize == 8
    t.trim(2)
    t.check(full=True)


def test_a_turn_changed_before_the_storage_widens_is_still_caught_after():
    t = Trajectory()
    t.reset([1])
    t.append_model_turn([5, 6], array("f", [-0.5, -0.25]).tolist())
    t.logprobs[1] = -0.75  # a bug changes a stored float32 value
    t.append_model_turn([8], [-0.1])  # widens: fingerprints are taken again, but not for the changed turn
    assert t.logprobs.itemsize == 8
    with pytest.raises(InvariantViolation, match="I4"):
        t.check(full=True)


@pytest.mark.parametrize("values", [array("f", [-0.5, -0.1]).tolist(), [-0.5, -0.1]], ids=["float32", "float64"])
def test_a_checkpoint_restores_either_storage_exactly(values):
    from engine.machine import checkpoint
    from engine.machine.rollout import Saved

    t = Trajectory()
    t.reset([1, 2])
    t.append_model_turn([5, 6], values)
    r = SimpleNamespace(traj=t, record=SimpleNamespace(trace=[("GENERATE", "reply", "TOOL_CALL")], turn_log=[]),
                        turn=SimpleNamespace(reply=None, pending_calls=[]), turn_count=1, tool_call_count=0,
                        tool_calls_before_turn=0, attempt=1)
    cp = checkpoint.make_checkpoint(r, frozenset())
    saved = Saved(cp, [1, 2, 5, 6], 2, [1, 1], t.logprobs.tolist())
    restored = checkpoint.validate(saved, [1, 2], mask_offpolicy=False)
    assert not isinstance(restored, str), restored
    assert restored.traj.logprobs.tolist() == values
    assert restored.traj.logprobs.itemsize == (4 if values[1] == array("f", values)[1] else 8)
    restored.traj.check(full=True)
    tampered = Saved(cp, [1, 2, 5, 6], 2, [1, 1], [values[0], values[1] + 2**-30])
    assert checkpoint.validate(tampered, [1, 2], mask_offpolicy=False) == "response ids, logprobs or top-p replay were changed"
