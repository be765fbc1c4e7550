"""No exception out of `generate` for any input: tool lists, sampling params, metadata, prompts, args."""

from __future__ import annotations

import math
import types
from typing import Any

import httpx
import pytest
import respx

from engine import tools
from engine import slime
from engine.local.invariants import REASON_STATUS
from engine.local.sample import Sample
from tests.conftest import run
from tests.slime.slime_rules import generate_and_rm, train_view
from tests.support.helpers import SAMPLING, URL, ScriptedServer, encode, make_args, reply_body, tok

ANSWER = "Answer: \\boxed{42}"
SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "description": "Runs the dataset's own Python.",
                                          "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}


def answer_server() -> ScriptedServer:
    return ScriptedServer([httpx.Response(200, json=reply_body(encode(ANSWER) + [151645]))], repeat_last=True)


def generate(sample: Any, params: Any = SAMPLING, **args_kw: Any) -> tuple[Any, ScriptedServer]:
    server = answer_server()
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        out = run(slime.generate(make_args(**args_kw), sample, dict(params) if isinstance(params, dict) else params))
    # the chat profile's Qwen3 template drops earlier reasoning: samples may fan out, so each is a list
    assert out == [sample] if args_kw.get("engine_profile") == "chat" else out is sample
    return sample, server


def prompt_text(server: ScriptedServer) -> str:
    return tok().decode(server.requests[0]["input_ids"])


# -- metadata["tools"] -------------------------------------------------------------------
def test_tool_schemas_from_the_dataset_offer_the_tools_they_name() -> None:
    sample, server = generate(Sample(prompt="Q", metadata={"tools": [SCHEMA]}))
    assert sample.status == Sample.Status.COMPLETED
    assert '"name": "code_interpreter"' in prompt_text(server)
    assert "Runs the dataset's own Python." not in prompt_text(server)  # retool shows the example's spec
    assert "tools_unavailable" not in sample.metadata["fsm"]
    assert sample.metadata["tools"] == [SCHEMA]  # the user's metadata is left as it was


def test_tool_names_offer_registered_tools_and_record_the_ones_the_engine_cannot_serve() -> None:
    sample, server = generate(Sample(prompt="Q", metadata={"tools": ["python_session", "web_search"]}))
    text = prompt_text(server)
    assert '"name": "python_session"' in text and '"name": "code_interpreter"' not in text
    assert sample.metadata["fsm"]["tools_unavailable"] == ["web_search"]


def test_bare_function_objects_are_schemas_too() -> None:
    sample, server = generate(Sample(prompt="Q", metadata={"tools": [SCHEMA["function"]]}), engine_profile="chat")
    assert sample.status == Sample.Status.COMPLETED
    assert "Runs the dataset's own Python." in prompt_text(server)


def test_the_chat_profile_renders_the_samples_own_schemas() -> None:
    sample, server = generate(Sample(prompt="Q", metadata={"tools": [SCHEMA]}), engine_profile="chat")
    text = prompt_text(server)
    assert "Runs the dataset's own Python." in text
    assert tools.get("code_interpreter").description not in text  # type: ignore[union-attr]


def test_without_a_tool_list_retool_offers_code_interpreter_alone_as_slimes_example() -> None:
    _, server = generate(Sample(prompt="Q"))
    text = prompt_text(server)
    assert '"name": "code_interpreter"' in text and "python_session" not in text
    _, server = generate(Sample(prompt="Q"), engine_tools="code_interpreter,python_session")
    assert "python_session" in prompt_text(server)


@pytest.mark.parametrize("junk", [
    "code_interpreter", 42, {"name": "code_interpreter"}, [1, 2], [None], [{"type": "function"}],
    [{"function": {"name": 7}}], [{"function": "code_interpreter"}], [""], [["code_interpreter"]],
])
def test_any_other_shape_of_tools_ends_the_sample_with_a_reason(junk: Any) -> None:
    sample, server = generate(Sample(prompt="Q", label="42", metadata={"tools": junk}))
    assert server.requests == []
    assert sample.status == Sample.Status.FAILED and sample.remove_sample is True
    assert sample.metadata["fsm"]["termination_reason"] == "bad_sample_input"
    assert "metadata['tools']" in sample.metadata["fsm"]["engine_error"]
    generate_and_rm(None, sample)
    train_view(sample)  # slime trains on it without a crash, and nothing of it


# -- sampling params, max_new_tokens, metadata, prompt -------------------------------------
@pytest.mark.parametrize("params", [None, [], "temperature=1", 3])
def test_sampling_params_that_are_not_a_dict(params: Any) -> None:
    sample, server = generate(Sample(prompt="Q"), params)
    assert server.requests == [] and sample.metadata["fsm"]["termination_reason"] == "bad_sample_input"


@pytest.mark.parametrize("value", ["256", 1.5, math.nan, math.inf, -math.inf, True, [256], {"n": 1}])
def test_max_new_tokens_that_is_not_an_integer(value: Any) -> None:
    sample, server = generate(Sample(prompt="Q"), {**SAMPLING, "max_new_tokens": value})
    assert server.requests == []
    assert sample.metadata["fsm"]["termination_reason"] == "bad_sample_input"
    assert "max_new_tokens" in sample.metadata["fsm"]["engine_error"]


def test_max_new_tokens_negative_or_zero_is_truncated_without_a_request_and_integral_floats_are_taken() -> None:
    sample, server = generate(Sample(prompt="Q"), {**SAMPLING, "max_new_tokens": -3})
    assert server.requests == [] and sample.metadata["fsm"]["termination_reason"] == "no_new_tokens_asked"
    sample, server = generate(Sample(prompt="Q"), {**SAMPLING, "max_new_tokens": 64.0})
    assert server.requests[0]["sampling_params"]["max_new_tokens"] == 64


@pytest.mark.parametrize("metadata", [None, [], "x", 5, {"tools": None}, {"fsm": "junk"}])
def test_metadata_of_any_type(metadata: Any) -> None:
    sample = Sample(prompt="Q")
    sample.metadata = metadata
    generate(sample)
    assert sample.status == Sample.Status.COMPLETED


@pytest.mark.parametrize("prompt", [None, 5, b"bytes", {"role": "user"}, [], [1, 2], [{"content": "no role"}]])
def test_a_prompt_of_any_other_type_ends_the_sample_with_a_reason(prompt: Any) -> None:
    sample = Sample()
    sample.prompt = prompt
    generate(sample)
    assert sample.metadata["fsm"]["termination_reason"] == "bad_sample_input"


def test_a_sample_object_missing_fields_or_raising_on_read_comes_back() -> None:
    bare = types.SimpleNamespace(prompt="Q")  # no status, metadata, stats objects...
    generate(bare)
    assert bare.response_length == len(bare.loss_mask) > 0

    class Hostile(types.SimpleNamespace):
        @property
        def prompt(self) -> str:
            raise RuntimeError("no prompt for you")

    hostile = Hostile()
    _, server = generate(hostile)
    assert server.requests == []
    assert hostile.response_length == 1 and hostile.remove_sample is True  # slime's 1-token dummy


def test_unusable_settings_end_every_sample_with_engine_setup_failed() -> None:
    sample, server = generate(Sample(prompt="Q"), engine_max_turns="many")
    assert server.requests == []
    assert (sample.status, sample.metadata["fsm"]["termination_reason"]) == (Sample.Status.FAILED, "engine_setup_failed")
    sample, _ = generate(Sample(prompt="Q"), use_rollout_routing_replay=True)  # no num_layers / moe_router_topk
    assert sample.metadata["fsm"]["termination_reason"] == "engine_setup_failed"


def test_every_reason_these_inputs_end_with_is_in_the_reason_table() -> None:
    for reason in ("bad_sample_input", "engine_setup_failed", "attempts_exhausted", "top_p_replay_missing",
                   "routed_experts_mismatch"):
        assert reason in REASON_STATUS


def test_a_sample_that_refuses_its_fields_still_raises_nothing() -> None:
    class Frozen:
        prompt = None

        def __setattr__(self, name: str, value: Any) -> None:
            raise AttributeError("read-only sample")

    generate(Frozen())  # bad input, and the outcome cannot be written: logged, not raised
