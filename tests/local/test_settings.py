"""Settings read from slime's args: checked and capped at load, with one clear sentence per problem.

An unusable setting ends every sample with `engine_setup_failed` and that sentence; a huge
concurrency is capped instead of building HTTP clients until memory runs out; a typo in an
`engine_*` key is warned about once, with the closest known key.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import respx

from engine import slime
from engine.settings import EngineConfig, SettingsError
from engine.settings.core import MAX_CONNECTIONS, run_rows
from engine.local.sample import Sample
from engine.loop.preflight import check_tools, log_tool_problems
from tests.conftest import run
from tests.support.helpers import SAMPLING, URL, ScriptedServer, make_args, turn


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    """Each test sees its own once-only warnings (they are remembered per process)."""
    import engine.logs
    import engine.settings.core

    engine.logs.forget()
    engine.settings.core._from_args_cache.clear()


@pytest.mark.parametrize(("key", "value", "says"), [
    ("engine_max_turns", 0, "engine_max_turns must be a whole number from 1 to 100000, got 0"),
    ("engine_max_turns", "many", "engine_max_turns must be a whole number from 1 to 100000, got 'many'"),
    ("engine_max_tool_calls", -1, "engine_max_tool_calls must be a whole number from 0"),
    ("engine_tool_timeout", 0, "engine_tool_timeout must be a number > 0 and <= 86400, got 0"),
    ("engine_request_timeout", float("inf"), "engine_request_timeout must be a number > 0"),
    ("engine_retry_attempts", True, "engine_retry_attempts must be a whole number from 1 to 1000, got True"),
    ("engine_retry_deadline", -5, "engine_retry_deadline must be a number > 0"),
    ("engine_profile", 3, "engine_profile must be text, got 3"),  # a name: checked against the registered ones at start-up
    ("engine_tool_parser", ["hermes"], "engine_tool_parser must be text"),
    ("engine_tools", 3, "engine_tools must be a list of names"),
    ("engine_server_url", "localhost:30000", "engine_server_url must be an http:// or https:// URL"),
    ("sglang_server_concurrency", 0, "sglang_server_concurrency must be a whole number >= 1, got 0"),
    ("rollout_max_context_len", -5, "rollout_max_context_len must be a whole number from 1"),
    ("partial_rollout", "perhaps", "partial_rollout must be true or false, got 'perhaps'"),
])
def test_an_unusable_setting_is_one_clear_sentence(key: str, value: object, says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        EngineConfig.from_args(make_args(**{key: value}))
    assert str(caught.value).startswith(says)


def test_backoff_bounds_must_agree() -> None:
    with pytest.raises(SettingsError, match=r"engine_retry_max_delay \(1\) must be >= engine_retry_base_delay \(2\)"):
        EngineConfig.from_args(make_args(engine_retry_base_delay=2, engine_retry_max_delay=1))


def test_yaml_strings_and_lists_are_read_as_slime_passes_them() -> None:
    cfg = EngineConfig.from_args(make_args(engine_max_turns="4", engine_tools="code_interpreter, python_session",
                                           engine_gc_freeze="false", engine_tool_timeout=30))
    assert (cfg.max_turns, cfg.tools, cfg.gc_freeze, cfg.tool_timeout) == (4, ("code_interpreter", "python_session"), False, 30.0)


def test_every_sample_of_an_unusable_setting_ends_engine_setup_failed_with_the_sentence() -> None:
    args = make_args(engine_max_turns=0)
    samples = [Sample(index=i, prompt="What is 1 + 1?") for i in range(3)]

    async def go() -> None:
        await asyncio.gather(*(slime.generate(args, s, dict(SAMPLING)) for s in samples))

    run(go())
    for s in samples:
        fsm = s.metadata["fsm"]
        assert s.status == Sample.Status.FAILED and fsm["termination_reason"] == "engine_setup_failed"
        assert "engine_max_turns must be a whole number from 1 to 100000, got 0" in fsm["engine_error"]


def test_a_huge_concurrency_is_capped_and_the_sample_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    args = make_args(sglang_server_concurrency=10**8, rollout_num_gpus=8)
    with caplog.at_level(logging.WARNING, logger="engine.settings"):
        cfg = EngineConfig.from_args(args)
        EngineConfig.from_args(args)
    assert cfg.max_connections == MAX_CONNECTIONS
    capped = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert len(capped) == 2 and len(set(capped)) == 2  # each said once, however many samples ask
    server = ScriptedServer([turn("Answer: \\boxed{2}")])
    sample = Sample(prompt="What is 1 + 1?")
    with respx.mock(assert_all_called=False) as mock:
        mock.post(URL + "/generate").mock(side_effect=server)
        run(slime.generate(args, sample, dict(SAMPLING)))
    assert sample.status == Sample.Status.COMPLETED


def test_an_unknown_engine_key_is_warned_once_with_the_closest_key(caplog: pytest.LogCaptureFixture) -> None:
    args = make_args(engine_max_turnz=3, engine_tool_timout=5, engine_zzz_qqq=1, other_slime_arg=1)
    with caplog.at_level(logging.WARNING, logger="engine.settings"):
        for _ in range(3):
            cfg = EngineConfig.from_args(args)
    said = [r.getMessage() for r in caplog.records]
    assert said.count("unknown engine setting engine_max_turnz (ignored); did you mean engine_max_turns?") == 1
    assert said.count("unknown engine setting engine_tool_timout (ignored); did you mean engine_tool_timeout?") == 1
    assert said.count("unknown engine setting engine_zzz_qqq (ignored)") == 1
    assert not any("other_slime_arg" in s for s in said)  # slime's own args are not ours to judge
    assert cfg.max_turns == 16  # the typo set nothing


def test_remembered_settings_follow_a_changed_args() -> None:
    args = make_args(engine_max_turns=4, engine_tools=["code_interpreter"])
    first = EngineConfig.from_args(args)
    assert EngineConfig.from_args(args) is first  # once per sample: read once
    args.engine_max_turns = 5
    assert EngineConfig.from_args(args).max_turns == 5
    args.engine_tools.append("python_session")  # changed in place: still seen
    assert EngineConfig.from_args(args).tools == ("code_interpreter", "python_session")
    args.engine_max_turns = 0
    with pytest.raises(SettingsError):
        EngineConfig.from_args(args)


def test_every_setting_documents_itself() -> None:
    for s in run_rows():
        assert s.key and s.help and s.allowed()
        assert s.read(None) == s.default


def test_tool_check_reasons(caplog: pytest.LogCaptureFixture) -> None:
    from engine import tools
    from engine.tools.registry import registered

    class Checked(tools.Tool):
        name = "checked_tool"
        description = "a tool with a check"

        def __init__(self, reason: object) -> None:
            self.reason = reason

        async def check(self) -> str | None:
            if isinstance(self.reason, Exception):
                raise self.reason
            if self.reason == "hang":
                await asyncio.sleep(10)
            return self.reason  # type: ignore[return-value]

        async def execute(self, state: object, **arguments: object) -> str:
            return ""

    with registered(Checked(None)):
        assert run(check_tools(["checked_tool"])) == {}
    with registered(Checked("probe failed: no user namespaces")):
        assert run(check_tools(["checked_tool"])) == {"checked_tool": "probe failed: no user namespaces"}
        with caplog.at_level(logging.ERROR, logger="engine.loop.preflight"):
            run(log_tool_problems(["checked_tool"]))
            run(log_tool_problems(["checked_tool"]))
        assert [r.getMessage() for r in caplog.records].count(
            "tool checked_tool cannot work: probe failed: no user namespaces; samples that call it end FAILED (tool_unavailable), none of them trained") == 1
    with registered(Checked(OSError("boom"))):
        assert run(check_tools(["checked_tool"])) == {"checked_tool": "its check failed: OSError: boom"}
    with registered(Checked("hang")):
        assert run(check_tools(["checked_tool"], timeout=0.05)) == {"checked_tool": "its check did not answer within 0.05 s"}
    assert run(check_tools(["no_such_tool"])) == {"no_such_tool": "not registered"}
