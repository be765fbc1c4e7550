"""The chat profile with the real Qwen3 tokenizer: template deltas, several calls per turn."""

from __future__ import annotations

import json
import logging

import pytest
import respx

import engine.logs

from engine.settings import EngineConfig, RetryPolicy
from engine.loop.driver import drive, new_rollout
from engine.profiles.chat import ChatProfile, full_render_ids, incremental_ids, parse_hermes_turn
from engine.profiles.tokenizer import load_tokenizer, offline_tokenizer_dir
from engine.loop.runtime import Runtime
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, tok, turn


def call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "code_interpreter", "arguments": {"code": code}}) + "\n</tool_call>"


def chat_rollout(script: list, **kw):
    server = ScriptedServer(script)
    cfg = EngineConfig(server_url=URL, profile="chat", max_context_len=8192, retry=RetryPolicy(max_attempts=1), **kw)

    async def go():
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            rt = Runtime.create(cfg, tokenizer=tok())
            r = new_rollout(rt, [{"role": "user", "content": "What is 6*7?"}], SAMPLING)
            await drive(rt, r)
            await rt.aclose()
            return rt, r

    rt, r = run(go())
    return rt.profile, r, server


def test_qwen3_template_has_no_drift_for_plain_turns():
    assert ChatProfile(tok()).drift is None


def test_multi_turn_ids_equal_a_full_chat_template_render(fake_interpreter):
    t1 = "I will use the tool.\n" + call("print(6*7)")
    t2 = call("print(6*7+0)") + "\n" + call("print(42)")
    profile, r, server = chat_rollout([turn(t1), turn(t2), turn("It is 42.\nAnswer: \\boxed{42}")])
    assert r.state == "COMPLETED"
    assert fake_interpreter.codes == ["print(6*7)", "print(6*7+0)", "print(42)"]
    messages = [{"role": "user", "content": "What is 6*7?"}]
    # the context the model saw for its last turn equals a full render of the same conversation
    convo_turns = [(t1, ["Output:\nprint(6*7)"]), (t2, ["Output:\nprint(6*7+0)", "Output:\nprint(42)"])]
    last_request = server.requests[-1]["input_ids"]
    full = full_render_ids_with_tools(profile, messages, convo_turns)
    assert last_request == full
    assert incremental_ids_with_tools(profile, messages, convo_turns) == full
    # template glue and tool output are mask 0; every model token is mask 1
    for seg in r.traj.segments:
        mask = set(r.traj.loss_mask.tolist()[seg.start : seg.end])
        assert mask == ({1} if seg.kind == "model" else {0})


def full_render_ids_with_tools(profile, messages, turns):
    from engine import tools

    schemas = [tools.get(n).schema() for n in tools.names()]
    convo = list(messages)
    for text, outs in turns:
        convo.append({"role": "assistant", "content": text})
        convo += [{"role": "tool", "content": o} for o in outs]
    return profile.encode(profile.tokenizer.apply_chat_template(convo, tools=schemas, tokenize=False, add_generation_prompt=True))


def incremental_ids_with_tools(profile, messages, turns):
    from engine import tools

    schemas = [tools.get(n).schema() for n in tools.names()]
    ids = profile.render_prompt(messages, schemas)
    return ids + incremental_ids(profile, messages, turns)[len(profile.render_prompt(messages, [])) :]


class HistoryRewritingTokenizer:
    """A real tokenizer behind a template that drops the reasoning of every assistant turn but the
    conversation's last (`<think>` blocks in the content and `reasoning_content`): it rewrites past turns."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *args, **kw):
        return self._inner(*args, **kw)

    def apply_chat_template(self, messages, **kw):
        def strip(m):
            if m["role"] != "assistant":
                return m
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            return {**m, "content": m["content"].split("</think>")[-1].lstrip()} if m.get("content") else m

        return self._inner.apply_chat_template([strip(m) for m in messages[:-1]] + messages[-1:], **kw)


def test_drift_check_reports_a_template_that_rewrites_history(caplog):
    engine.logs.forget()  # said once per process: another test's profile may have said it
    with caplog.at_level(logging.WARNING, logger="engine.profiles.chat"):
        profile = ChatProfile(HistoryRewritingTokenizer(tok()))
    assert profile.drift is not None and "token" in profile.drift  # seen at start-up
    assert "chat template check (parser qwen)" in caplog.text
    messages = [{"role": "user", "content": "Q"}]
    turns = [("<think>\nhmm\n</think>\n\n" + call("print(1)"), ["1"])]
    ours, theirs = incremental_ids(profile, messages, turns), full_render_ids(profile, messages, turns)
    assert ours != theirs and len(ours) > len(theirs)


# Real chat templates, each read by the parser it names (tests/profiles/test_family_rollouts.py).
NO_DRIFT = ["glm-4.5v", "glm-4.7-flash", "qwen-2.5", "qwen-3", "qwen-3.5", "deepseek-v3.1", "minimax"]


@pytest.mark.parametrize("model", NO_DRIFT)
def test_real_templates_of_each_family_show_no_false_drift(model, caplog):
    # the check writes the conversation in the template's own rendering of the family's calls
    with caplog.at_level(logging.WARNING, logger="engine.profiles.chat"):
        profile = ChatProfile(load_tokenizer(offline_tokenizer_dir(model)))
    assert profile.tool_parser in {"glm45", "glm47", "qwen", "qwen3_coder", "deepseekv31", "minimax-m2"}
    assert profile.drift is None and "chat template" not in caplog.text, profile.drift
    assert not profile.shows_calls  # results render without the call's name or id: one render per observation


@pytest.mark.parametrize("model", ["glm-4.7-flash", "qwen-3.5", "minimax"])
def test_a_family_template_that_drops_past_reasoning_is_reported(model, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.profiles.chat"):
        profile = ChatProfile(HistoryRewritingTokenizer(load_tokenizer(offline_tokenizer_dir(model))))
    assert profile.drift is not None and "token" in profile.drift, profile.drift
    assert "chat template check" in caplog.text


@pytest.mark.parametrize("model", ["deepseek-r1", "qwq-32b"])
def test_real_templates_that_drop_the_reasoning_of_past_turns_are_reported(model):
    # R1's and QwQ's templates open <think> in the prompt but render past turns without it
    drift = ChatProfile(load_tokenizer(offline_tokenizer_dir(model))).drift
    assert drift is not None and "rewrites the turn it prompts for" in drift and "<think>" in drift, drift


def test_a_parser_that_does_not_read_the_template_s_calls_is_reported():
    # hermes configured for GLM-4.7: its calls would all be read as final answers
    profile = ChatProfile(load_tokenizer(offline_tokenizer_dir("glm-4.7-flash")), tool_parser="hermes")
    assert profile.drift is not None and "the hermes parser" in profile.drift and "<arg_key>" in profile.drift
    assert ChatProfile(tok(), tool_parser="hermes").drift is None  # the same parser on Qwen3's template: nothing


def test_tool_results_follow_a_turn_with_calls_where_the_template_demands_one():
    # MiniMax's template refuses tool messages after an assistant turn without tool_calls
    profile = ChatProfile(load_tokenizer(offline_tokenizer_dir("minimax")))
    assert profile.closer == "[e~["
    assert profile.tool_delta(["42", "x"]) == "[e~[\n]~b]tool\n<response>42</response>\n<response>x</response>[e~[\n]~b]ai\n<think>\n"


def test_surplus_calls_are_answered_with_an_error_not_dropped(fake_interpreter):
    many = "\n".join(call(f"print({i})") for i in range(3))
    profile, r, _ = chat_rollout([turn(many), turn("Done.")], max_calls_per_turn=2)
    assert fake_interpreter.codes == ["print(0)", "print(1)"]
    assert r.record.tools.errors == {"surplus_call": 1}
    assert r.text.count("<tool_response>") == 3
    assert "too many tool calls in this turn" in r.text


def test_turn_cut_by_a_stop_string_is_closed_by_the_template(fake_interpreter):
    # no <|im_end|>: the turn stopped on "</tool_call>", so the delta opens with the end token
    profile, r, _ = chat_rollout([turn(call("print(1)"), eos=False), turn("Done.")])
    obs = r.traj.segments[1]
    assert r.traj.response_ids[obs.start] == profile.eos_id
    assert r.state == "COMPLETED"


def test_hermes_parsing():
    assert parse_hermes_turn("no calls here").action == "answer"
    t = parse_hermes_turn(call("a") + call("b"))
    assert [c.arguments["code"] for c in t.calls] == ["a", "b"]
    bad = parse_hermes_turn("<tool_call>{oops</tool_call>")
    assert bad.calls[0].error == "malformed_call"
    unclosed = parse_hermes_turn('<tool_call>{"name": "x"')
    assert unclosed.calls[0].error == "malformed_call"


def test_a_glm_call_under_hermes_ends_the_sample_as_a_counted_answer_a_broken_json_one_gets_an_error(fake_interpreter):
    from engine import slime
    from engine.local.sample import Sample
    from engine.trace.paths import flow_table
    from engine.trace.summary import format_summary, summarize

    glm = "Let me check.\n<tool_call>code_interpreter<arg_key>code</arg_key><arg_value>print(6*7)</arg_value></tool_call>"
    broken = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6*7)"\n</tool_call>'
    scripts = [[turn(glm)], [turn(broken), turn("It is 42.\nAnswer: \\boxed{42}")]]
    samples = []
    for script in scripts:
        server = ScriptedServer(script)
        sample = Sample(prompt="What is 6 * 7?", label="42")
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            run(slime.generate(make_args(engine_profile="chat", engine_tool_parser="hermes", engine_tools=["code_interpreter"]),
                               sample, dict(SAMPLING)))
        samples.append(sample)
    foreign, malformed = (s.metadata["fsm"] for s in samples)
    # GLM's call in hermes's tags: read as the answer (the tool never ran), the turn marked glm47
    assert samples[0].status == Sample.Status.COMPLETED and fake_interpreter.codes == []
    assert [t.get("foreign_format") for t in foreign["turns"]] == ["glm47"]
    # hermes JSON cut short: an error observation, and the model goes on to answer
    assert malformed["tool_stats"]["errors"] == {"malformed_call": 1} and len(malformed["turns"]) == 2
    assert not any(t.get("foreign_format") for t in malformed["turns"])
    dicts = [s.to_dict() for s in samples]
    shown = format_summary(summarize(dicts))
    assert "answers that look like calls of another format:\n  glm47" in shown
    assert "answers that look like calls of another format:\n  glm47  1" in flow_table(dicts)
