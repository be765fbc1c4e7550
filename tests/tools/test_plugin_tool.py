"""A tool added from outside the engine, by registration alone, shows everywhere."""

from __future__ import annotations

import json
import sys

import respx

from engine import tools
from engine import slime
from engine.trace.drawing import machine_mermaid
from engine.machine.table import MachineSpec, get_machine
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, tok, turn
from engine.local.sample import Sample


def test_tool_module_loaded_by_setting_gets_a_state_edges_a_drawing_and_runs():
    sys.modules.pop("tests.support.plugins.word_count", None)
    call = "<tool_call>" + json.dumps({"name": "word_count", "arguments": {"text": "one two three"}}) + "</tool_call>"
    server = ScriptedServer([turn(call), turn("Three words.\nAnswer: \\boxed{3}")])
    sample = Sample(prompt="How many words are in 'one two three'?")
    try:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            # the module is named in the settings (engine_tool_modules), as a slime YAML would
            run(slime.generate(make_args(engine_tool_modules="tests.support.plugins.word_count"), sample, dict(SAMPLING)))
        spec = get_machine().spec
        assert spec.tool_states["TOOL_WORD_COUNT"] == "word_count"
        assert ("TOOL_CALL", "dispatch", "TOOL_WORD_COUNT") in spec.triples()
        assert ("TOOL_WORD_COUNT", "tool_done", "TOOL_CALL") in spec.triples()
        drawing = machine_mermaid(MachineSpec.from_registry())
        assert "TOOL_WORD_COUNT" in drawing and "dispatch [calls_word_count]" in drawing
        trace = [tuple(e) for e in sample.metadata["fsm"]["trace"]]
        assert ("TOOL_CALL", "dispatch", "TOOL_WORD_COUNT") in trace
        assert sample.status == Sample.Status.COMPLETED
        assert "<interpreter>\n3\n</interpreter>" in sample.response
        prompt_text = tok().decode(server.requests[0]["input_ids"])
        assert '"name": "word_count"' in prompt_text and "Count the words of a text." in prompt_text
    finally:
        tools.registry.unregister("word_count")
    assert "TOOL_WORD_COUNT" not in get_machine().spec.states
