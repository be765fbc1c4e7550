"""Environments answering model turns: the ENVIRONMENT state's edges, user turns through the profile,
per-turn rewards, and environments that break (raise, wrong type, never answer)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import respx

from engine import envs, tools
from engine.envs.user_simulator import UserSimulatorSettings
from engine.settings import EngineConfig, RetryPolicy, SettingsError
from engine.loop.driver import drive, new_rollout
from engine.loop.runtime import Runtime
from engine.local.sample import Sample
from engine.machine.rollout import Rollout
from engine import slime
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, tok, turn

MESSAGES = [{"role": "user", "content": "Guess my number between 1 and 10."}]


class Guess(envs.Environment):
    """Says higher/lower; done when the secret is named. Counts start/end calls."""

    name = "guess_test"

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.ended = 0

    async def start(self, task: envs.Task) -> dict[str, Any]:
        self.started.append((task.prompt, dict(task.metadata)))
        return {"secret": int(task.args.get("secret", task.metadata.get("secret", 7))), "tries": 0}

    async def respond(self, episode: dict[str, Any], conversation: envs.Conversation) -> envs.Reply:
        episode["tries"] += 1
        guess = int("".join(c for c in conversation.text if c.isdigit()) or 0)
        if guess == episode["secret"]:
            return envs.Reply(reward=1.0, done=True, reason=f"guessed in {episode['tries']}", success=True)
        return envs.Reply("Higher." if guess < episode["secret"] else "Lower.", reward=-0.1)

    async def end(self, episode: Any) -> None:
        self.ended += 1


def rollout(script: list, env: envs.Environment, *, metadata: dict | None = None, profile: str = "chat",
            prompt: Any = None, **kw: Any) -> tuple[Rollout, ScriptedServer, Runtime]:
    server = ScriptedServer(script)
    base: dict[str, Any] = dict(server_url=URL, profile=profile, max_context_len=8192, retry=RetryPolicy(max_attempts=1),
                                environment=env.name, tools=())
    base.update(kw)
    cfg = EngineConfig(**base)

    async def go() -> tuple[Rollout, Runtime]:
        with envs.registered_environment(env), respx.mock(assert_all_called=False) as mock:
            mock.post(URL + "/generate").mock(side_effect=server)
            rt = Runtime.create(cfg, tokenizer=tok())
            r = new_rollout(rt, prompt if prompt is not None else MESSAGES, SAMPLING, metadata=metadata or {"secret": 7})
            try:
                await drive(rt, r)
            finally:
                await rt.aclose()
            return r, rt

    r, rt = run(go())
    r.traj.check(full=True, max_total_length=r.token_budget)
    return r, server, rt


def path(r: Rollout) -> list[tuple[str, str, str]]:
    return [tuple(e) for e in r.record.trace]


def test_the_environment_answers_each_turn_until_it_ends_the_episode():
    env = Guess()
    r, server, rt = rollout([turn("5"), turn("8"), turn("7")], env)
    assert (r.state, r.record.reason, r.record.env_reason) == ("COMPLETED", "environment_done", "guessed in 3")
    assert ("GENERATE", "reply", "ENVIRONMENT") in path(r)
    assert ("ENVIRONMENT", "env_reply", "BUDGET_CHECK") in path(r)
    assert path(r)[-1] == ("ENVIRONMENT", "env_reply", "COMPLETED")
    assert env.started == [(MESSAGES, {"secret": 7})] and env.ended == 1
    # the context of the last request is exactly the template's full render of the conversation
    convo = [*MESSAGES, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Higher."},
             {"role": "assistant", "content": "8"}, {"role": "user", "content": "Lower."}]
    full = tok().apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert tok().decode(server.requests[-1]["input_ids"]) == full
    # user turns are mask 0 / logprob 0.0; model turns mask 1
    kinds = [s.kind for s in r.traj.segments]
    assert kinds == ["model", "observation", "model", "observation", "model"]
    mask, lps = r.traj.loss_mask.tolist(), r.traj.logprobs.tolist()
    for s in r.traj.segments:
        if s.kind == "observation":
            assert set(mask[s.start:s.end]) == {0} and set(lps[s.start:s.end]) == {0.0}
    # per-turn rewards, each with its model turn's span
    turns = r.record.turn_log
    assert [t.get("reward") for t in turns] == [-0.1, -0.1, 1.0]
    model = [s for s in r.traj.segments if s.kind == "model"]
    assert [t["span"] for t in turns] == [(s.start, s.end) for s in model]


def test_the_retool_profile_appends_the_reply_in_its_markup():
    r, server, _ = rollout([turn("5"), turn("7")], Guess(), profile="retool", prompt="Guess my number.")
    assert r.state == "COMPLETED"
    text = tok().decode(server.requests[-1]["input_ids"])
    assert text.endswith("<|im_start|>assistant5<|im_end|>\n<|im_start|>userHigher.<|im_end|>\n<|im_start|>assistant")


def test_without_an_environment_a_plain_turn_is_the_final_answer():
    r, _, _ = rollout([turn("5")], Guess(), environment=None)
    assert (r.state, r.record.reason) == ("COMPLETED", "answered")


def test_max_turns_count_the_environments_turns():
    r, server, _ = rollout([turn("1"), turn("2"), turn("3")], Guess(), max_turns=2)
    assert (r.state, r.record.reason) == ("TRUNCATED", "max_turns_reached")
    assert len(server.requests) == 2


def test_a_reply_over_the_context_budget_is_trimmed():
    class Chatty(Guess):
        async def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:
            return envs.Reply("words " * 400, reward=0.5)

    prompt_len = len(tok().apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True))
    r, _, _ = rollout([turn("5")], Chatty(), max_context_len=prompt_len + 40)
    assert path(r)[-2:] == [("ENVIRONMENT", "env_reply", "TRIM"), ("TRIM", "trim", "TRUNCATED")]
    assert r.record.reason == "observation_over_budget"
    assert r.traj.total_length == prompt_len + 40
    assert r.record.turn_log[0]["reward"] == 0.5


class Broken(Guess):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    async def respond(self, episode: Any, conversation: envs.Conversation) -> Any:
        if self.how == "raises":
            raise RuntimeError("the game crashed")
        if self.how == "hangs":
            await asyncio.sleep(3600)
        return {"text": "not a Reply"} if self.how == "wrong_type" else envs.Reply("x", reward=float("nan"))

    async def start(self, task: envs.Task) -> Any:
        if self.how == "start_hangs":
            await asyncio.sleep(3600)
        if self.how == "start_raises":
            raise envs.EnvironmentFailed("no board today")
        if self.how == "bad_opening":
            return envs.Opening({}, prompt=[{"content": "no role"}])
        if self.how == "unrenderable_opening":
            return envs.Opening({}, prompt=[{"role": "user", "content": {"not": "text"}}, {"role": "nobody"}])
        return await super().start(task)


@pytest.mark.parametrize("how, where, error", [
    ("raises", "ENVIRONMENT", "environment guess_test failed: RuntimeError: the game crashed"),
    ("wrong_type", "ENVIRONMENT", "respond must return a Reply or a str, not dict"),
    ("bad_reward", "ENVIRONMENT", "Reply.reward must be a finite number"),
    ("hangs", "ENVIRONMENT", "environment guess_test did not answer within 0.2 seconds"),
    ("start_hangs", "RESET", "environment guess_test did not start within 0.2 seconds"),
    ("start_raises", "RESET", "environment guess_test failed to start: EnvironmentFailed: no board today"),
    ("bad_opening", "RESET", "Opening.prompt must be non-empty text or a list of chat messages"),
    ("unrenderable_opening", "RESET", "environment guess_test: the prompt its start made cannot be rendered: UndefinedError"),
])
def test_an_environment_that_breaks_ends_the_sample_failed_with_the_reason(how, where, error):
    env = Broken(how)
    r, server, _ = rollout([turn("5")], env, tool_timeout=0.2)
    assert path(r)[-1] == (where, "environment_failed", "FAILED")
    assert r.record.reason == "environment_failed" and error in r.record.error
    assert env.ended == 1  # the episode was ended all the same
    if where == "RESET":  # nothing generated; the sample holds its own prompt, untrained
        assert server.requests == [] and r.traj.response_length == 0
        assert list(r.traj.prompt_ids) == list(r.prompt_ids) and len(r.prompt_ids) > 0


def test_through_slime_a_failed_environment_is_not_trained_and_rewards_are_in_the_metadata():
    env = Guess()

    async def go(sample: Sample, script: list, env: envs.Environment = env) -> None:
        server = ScriptedServer(script)
        with envs.registered_environment(env), respx.mock(assert_all_called=False) as mock:
            mock.post("http://sglang.test:30000/generate").mock(side_effect=server)
            args = make_args(engine_profile="chat", engine_environment="guess_test", engine_tool_timeout=5)
            await slime.generate(args, sample, dict(SAMPLING))

    good = Sample(prompt=MESSAGES, metadata={"secret": 3})
    run(go(good, [turn("5"), turn("3")]))
    fsm = good.metadata["fsm"]
    assert good.status.name == "COMPLETED" and fsm["termination_reason"] == "environment_done"
    assert fsm["environment"] == {"name": "guess_test", "reason": "guessed in 2", "success": True}
    assert [t["reward"] for t in fsm["turn_rewards"]] == [-0.1, 1.0]
    assert env.started[-1] == (MESSAGES, {"secret": 3})  # the sample's own metadata, not the engine's

    broken = Sample(prompt=MESSAGES, metadata={"secret": 3})
    run(go(broken, [turn("5")], Broken("raises")))
    assert broken.status.name == "FAILED" and broken.remove_sample is True
    assert broken.metadata["fsm"]["termination_reason"] == "environment_failed"


def test_an_unknown_environment_is_one_clear_setup_error():
    with pytest.raises(ValueError, match="unknown environment 'nope'.*registered are .*user_simulator"):
        Runtime.create(EngineConfig(server_url=URL, environment="nope"), tokenizer=tok())


def test_a_tool_reward_is_kept_with_the_turn_that_called_it():
    class Scored(tools.Tool):
        name = "score_test"
        description = "Score a move."
        parameters = {"type": "object", "properties": {"move": {"type": "string"}}, "required": ["move"]}

        async def execute(self, state: Any, **arguments: Any) -> tools.ToolResult:
            return tools.ToolResult("ok", reward=0.25 if arguments["move"] == "good" else float("inf"))

    call = '<tool_call>{"name": "score_test", "arguments": {"move": "%s"}}</tool_call>'
    with tools.registry.registered(Scored()):
        r, _, _ = rollout([turn(call % "good" + call % "good"), turn(call % "bad"), turn("7")], Guess(),
                          tools=("score_test",))
    rewards = [t.get("reward") for t in r.record.turn_log]
    assert rewards == [0.5, None, 1.0]  # two calls add up; a non-finite reward is dropped


def test_the_setting_is_read_and_checked():
    cfg = EngineConfig.from_args(make_args(engine_environment="user_simulator", engine_user_sim_url="http://127.0.0.1:1",
                                           engine_user_sim_api="generate"))
    own = cfg.plugin(UserSimulatorSettings)  # the simulator's own settings, declared with it, read with the engine's
    assert (cfg.environment, own.url, own.api) == ("user_simulator", "http://127.0.0.1:1", "generate")
    with pytest.raises(SettingsError, match="engine_user_sim_api must be one of chat, generate"):
        EngineConfig.from_args(make_args(engine_user_sim_api="openai"))
    assert json.dumps(EngineConfig.from_args(make_args()).environment) == "null"


def test_reward_func_and_trace_text_read_the_per_turn_rewards():
    from engine.trace.turns import format_turns

    env = Guess()

    async def go(sample: Sample, environment: str | None) -> dict:
        server = ScriptedServer([turn("5"), turn("3")] if environment else [turn("Answer: \\boxed{3}")])
        with envs.registered_environment(env), respx.mock(assert_all_called=False) as mock:
            mock.post("http://sglang.test:30000/generate").mock(side_effect=server)
            args = make_args(engine_profile="chat", engine_environment=environment)
            await slime.generate(args, sample, dict(SAMPLING))
            return await slime.reward_func(args, sample)

    sample = Sample(prompt=MESSAGES, metadata={"secret": 3}, label="3")
    reward = run(go(sample, "guess_test"))
    # with an environment, the score is its per-turn rewards; there is no boxed answer to check
    assert reward["turn_reward"] == pytest.approx(0.9) and reward["score"] == pytest.approx(0.9)
    assert reward["answer_score"] < 0
    text = format_turns({"tokens": sample.tokens, "response_length": sample.response_length,
                         "metadata": sample.metadata}, lambda ids: tok().decode(ids))
    assert "  reward -0.1 (this turn, by the environment)" in text
    assert "  <- user (" in text and "Lower." in text
    assert text.endswith("episode ended by the environment guess_test: guessed in 2")

    plain = Sample(prompt=MESSAGES, label="3")
    reward = run(go(plain, None))
    assert (reward["score"], reward["turn_reward"], reward["answer_score"]) == (1.0, 0.0, 1.0)


def test_envs_knows_nothing_of_the_engine_but_how_settings_are_declared():
    """Like `engine.tools`, the environment author's API imports nothing else of the engine but the
    settings (an environment declares its own), and those import neither the loop nor the machine."""
    from tests.test_house import import_graph

    graph = import_graph()
    env_modules = [m for m in graph if m == "engine.envs" or m.startswith("engine.envs.")]
    assert "engine.envs.user_simulator" in env_modules
    assert {d for m in env_modules for d in graph[m] if not d.startswith("engine.envs")} == {"engine.settings",
                                                                                             "engine.settings.declare"}
    settings = [m for m in graph if m.startswith("engine.settings")]
    reached = {d for m in settings for d in graph[m]}
    assert not {d for d in reached if not d.startswith(("engine.settings", "engine.sandbox", "engine.logs"))}


def test_slimes_abort_cuts_an_environment_that_is_answering_and_writes_no_checkpoint():
    """The episode lives in the environment's memory: a re-queued sample starts from its prompt."""
    from tests.slime.slime_rules import slime_aborting

    answering = asyncio.Event()

    class Slow(Guess):
        async def respond(self, episode: Any, conversation: envs.Conversation) -> envs.Reply:
            answering.set()
            await asyncio.sleep(600)
            return envs.Reply("late")

    env = Slow()
    sample = Sample(prompt=MESSAGES, metadata={"secret": 3})

    async def go() -> None:
        with envs.registered_environment(env), respx.mock(assert_all_called=False) as mock:
            mock.post("http://sglang.test:30000/generate").mock(side_effect=ScriptedServer([turn("5")]))
            args = make_args(engine_profile="chat", engine_environment="guess_test", engine_tool_timeout=600,
                             partial_rollout=True)
            task = asyncio.create_task(slime.generate(args, sample, dict(SAMPLING)))
            await asyncio.wait_for(answering.wait(), 30)
            with slime_aborting():
                await asyncio.wait_for(task, 20)  # long before the environment would answer

    run(go())
    fsm = sample.metadata["fsm"]
    assert sample.status.name == "ABORTED" and fsm["termination_reason"] == "abort_requested"
    assert tuple(fsm["trace"][-1]) == ("ENVIRONMENT", "cancelled", "ABORTED")
    assert "checkpoint" not in fsm and env.ended == 1
