"""Llama 3.1's tool-call turns against Meta's own encoder (PyPI `llama-models`: `ChatFormat` and the
Llama 3 tokenizer file shipped in the package; nothing is downloaded).

What the engine relies on for this family, checked against the real token ids: a custom tool's
call is a JSON object `{"type": "function", "name": ..., "parameters": ...}` right after the
assistant header, closed by `<|eot_id|>`, or by `<|eom_id|>` where the model awaits a result
(Meta's `end_of_message`); the `llama3` parser reads it; the result follows in the `ipython` role
and the model goes on. Both closing tokens are in Llama 3.1's stop ids, so a turn may end on either.

A whole rollout runs on a Llama-3.1-style tokenizer and template built from llama-models' files
(tests/support/llama3.py), once for each closing token: the ids the engine sends are
`ChatFormat`'s, token for token (after `<|eom_id|>` no `<|eot_id|>` is added).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.profiles.parsers import get_tool_parser

pytest.importorskip("llama_models", reason="needs llama-models (the dev extra)")

from llama_models.datatypes import RawMessage, StopReason, ToolCall  # noqa: E402
from llama_models.llama3.chat_format import ChatFormat  # noqa: E402

QUERY = "print('héllo 世界 🦜', 6 * 7)"
RESULT = "Output:\nhéllo 世界 🦜 42"
SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
FUNCTION = {"name": "lookup", "description": "Look a query up.", "parameters": SCHEMA}
CLOSERS = {"<|eot_id|>": StopReason.end_of_turn, "<|eom_id|>": StopReason.end_of_message}


def _dialog(stop: StopReason, *, result: bool = True) -> list[RawMessage]:
    from tests.support.llama3 import system_text

    call = ToolCall(call_id="c1", tool_name="lookup", arguments={"query": QUERY})
    messages = [RawMessage(role="system", content=system_text([FUNCTION])),
                RawMessage(role="user", content="What does it print? Look it up."),
                RawMessage(role="assistant", content="", stop_reason=stop, tool_calls=[call])]
    return messages + [RawMessage(role="tool", content=RESULT)] if result else messages[:2]


def _meta() -> tuple[Any, ChatFormat]:
    from tests.support.llama3 import meta_tokenizer

    tk = meta_tokenizer()
    return tk, ChatFormat(tk)


@pytest.mark.parametrize("closer", sorted(CLOSERS))
def test_meta_s_own_encoding_of_a_turn_with_a_call_and_its_result(closer: str) -> None:
    tk, cf = _meta()
    ids = cf.encode_dialog_prompt(_dialog(CLOSERS[closer])).tokens
    start = len(cf.encode_dialog_prompt(_dialog(CLOSERS[closer], result=False)).tokens)  # it ends on the assistant header
    end = ids.index(tk.special_tokens[closer], start)
    turn = tk.decode(ids[start:end + 1])
    assert turn.startswith('{"type": "function", "name": "lookup"') and turn.endswith(closer)
    read = get_tool_parser("llama3").parse(turn, {"lookup": SCHEMA})
    assert [(c.name, c.arguments, c.error) for c in read.calls] == [("lookup", {"query": QUERY}, None)]
    assert read.content == ""  # the closing token is not left as text
    # the result follows the closing token at once, in the ipython role, and the model goes on
    rest = tk.decode(ids[end + 1:])
    assert rest == f"<|start_header_id|>ipython<|end_header_id|>\n\n{RESULT}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


def test_the_template_renders_what_meta_encodes() -> None:
    from tests.support.llama3 import llama31_tokenizer

    tok = llama31_tokenizer()
    tk, cf = _meta()
    messages = [{"role": "user", "content": "What does it print? Look it up."},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "lookup", "arguments": {"query": "2 + 2"}}}]},
                {"role": "tool", "content": RESULT}]
    rendered = tok.apply_chat_template(messages, tools=[{"type": "function", "function": FUNCTION}], tokenize=False,
                                       add_generation_prompt=True)
    dialog = _dialog(StopReason.end_of_turn)
    dialog[2].tool_calls[0].arguments = {"query": "2 + 2"}  # ASCII: Meta's json.dumps escapes the rest
    assert tok(rendered, add_special_tokens=False)["input_ids"] == cf.encode_dialog_prompt(dialog).tokens


@pytest.mark.parametrize("closer", sorted(CLOSERS))
def test_a_whole_llama_rollout_is_meta_s_encoding_token_for_token(closer: str) -> None:
    # The model's call turn (Meta's ids, closed by `closer`), the result glued by the template's
    # delta; the second request must be exactly ChatFormat's encoding of the same dialog.
    from engine import tools
    from engine.settings import EngineConfig, RetryPolicy
    from engine.local.invariants import sample_violations
    from engine.local.sample import Sample
    from tests.profiles.test_family_rollouts import _reply
    from tests.support.helpers import URL, ScriptedServer
    from tests.support.llama3 import llama31_tokenizer

    class Lookup(tools.Tool):
        name = "lookup"
        description = FUNCTION["description"]
        parameters = SCHEMA
        seen: list[str] = []

        async def execute(self, state: Any, **arguments: Any) -> str:
            self.seen.append(arguments["query"])
            return RESULT

    tok = llama31_tokenizer()
    tk, cf = _meta()
    stop = CLOSERS[closer]
    prompt_ids = cf.encode_dialog_prompt(_dialog(stop, result=False)).tokens
    after = cf.encode_dialog_prompt(_dialog(stop)).tokens
    call_ids = after[len(prompt_ids):after.index(tk.special_tokens[closer], len(prompt_ids)) + 1]
    call_text = tk.decode(call_ids)
    answer_ids = tok("It prints héllo 世界 🦜 42. Answer: \\boxed{42}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    server = ScriptedServer([_reply(call_ids, call_text), _reply(answer_ids, "")])
    cfg = EngineConfig(server_url=URL, profile="chat", tool_parser="llama3", max_context_len=4096,
                       retry=RetryPolicy(max_attempts=1), tools=("lookup",))
    sample = Sample(prompt=[{"role": "user", "content": "What does it print? Look it up."}], label="42")

    with tools.registry.registered(Lookup()) as lookup:
        profile = server.roll_out(cfg, tok, sample)
    fsm = sample.metadata["fsm"]
    assert sample.status == Sample.Status.COMPLETED and lookup.seen == [QUERY], fsm
    assert profile.closer == "<|eot_id|>" and profile.drift is None
    assert server.requests[0]["input_ids"] == prompt_ids  # the template's prompt is Meta's, the tool's schema in it
    assert server.requests[1]["input_ids"] == after  # the call as sent, its closing token once, the ipython result
    observation = after[len(prompt_ids) + len(call_ids):]
    assert profile.decode(observation).startswith("<|start_header_id|>ipython<|end_header_id|>\n\n")
    assert sample.tokens == after + answer_ids
    assert sample.loss_mask == [1] * len(call_ids) + [0] * len(observation) + [1] * len(answer_ids)
    assert sample_violations(sample, prompt_ids=prompt_ids, budget=4096, decode=profile.decode) == []
    assert json.loads(call_text[:-len(closer)])["parameters"] == {"query": QUERY}
