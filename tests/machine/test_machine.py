"""Edge by edge: every guard of the table, and every fault edge from every state."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import attrs
import httpx
import pytest
import respx
from transitions import MachineError

from engine import envs, tools
from engine.settings import EngineConfig, RetryPolicy
from engine.loop.driver import drive, new_rollout
from engine.loop.runtime import Runtime
from engine.machine import guards
from engine.machine.rollout import Rollout
from engine.machine.states import TERMINALS
from engine.machine.table import MachineSpec, RolloutMachine, get_machine
from engine.profiles.retool import INVALID_ACTION, render_retool_prompt
from engine.slime.sample_io import read_checkpoint, write_sample
from tests.conftest import run
from tests.support.helpers import (
    IM_END,
    SAMPLING,
    URL,
    ScriptedServer,
    StubHarness,
    encode,
    reply_body,
    retool_schemas,
    tok,
    turn,
)

CODE = "<code>\nprint(1)\n</code>"
ANSWER = "Answer: \\boxed{1}"
PROMPT = "What is 1?"


def prompt_len() -> int:
    return len(encode(render_retool_prompt(PROMPT, retool_schemas())))


def cfg(**kw: Any) -> EngineConfig:
    base = dict(server_url=URL, max_context_len=4096, retry=RetryPolicy(max_attempts=2, base_delay=0.0, deadline=5.0))
    base.update(kw)
    return EngineConfig(**base)


async def _drive(script: list, c: EngineConfig, params: dict, machine: RolloutMachine | None, server: ScriptedServer,
                 sample: Any = None, harness: Any = None) -> Rollout:
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        rt = Runtime.create(c, tokenizer=tok())
        r = new_rollout(rt, PROMPT, params, saved=read_checkpoint(sample) if sample is not None else None)
        if harness is not None:  # an agent's session answers the turns
            r.inputs = attrs.evolve(r.inputs, harness=harness)
        try:
            await drive(rt, r, machine)
        finally:
            await rt.aclose()
    return r


def walk(script: list, *, params: dict | None = None, machine: RolloutMachine | None = None, sample: Any = None,
         harness: Any = None, **kw: Any) -> tuple[Rollout, ScriptedServer]:
    server = ScriptedServer(script)
    r = run(_drive(script, cfg(**kw), dict(params or SAMPLING), machine, server, sample, harness))
    r.traj.check(full=True, max_total_length=r.token_budget)
    return r, server


def path(r: Rollout) -> list[tuple[str, str, str]]:
    return [tuple(e) for e in r.record.trace]


# -- the guards ------------------------------------------------------------------------
def test_length_finish_ends_truncated():
    r, _ = walk([turn("1 2 3", finish="length")])
    assert (r.state, r.record.reason) == ("TRUNCATED", "finished_length")


def test_tool_call_budget_exhausted(fake_interpreter):
    r, server = walk([turn(CODE), turn(CODE)], max_tool_calls=1)
    assert (r.state, r.record.reason) == ("TRUNCATED", "tool_calls_exhausted")
    assert len(fake_interpreter.codes) == 1 and len(server.requests) == 2


def test_invalid_action_gets_the_retool_note_then_continues(fake_interpreter):
    r, server = walk([turn("I am not sure."), turn(ANSWER)])
    assert ("GENERATE", "reply", "TOOL_CALL") in path(r)
    assert ("TOOL_CALL", "observe", "BUDGET_CHECK") in path(r)
    assert (r.state, r.record.reason) == ("COMPLETED", "answered")
    assert INVALID_ACTION in r.text
    assert fake_interpreter.codes == []


def test_max_turns(fake_interpreter):
    r, server = walk([turn(CODE)], max_turns=1)
    assert (r.state, r.record.reason) == ("TRUNCATED", "max_turns_reached")
    assert path(r)[-1] == ("BUDGET_CHECK", "check", "TRUNCATED")


def test_zero_max_new_tokens_sends_nothing():
    r, server = walk([], params={**SAMPLING, "max_new_tokens": 0})
    assert (r.state, r.record.reason) == ("TRUNCATED", "no_new_tokens_asked")
    assert server.requests == []


def test_server_ignoring_the_clamp_is_trimmed():
    budget = prompt_len() + 5
    r, server = walk([turn("one two three four five six seven eight nine ten")], max_context_len=budget)
    assert server.requests[0]["sampling_params"]["max_new_tokens"] == 5
    assert (r.state, r.record.reason) == ("TRUNCATED", "reply_over_budget")
    assert path(r)[-2:] == [("GENERATE", "reply", "TRIM"), ("TRIM", "trim", "TRUNCATED")]
    assert r.traj.total_length == budget


def test_observation_that_fits_exactly_is_kept_whole(fake_interpreter):
    """Exact fit (a peer dropped such turns): the observation stays, then the budget is full."""
    first = encode(CODE) + [IM_END]
    obs = encode("\n\n<interpreter>\nOutput:\nprint(1)\n</interpreter>\n\n")
    budget = prompt_len() + len(first) + len(obs)
    r, server = walk([turn(CODE)], max_context_len=budget)
    assert ("TOOL_CALL", "observe", "BUDGET_CHECK") in path(r)
    assert (r.state, r.record.reason) == ("TRUNCATED", "context_full")
    assert r.traj.response_ids.tolist() == first + obs
    assert len(server.requests) == 1


def test_malformed_and_unknown_calls_are_error_observations(fake_interpreter):
    bad_json = '<tool_call>{"name": "code_interpreter", "arguments": {"code": </tool_call>'
    unknown = '<tool_call>{"name": "web_search", "arguments": {"q": "x"}}</tool_call>'
    bad_args = '<tool_call>{"name": "code_interpreter", "arguments": {"code": ["print(1)"]}}</tool_call>'
    r, _ = walk([turn(bad_json), turn(unknown), turn(bad_args), turn(ANSWER)])
    assert r.state == "COMPLETED"
    assert r.record.tools.errors == {"malformed_call": 1, "unknown_tool": 1, "bad_arguments": 1}
    assert "not valid JSON" in r.text and "unknown tool 'web_search'" in r.text and "must be of type string" in r.text
    assert fake_interpreter.codes == []


def test_sample_can_restrict_its_tools(fake_interpreter):
    server = ScriptedServer([turn(CODE), turn(ANSWER)])

    async def go() -> Rollout:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            rt = Runtime.create(cfg(), tokenizer=tok())
            r = new_rollout(rt, PROMPT, SAMPLING, tools_requested=[])
            await drive(rt, r)
            await rt.aclose()
            return r

    r = run(go())
    assert r.record.tools.errors == {"unknown_tool": 1}
    assert '"name": "code_interpreter"' not in tok().decode(r.traj.prompt_ids.tolist())


@pytest.mark.parametrize("extra", [
    {"queued": True},
    {"after_state_change": [lambda *a: None]},
    {"send_event": True},
    {"transitions": [{"trigger": "t", "source": "A", "dest": "B", "prepare": [lambda *a: None]}]},
    {"transitions": [{"trigger": "t", "source": "A", "dest": "B", "conditions": ["is_ready"]}]},
    {"transitions": [{"trigger": "t", "source": "A", "dest": None}]},
    {"states": [{"name": "A", "on_exit": [lambda *a: None]}, "B"]},
], ids=["queued", "machine_callback", "send_event", "prepare", "named_condition", "internal", "state_callback"])
def test_the_short_path_refuses_what_it_would_skip(extra):
    from engine.machine.table import _TableMachine

    config = {"model": None, "states": ["A", "B"], "initial": "A", "auto_transitions": False,
              "transitions": [{"trigger": "t", "source": "A", "dest": "B"}], **extra}
    with pytest.raises(ValueError, match="short path"):
        _TableMachine(**config)


def test_the_short_path_takes_ordered_rows_with_conditions_as_transitions_does():
    """Two rows of one (source, trigger): the first whose conditions hold is taken, both ways alike."""
    from transitions import Machine

    from engine.machine.table import _TableMachine

    for machine_cls in (Machine, _TableMachine):
        seen: list[str] = []
        config = {"model": None, "states": ["A", "B", "C"], "initial": "A", "auto_transitions": False, "transitions": [
            {"trigger": "t", "source": "A", "dest": "B", "conditions": [lambda m: m.go_b], "before": [lambda m: seen.append("b")]},
            {"trigger": "t", "source": "A", "dest": "C", "unless": [lambda m: m.stuck], "after": [lambda m: seen.append("c")]},
        ]}
        event = machine_cls(**config).events["t"]
        for go_b, stuck, dest in ((True, False, "B"), (False, False, "C"), (False, True, "A")):
            model = SimpleNamespace(state="A", go_b=go_b, stuck=stuck)
            assert event.trigger(model, model) is (dest != "A") and model.state == dest, machine_cls
        assert seen == ["b", "c"], machine_cls


@pytest.mark.parametrize("ending", ["answered", "server_aborted"])
def test_a_response_whose_text_cannot_be_made_is_discarded_and_recorded(ending, fake_interpreter):
    """`finish` never raises: a decode that fails at the end leaves no response and says why."""
    last = turn(ANSWER) if ending == "answered" else httpx.Response(200, json=reply_body(encode("So"), finish="abort"))

    async def go() -> Rollout:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=ScriptedServer([turn(CODE), last]))
            rt = Runtime.create(cfg(), tokenizer=tok())
            decode = rt.profile.decode

            def fragile(ids: list[int]) -> str:  # decodes each turn, fails on the whole response
                if r.traj.segments and len(ids) == r.traj.response_length and len(r.traj.segments) > 1:
                    raise RuntimeError("cannot decode")
                return decode(ids)

            object.__setattr__(rt.profile, "decode", fragile)
            r = new_rollout(rt, PROMPT, dict(SAMPLING))
            await drive(rt, r)
            await rt.aclose()
        return r

    r = run(go())
    assert r.state == "ABORTED" and r.record.reason == "invariant_violated"
    assert r.record.violation == "text: cannot decode"
    assert r.traj.response_length == 0 and r.text == "" and r.final_text == ""
    r.traj.check(full=True)


def test_a_character_split_by_an_abort_is_whole_in_the_resumed_samples_text():
    """🦩 is two byte-level tokens in Qwen3: the abort keeps the first, the resumed turn sends the second."""
    from engine.local.sample import Sample

    assert tok().decode([123918, 102]) == "🦩"
    sample = Sample(prompt=PROMPT)
    first = encode("A flamingo: ") + [123918]
    r, _ = walk([httpx.Response(200, json=reply_body(first, finish="abort"))], sample=sample, partial_rollout=True)
    assert r.state == "ABORTED" and r.text == tok().decode(first) and r.text.endswith("\ufffd")
    write_sample(sample, r)
    second = [102] + encode(" done. " + ANSWER) + [IM_END]
    r, _ = walk([httpx.Response(200, json=reply_body(second))], sample=sample, partial_rollout=True)
    assert r.state == "COMPLETED" and r.traj.response_ids.tolist() == first + second
    assert r.text == tok().decode(first + second) and r.text.startswith("A flamingo: 🦩 done.")


# -- fault edges from every state --------------------------------------------------------
def tool_call_turn(name: str) -> str:
    schema = tools.get(name).schema()["function"]["parameters"]
    args = {p: "print(1)" for p in schema.get("required", [])}
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def resumable_sample() -> Any:
    """A sample a first attempt left ABORTED with a checkpoint (partial rollout)."""
    from engine.local.sample import Sample

    sample = Sample(prompt=PROMPT)
    aborted = httpx.Response(200, json=reply_body(encode("So"), finish="abort"))
    r, _ = walk([turn(CODE), aborted], sample=sample, partial_rollout=True)
    write_sample(sample, r)  # as engine.slime.run_sample does
    return sample


def test_a_row_is_taken_only_from_its_own_source_state():
    """The event refuses to move a rollout from a state that has no row of it, and changes nothing."""
    machine = get_machine()
    r = SimpleNamespace(state="COMPLETED")
    assert machine.fire(r, "reply") is False and not machine.can(r, "reply")  # no row of (COMPLETED, reply)
    for events in (machine._machine.events, RolloutMachine(machine.spec, stock=True)._machine.events):
        with pytest.raises(MachineError, match="Can't trigger event reply from state COMPLETED"):
            events["reply"].trigger(r, r)
    assert r.state == "COMPLETED"


def test_one_transitions_machine_holds_the_table_in_order():
    """Each row is a transition of its trigger's event, in table order, its guard the condition."""
    machine = get_machine()
    for edge in machine.spec.edges:
        rows = machine._machine.events[edge.trigger].transitions[edge.source]
        conditions = [edge.guard] if edge.guard not in (None, guards.otherwise) else []
        same = [t for t in rows if t.dest == edge.dest and [c.func for c in t.conditions] == conditions]
        assert same and list(same[0].before) == list(edge.actions), edge
    for (source, trigger), edges in _groups(machine.spec).items():
        rows = machine._machine.events[trigger].transitions[source]
        assert [t.dest for t in rows] == [e.dest for e in edges]


def _groups(spec: MachineSpec) -> dict[tuple[str, str], list[Any]]:
    out: dict[tuple[str, str], list[Any]] = {}
    for e in spec.edges:
        out.setdefault((e.source, e.trigger), []).append(e)
    return out


@pytest.mark.parametrize("script_name", ["tool_then_answer", "trim", "length", "invalid_then_answer", "resume"])
def test_stock_transitions_take_the_same_edges_as_the_short_path(script_name, fake_interpreter):
    """The same rollouts through transitions' own Event and through the engine's: the same path, state and data."""
    scripts: dict[str, tuple[list, dict[str, Any]]] = {
        "tool_then_answer": ([turn(CODE), turn(ANSWER)], {}),
        "trim": ([turn("many words " * 20)], {"max_context_len": prompt_len() + 5}),
        "length": ([turn("1 2", finish="length")], {}),
        "invalid_then_answer": ([turn("I am not sure."), turn(ANSWER)], {}),
        "resume": ([turn(ANSWER)], {"partial_rollout": True}),
    }
    script, kw = scripts[script_name]
    ran = []
    for stock in (False, True):
        if script_name == "resume":
            kw = {**kw, "sample": resumable_sample()}
        r, _ = walk(list(script), machine=RolloutMachine(get_machine().spec, stock=stock), **kw)
        ran.append((path(r), r.record.guards, r.state, r.record.reason, r.traj.response_ids.tolist()))
    assert ran[0] == ran[1]


def script_through(state: str) -> tuple[list, dict[str, Any]]:
    """A script whose rollout visits `state`, and the settings it needs."""
    spec = get_machine().spec
    if state == "RESUME":
        return [turn(ANSWER)], {"partial_rollout": True, "sample": resumable_sample()}
    if state in spec.tool_states:
        return [turn(tool_call_turn(spec.tool_states[state])), turn(ANSWER)], {"tools": tuple(tools.names())}
    if state == "TRIM":
        return [turn("many words " * 20)], {"max_context_len": prompt_len() + 5}
    if state == "ENVIRONMENT":
        return [turn("Hello."), turn("Hello again.")], {"environment": "echo_test"}
    if state == "HARNESS":
        return [turn(CODE)], {"harness": StubHarness([])}
    if state == "COMPACT":  # a chat tool turn reaches the threshold: drop_oldest has only the prompt left
        chat_call = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'
        return [turn(chat_call), turn(ANSWER)], {"profile": "chat", "compaction": "drop_oldest", "compaction_threshold": 3}
    return [turn(CODE), turn(ANSWER)], {}


NON_TERMINAL = [s for s in get_machine().spec.states if s not in TERMINALS]


@pytest.mark.parametrize("state", NON_TERMINAL)
def test_crash_in_any_state_ends_failed_with_the_error_recorded(state, fake_interpreter, monkeypatch):
    import engine.loop.driver as d

    original = d._next_trigger

    async def boom(rt: Any, r: Rollout, machine: Any) -> str:
        if r.state == state:  # states with a step and states that fire at once alike
            raise RuntimeError(f"injected in {state}")
        return await original(rt, r, machine)

    monkeypatch.setattr(d, "_next_trigger", boom)
    script, kw = script_through(state)
    r, _ = walk(script, **kw)
    assert f"injected in {state}" in r.record.error
    if state == "TRIM":
        # The response is still over budget: FAILED may not hand it on (I2), so it is discarded.
        assert path(r)[-2:] == [("TRIM", "crashed", "FAILED"), ("FAILED", "invariant_violated", "ABORTED")]
        assert r.record.violation.startswith("I2") and r.traj.response_length == 0
    else:
        assert path(r)[-1] == (state, "crashed", "FAILED")
        assert (r.state, r.record.reason) == ("FAILED", "crashed")


def test_bad_prompt_is_a_recorded_crash_not_an_exception():
    async def go() -> Rollout:
        rt = Runtime.create(cfg(), tokenizer=tok())
        r = new_rollout(rt, [1, 2, 3], SAMPLING)  # not chat messages
        await drive(rt, r)
        await rt.aclose()
        return r

    r = run(go())
    assert path(r) == [("RESET", "crashed", "FAILED")]
    assert "AttributeError" in r.record.error


AWAITING = ["GENERATE", "ENVIRONMENT", "COMPACT", *get_machine().spec.tool_states]


@pytest.mark.parametrize("state", AWAITING)
def test_cancellation_while_awaiting_ends_aborted_and_propagates(state, fake_interpreter):
    never = asyncio.Event()

    async def hang_generate(request: httpx.Request) -> httpx.Response:
        await never.wait()
        raise AssertionError("unreachable")

    class HangingTool(tools.Tool):
        parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

        async def execute(self, state: Any, **arguments: Any) -> str:
            await never.wait()
            return ""

    class HangingEnvironment(envs.Environment):
        name = "hanging_test"

        async def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:
            await never.wait()
            return envs.Reply("")

    spec = get_machine().spec
    originals = {}
    environment = None
    settings: dict[str, Any] = {}
    if state == "COMPACT":  # the summary is being written when the cancellation comes
        script, settings = script_through("COMPACT")
        script, settings = [script[0], hang_generate], {**settings, "compaction": "summarize"}
    elif state == "ENVIRONMENT":
        envs.register_environment(HangingEnvironment(), replace=True)
        environment, script = "hanging_test", [turn("Hello.")]
    elif state in spec.tool_states:
        name = spec.tool_states[state]
        originals[name] = tools.get(name)
        hanging = HangingTool()
        hanging.name = name  # type: ignore[misc]
        tools.register(hanging, replace=True)
        script: list = [turn(tool_call_turn(name))]
    else:
        script = [hang_generate]

    async def go() -> Rollout:
        with respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=ScriptedServer(script))
            rt = Runtime.create(cfg(tools=tuple(tools.names()), environment=environment, **settings), tokenizer=tok())
            r = new_rollout(rt, PROMPT, SAMPLING)
            task = asyncio.create_task(drive(rt, r))
            while r.state != state and not task.done():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await rt.aclose()
            return r

    try:
        r = run(go())
    finally:
        for name, tool in originals.items():
            tools.register(tool, replace=True)
        envs.unregister_environment("hanging_test")
    assert path(r)[-1] == (state, "cancelled", "ABORTED")
    assert r.record.reason == "cancelled"
    r.traj.check(full=True)
    # a cancelled sample is handed back too: its text is made from its ids like any other's
    assert r.text == tok().decode(r.traj.response_ids.tolist())
    assert (r.traj.response_length > 0) == (state != "GENERATE")
    assert state in ("GENERATE", "ENVIRONMENT") or "<tool_call>" in r.text  # COMPACT and the tools: after a call


def corrupting_machine(target: str) -> RolloutMachine:
    """The real table, except that edges into `target` also break I1 on the way."""

    def corrupt(r: Rollout) -> None:
        r.traj.logprobs.append(-1.0)

    spec = MachineSpec.from_registry()
    edges = tuple(
        attrs.evolve(e, actions=(*e.actions, corrupt)) if e.dest == target and e.trigger != "invariant_violated" else e
        for e in spec.edges
    )
    return RolloutMachine(attrs.evolve(spec, edges=edges))


VIOLATION_SOURCES = [s for s in get_machine().spec.states if s not in ("RESET", "ABORTED")]


@pytest.mark.parametrize("state", VIOLATION_SOURCES)
def test_invariant_violation_in_any_state_ends_aborted_with_a_clean_trajectory(state, fake_interpreter):
    script, kw = {
        "COMPLETED": ([turn(ANSWER)], {}),
        "TRUNCATED": ([turn("1 2", finish="length")], {}),
        "FAILED": ([httpx.Response(400, json={"error": "bad sampling param"})], {}),
    }.get(state) or script_through(state)
    r, _ = walk(script, machine=corrupting_machine(state), **kw)
    assert (state, "invariant_violated", "ABORTED") in path(r)
    assert (r.state, r.record.reason) == ("ABORTED", "invariant_violated")
    assert r.record.violation.startswith("I1")
    assert r.traj.response_length == 0  # nothing untrusted is handed on
    assert r.text == ""


def test_stateful_tool_keeps_variables_across_turns_of_one_trajectory():
    """The real python_session tool, through the engine: its own state, created and released once."""
    def session_call(code: str) -> str:
        return f"<tool_call>{json.dumps({'name': 'python_session', 'arguments': {'code': code}})}</tool_call>"

    r, _ = walk([turn(session_call("x = 20")), turn(session_call("print(x + 22)")), turn(ANSWER)],
                tools=("code_interpreter", "python_session"))
    assert r.state == "COMPLETED"
    assert ("TOOL_PYTHON_SESSION", "tool_done", "TOOL_CALL") in path(r)
    assert "\n42\n" in r.text
    assert r.tool_sessions == {}  # released at the end
