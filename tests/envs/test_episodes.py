"""An episode's life: which environment a sample gets, `start` shaping the prompt, what `respond`
receives, blocking code (a plain def in a thread; a coroutine that holds the loop named), the time
kept per turn, and an episode cut while it starts (cancelled, or slime aborting)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest
import respx

from engine import envs, slime
from engine.settings import EngineConfig, RetryPolicy
from engine.local.sample import Sample
from engine.loop.driver import drive, new_rollout
from engine.loop.environment import Choice, UnknownEnvironment, read_choice
from engine.loop.runtime import Runtime
from engine.machine.rollout import Rollout
from engine.trace.summary import format_summary, summarize, warnings
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, tok, turn

MESSAGES = [{"role": "user", "content": "Let us play."}]


class Scripted(envs.Environment):
    """Answers "Go on." until the model says "stop"; records what each call received."""

    name = "scripted_test"

    def __init__(self, opening: Any = None) -> None:
        self.opening = opening
        self.tasks: list[envs.Task] = []
        self.seen: list[envs.Conversation] = []

    async def start(self, task: envs.Task) -> Any:
        self.tasks.append(task)
        return self.opening if self.opening is not None else {}

    async def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:
        self.seen.append(conversation)
        if "stop" in conversation.text:
            return envs.Reply(done=True, reason="asked to stop")
        return envs.Reply("Go on.", reward=0.5)


def drive_one(env: envs.Environment, script: list, *, metadata: dict | None = None, **kw: Any) -> tuple[Rollout, ScriptedServer]:
    server = ScriptedServer(script)
    cfg = EngineConfig(server_url=URL, profile="chat", max_context_len=4096, retry=RetryPolicy(max_attempts=1),
                       environment=env.name, tools=(), **kw)

    async def go() -> Rollout:
        with envs.registered_environment(env), respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            async with Runtime.create(cfg, tokenizer=tok()) as rt:
                r = new_rollout(rt, MESSAGES, SAMPLING, metadata=metadata or {})
                await drive(rt, r)
                return r

    r = run(go())
    r.traj.check(full=True, max_total_length=r.token_budget)
    return r, server


def path(r: Rollout) -> list[tuple[str, str, str]]:
    return [tuple(e) for e in r.record.trace]


# -- which environment --------------------------------------------------------------------------


@pytest.mark.parametrize("value, choice", [
    (None, Choice(None)),
    ("scripted_test", Choice("scripted_test")),
    ({"name": "scripted_test"}, Choice("scripted_test")),
    ({"name": "scripted_test", "args": {"level": 3}}, Choice("scripted_test", {"level": 3})),
    ("none", Choice("none")),
])
def test_a_samples_metadata_names_its_environment(value: Any, choice: Choice) -> None:
    assert read_choice({"environment": value} if value is not None else {}) == choice
    assert read_choice(None) == Choice(None)


@pytest.mark.parametrize("value", ["", 7, ["scripted_test"], {"args": {}}, {"name": "x", "extra": 1}, {"name": "x", "args": [1]}])
def test_any_other_shape_is_refused_saying_what_is_accepted(value: Any) -> None:
    with pytest.raises(UnknownEnvironment, match=r"metadata\['environment'\] must be an environment's name"):
        read_choice({"environment": value})


def test_through_slime_a_bad_name_fails_that_sample_alone_and_none_means_a_plain_task() -> None:
    env = Scripted()

    async def go(sample: Sample, script: list) -> Sample:
        with envs.registered_environment(env), respx.mock(assert_all_called=False) as mock:
            mock.post("http://sglang.test:30000/generate").mock(side_effect=ScriptedServer(script))
            await slime.generate(make_args(engine_profile="chat", engine_environment="scripted_test"), sample, dict(SAMPLING))
        return sample

    typo = run(go(Sample(prompt=MESSAGES, metadata={"environment": "scripted_tset"}), []))
    fsm = typo.metadata["fsm"]
    assert (typo.status.name, fsm["termination_reason"], typo.remove_sample) == ("FAILED", "bad_sample_input", True)
    assert "unknown environment 'scripted_tset'" in fsm["engine_error"] and "scripted_test" in fsm["engine_error"]
    assert len(typo.loss_mask) == len(typo.rollout_log_probs) == typo.response_length == 1

    plain = run(go(Sample(prompt=MESSAGES, metadata={"environment": "none"}), [turn("Done, stop.")]))
    assert (plain.status.name, plain.metadata["fsm"]["termination_reason"]) == ("COMPLETED", "answered")
    assert "environment" not in plain.metadata["fsm"] and env.tasks == []

    named = run(go(Sample(prompt=MESSAGES, metadata={"environment": {"name": "scripted_test", "args": {"level": 3}},
                                                     "mine": 1}), [turn("Next."), turn("Now stop.")]))
    assert named.metadata["fsm"]["termination_reason"] == "environment_done"
    assert env.tasks[-1].args == {"level": 3} and env.tasks[-1].metadata["mine"] == 1


def test_an_environment_whose_setup_fails_ends_the_samples_naming_it_with_the_reason() -> None:
    async def go() -> Sample:
        sample = Sample(prompt=MESSAGES, metadata={"environment": "user_simulator"})
        with respx.mock(assert_all_called=False):
            await slime.generate(make_args(engine_profile="chat"), sample, dict(SAMPLING))
        return sample

    sample = run(go())
    fsm = sample.metadata["fsm"]
    assert (sample.status.name, fsm["termination_reason"]) == ("FAILED", "engine_setup_failed")
    assert "needs engine_user_sim_url" in fsm["engine_error"]


def test_registration_refuses_the_reserved_name_and_the_older_start() -> None:
    class NoneEnv(envs.Environment):
        name = "none"

    class Older(envs.Environment):
        name = "older_test"

        async def start(self, prompt: Any, metadata: Any) -> Any:
            return None

    with pytest.raises(ValueError, match="'none' cannot name an environment"):
        envs.register_environment(NoneEnv())
    with pytest.raises(ValueError, match=r"start takes one argument now, start\(task\).*respond\(episode, conversation\)"):
        envs.register_environment(Older())
    assert envs.get_environment("older_test") is None


# -- start and respond ---------------------------------------------------------------------------


def test_start_shapes_the_prompt_and_respond_sees_the_conversation_without_special_tokens() -> None:
    rules = [{"role": "system", "content": "Say stop when you are done."}, *MESSAGES]
    env = Scripted(envs.Opening({"n": 0}, prompt=rules))
    r, server = drive_one(env, [turn("First move."), turn("I stop now.")])
    assert (r.state, r.record.reason) == ("COMPLETED", "environment_done")
    rendered = tok().apply_chat_template(rules, tokenize=False, add_generation_prompt=True)
    assert tok().decode(server.requests[0]["input_ids"]) == rendered  # the shaped prompt, rendered by the template
    first, second = env.seen
    assert first.messages == (*rules, {"role": "assistant", "content": "First move."})
    assert second.messages == (*rules, {"role": "assistant", "content": "First move."}, {"role": "user", "content": "Go on."},
                               {"role": "assistant", "content": "I stop now."})
    assert (first.turn, second.turn, second.text) == (1, 2, "I stop now.")
    # the token view is the sequence the policy saw, its segments those recorded on the sample
    assert list(second.prompt_ids) == list(r.prompt_ids)
    assert list(second.response_ids) == r.traj.response_ids.tolist()
    assert second.segments == tuple((s.kind, s.start, s.end) for s in r.traj.segments)
    assert second.decode(list(second.response_ids)).endswith("I stop now.<|im_end|>")
    first.messages[0]["content"] = "changed"  # copies: what an environment does to them changes nothing
    assert second.messages[0]["content"] == rules[0]["content"]


# -- blocking code ----------------------------------------------------------------------------------


class PlainSleeper(Scripted):
    """respond is a plain def that blocks (a synchronous client): it runs in a thread."""

    name = "plain_test"

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.threads: list[str] = []

    def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:  # type: ignore[override]
        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds)
        return envs.Reply(done=True, reason="slept")


class AsyncBlocker(Scripted):
    """respond is a coroutine that blocks the event loop (time.sleep in async def)."""

    name = "blocking_test"

    async def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:
        time.sleep(0.3)
        await asyncio.sleep(0)
        return envs.Reply(done=True, reason="held the loop")


def ticks_while(env: envs.Environment, script: list, **kw: Any) -> tuple[Rollout, int]:
    """Drive one sample while a ticker counts how often the event loop got to run it."""
    server = ScriptedServer(script)
    cfg = EngineConfig(server_url=URL, profile="chat", max_context_len=4096, retry=RetryPolicy(max_attempts=1),
                       environment=env.name, tools=(), **kw)
    count = 0

    async def ticker() -> None:
        nonlocal count
        while True:
            await asyncio.sleep(0.01)
            count += 1

    async def go() -> Rollout:
        with envs.registered_environment(env), respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            async with Runtime.create(cfg, tokenizer=tok()) as rt:
                r = new_rollout(rt, MESSAGES, SAMPLING)
                ticking = asyncio.ensure_future(ticker())
                await drive(rt, r)
                ticking.cancel()
                return r

    return run(go()), count


def test_a_plain_def_respond_runs_in_a_thread_and_the_loop_goes_on() -> None:
    env = PlainSleeper(0.5)
    r, ticks = ticks_while(env, [turn("Hello.")])
    assert (r.state, r.record.env_reason) == ("COMPLETED", "slept")
    assert env.threads and env.threads[0] != threading.main_thread().name
    assert ticks >= 10  # 50 ticks of 10 ms fit in its 0.5 s; a blocked loop would give 0 or 1
    turn_log = r.record.turn_log[-1]
    assert turn_log["environment_seconds"] >= 0.5 and "environment_blocked_seconds" not in turn_log


def test_a_plain_def_that_hangs_is_still_cut_by_the_timeout() -> None:
    r, _ = ticks_while(PlainSleeper(30), [turn("Hello.")], tool_timeout=0.3)
    assert (r.state, r.record.reason) == ("FAILED", "environment_failed")
    assert "did not answer within 0.3 seconds" in r.record.error


def test_a_coroutine_that_blocks_the_loop_is_named_and_kept_with_the_turn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.loop.environment"):
        r, _ = ticks_while(AsyncBlocker(), [turn("Hello.")])
    held = r.record.turn_log[-1]["environment_blocked_seconds"]
    assert held >= 0.3 and r.state == "COMPLETED"
    said = [m for m in caplog.messages if "blocking_test" in m]
    assert said and "held the event loop" in said[0] and "plain def" in said[0]
    sample = {"metadata": {"fsm": {"environment": {"name": "blocking_test"}, "turns": r.record.turn_log,
                                   "environment_time": r.record.env_seconds}}, "status": "completed"}
    text = format_summary(summarize([sample]))
    assert "environment_seconds" in text and "environment_turn_seconds" in text
    assert any("environment blocking_test held the event loop in 1 turns" in w for w in warnings(summarize([sample])))


def test_time_in_the_environment_is_kept_per_turn_and_per_sample() -> None:
    class Slow(Scripted):
        name = "slow_test"

        async def start(self, task: envs.Task) -> Any:
            await asyncio.sleep(0.1)
            return {}

        async def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:
            await asyncio.sleep(0.2)
            return await super().respond(episode, conversation)

    r, _ = drive_one(Slow(), [turn("One."), turn("Now stop.")])
    per_turn = [t["environment_seconds"] for t in r.record.turn_log]
    assert len(per_turn) == 2 and min(per_turn) >= 0.2 and max(per_turn) < 5
    assert r.record.env_seconds >= sum(per_turn) + 0.1  # start counts in the sample's figure, not a turn's
    assert r.record.turn_log[0]["environment_seconds"] == pytest.approx(per_turn[0])


# -- an episode cut while it starts ------------------------------------------------------------------


class SlowStart(Scripted):
    name = "slow_start_test"

    def __init__(self) -> None:
        super().__init__()
        self.starting = asyncio.Event()
        self.ended = 0

    async def start(self, task: envs.Task) -> Any:
        self.starting.set()
        await asyncio.sleep(600)

    async def end(self, episode: Any) -> None:
        self.ended += 1


def test_a_sample_cancelled_while_its_environment_starts_ends_aborted_from_reset() -> None:
    env = SlowStart()
    cfg = EngineConfig(server_url=URL, profile="chat", environment=env.name, tools=())

    async def go() -> Rollout:
        with envs.registered_environment(env):
            async with Runtime.create(cfg, tokenizer=tok()) as rt:
                r = new_rollout(rt, MESSAGES, SAMPLING)
                task = asyncio.create_task(drive(rt, r))
                await asyncio.wait_for(env.starting.wait(), 30)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return r

    r = run(go())
    assert path(r) == [("RESET", "cancelled", "ABORTED")] and r.record.reason == "cancelled"
    assert env.ended == 1


def test_slimes_abort_cuts_an_environment_that_is_starting() -> None:
    from tests.slime.slime_rules import slime_aborting

    env = SlowStart()
    sample = Sample(prompt=MESSAGES)

    async def go() -> None:
        with envs.registered_environment(env), respx.mock(assert_all_called=False):
            args = make_args(engine_profile="chat", engine_environment=env.name, engine_tool_timeout=600)
            task = asyncio.create_task(slime.generate(args, sample, dict(SAMPLING)))
            await asyncio.wait_for(env.starting.wait(), 30)
            with slime_aborting():
                await asyncio.wait_for(task, 20)

    run(go())
    fsm = sample.metadata["fsm"]
    assert (sample.status.name, fsm["termination_reason"]) == ("ABORTED", "abort_requested")
    assert [tuple(e) for e in fsm["trace"]] == [("RESET", "cancelled", "ABORTED")] and env.ended == 1


def test_run_accepts_an_empty_tools_flag_as_no_tool_offered() -> None:
    """`--tools ""` is `engine_tools: []` (an environment-only episode); other lists stay lists."""
    from engine.cli import build_parser
    from engine.run import settings_args

    parser = build_parser()
    for given, offered in (("", ()), ("a,b", ("a", "b"))):
        args = settings_args(parser.parse_args(["run", "--tools", given]))
        assert EngineConfig.from_args(args).tools == offered
    assert EngineConfig.from_args(settings_args(parser.parse_args(["run"]))).tools is None  # unset: every tool


def test_run_refuses_an_input_naming_an_environment_that_is_not_registered(tmp_path: Any, capsys: Any) -> None:
    import json

    from engine.cli import main

    lines = [{"prompt": "a", "metadata": {"environment": "none"}}, {"prompt": "b", "metadata": {"environment": "nowhere_env"}}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    code = main(["run", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--tools", "",
                 "--no-progress"])
    said = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "out.jsonl").exists()
    assert "--input (the sample at position 1): no environment named 'nowhere_env'" in said
