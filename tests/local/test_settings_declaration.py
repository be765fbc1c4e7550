"""One declaration per setting: EngineConfig's fields are the declarations, and slime's args, the YAML,
`run`'s flags and docs/settings.md are all made from them; these tests hold them to it."""

from __future__ import annotations

import argparse
import ast
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

import engine.logs
import engine.settings.core
from engine.cli import build_parser, flag_type
from engine.run import flag_keys, run_defaults, settings_args
from engine.settings import EngineConfig, Flag, Kind, RetryPolicy, Sampling, SettingsError, setting, settings
from engine.settings.core import flagged_settings, load_plugins, run_rows
from engine.settings.declare import NESTED, ROW, Setting, declared_keys, keyed, owner, plugins, rows
from engine.settings.page import main_settings, settings_page

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    engine.logs.forget()
    engine.settings.core._from_args_cache.clear()


def test_the_settings_page_is_the_declarations_rendering() -> None:
    page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert page == settings_page(), "docs/settings.md is stale: run python -m engine settings --out docs/settings.md"
    for row in _shipped_settings():  # every key is on it, with what it accepts
        assert row.key is None or f"| `{row.key}` | {row.allowed()}" in page
    assert "| `engine_user_sim_url` |" in page  # a shipped plugin's settings too, in a table of its own


def test_the_settings_command_writes_and_checks_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "settings.md"
    assert main_settings(argparse.Namespace(out=str(out), check=False)) == 0 and out.read_text() == settings_page()
    assert main_settings(argparse.Namespace(out=str(out), check=True)) == 0
    out.write_text(settings_page().replace("model turns per sample", "turns"))
    assert main_settings(argparse.Namespace(out=str(out), check=True)) == 1
    assert "is not current" in capsys.readouterr().err


def test_every_field_of_the_config_is_a_declaration_and_every_key_is_declared_once() -> None:
    for f in attrs.fields(EngineConfig):
        if f.name == "plugin_settings":
            continue
        assert ROW in f.metadata or NESTED in f.metadata, f"EngineConfig.{f.name} is not declared by setting()"
        if ROW in f.metadata:
            row: Setting = f.metadata[ROW]
            assert row.name == f.name and f.default == (None if row.derive else row.default), f.name
    keys = [r.key for cls in (EngineConfig, Sampling) for r in rows(cls) if r.key]
    assert len(keys) == len(set(keys)) and set(keys) <= declared_keys()
    assert owner("engine_retry_attempts") is RetryPolicy and owner("engine_max_turns") is EngineConfig


def test_a_direct_config_is_converted_and_checked_as_slimes_args_are(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(SettingsError, match=r"^engine_server_url must be an http:// or https:// URL, got 'localhost:30000'$"):
        EngineConfig(server_url="localhost:30000")
    with pytest.raises(SettingsError, match=r"^engine_max_turns must be a whole number from 1 to 100000, got 0$"):
        EngineConfig(max_turns=0)
    with pytest.raises(SettingsError, match=r"^engine_abort_status must be one of retry, aborted, got 'xml'$"):
        EngineConfig(abort_status="xml")
    with pytest.raises(SettingsError, match=r"^engine_retry_attempts must be a whole number from 1 to 1000, got 0$"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(SettingsError, match=r"^max_connections must be a whole number >= 1, got 0$"):
        EngineConfig(max_connections=0)
    with pytest.raises(SettingsError, match=r"^retry must be a RetryPolicy, got 3$"):
        EngineConfig(retry=3)
    cfg = EngineConfig(tools=["code_interpreter"], tool_timeout=30, max_turns=None)
    assert cfg.tools == ("code_interpreter",) and isinstance(cfg.tool_timeout, float) and cfg.max_turns == 16
    with caplog.at_level(logging.WARNING):  # a capped setting is lowered, with one warning, however it is given
        direct = EngineConfig(tool_concurrency=10_000).tool_concurrency
        read = EngineConfig.from_args(argparse.Namespace(engine_tool_concurrency=10_000)).tool_concurrency
    assert direct == read == 4096
    assert [r.getMessage() for r in caplog.records] == ["engine_tool_concurrency=10000 is more than the engine uses; capped at 4096"]
    assert attrs.evolve(cfg, max_turns="3").max_turns == 3  # evolve converts too


def test_values_made_from_several_keys_are_computed_by_every_construction_alike() -> None:
    args = argparse.Namespace(sglang_router_ip="10.0.0.2", sglang_router_port=3000, max_tokens_per_gpu=4096,
                              context_parallel_size=2, sglang_server_concurrency=8, rollout_num_gpus=8,
                              rollout_num_gpus_per_engine=2, engine_retry_deadline=None, engine_request_timeout=90,
                              rollout_function_path="slime.fully_async.x")
    cfg = EngineConfig.from_args(args)
    assert (cfg.server_url, cfg.max_context_len, cfg.max_connections) == ("http://10.0.0.2:3000", 8192, 32)
    assert cfg.retry.deadline == 90.0 and cfg.fully_async
    direct = EngineConfig(router_ip="10.0.0.2", router_port=3000, max_tokens_per_gpu=4096, context_parallel_size=2,
                          server_concurrency=8, num_gpus=8, gpus_per_engine=2, request_timeout=90,
                          rollout_function_path="slime.fully_async.x")
    assert direct == cfg
    plain = EngineConfig()
    assert (plain.server_url, plain.max_context_len, plain.max_connections, plain.fully_async) == (
        "http://127.0.0.1:30000", None, 512, False)
    assert EngineConfig(server_url="http://h:1/", router_ip="10.0.0.2", router_port=3000).server_url == "http://h:1"  # a URL given wins
    assert EngineConfig(retry=RetryPolicy(deadline=5)).retry.deadline == 5.0


def test_the_remembered_config_follows_every_key_a_field_reads() -> None:
    args = argparse.Namespace(rollout_function_path="slime.rollout.sglang_rollout.generate_rollout")
    assert not EngineConfig.from_args(args).fully_async
    args.rollout_function_path = "examples.fully_async.fully_async_rollout.generate_rollout_fully_async"
    assert EngineConfig.from_args(args).fully_async


def _run_parser() -> argparse.ArgumentParser:
    parser = build_parser("fsm-rollout")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]  # type: ignore[no-any-return]


def test_every_flag_of_run_is_made_from_its_declaration() -> None:
    run = _run_parser()
    text = " ".join(run.format_help().split())
    by_option = {o: a for a in run._actions for o in a.option_strings}
    for row in flagged_settings():
        assert row.flag is not None
        action = by_option[row.flag.name]
        assert flag_keys()[action.dest] == row.key and action.default is None
        assert f"[{row.key}] (default: {row.default_text(for_run=True)})" in text
    assert run_defaults() == {"sglang_server_concurrency": 64, "engine_retry_attempts": 4, "engine_retry_deadline": 60.0}


@pytest.mark.parametrize("row", [s for s in flagged_settings() if s.kind in (int, float)], ids=lambda s: s.key)
def test_a_flag_refuses_exactly_what_its_declaration_refuses(row: Setting) -> None:
    parse = flag_type(row)
    assert row.low is not None
    below = str(row.low if row.above_low else row.low - 1)
    with pytest.raises(argparse.ArgumentTypeError, match=f"^must be {row.allowed()}, got '{below}'$"):
        parse(below)
    with pytest.raises(SettingsError):
        row.read(below)
    good = str(row.high if row.high is not None else row.low + 1)
    assert parse(good) == row.read(good)


def _config(tmp_path: Path, text: str) -> argparse.Namespace:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return _run_parser().parse_args(["--config", str(path)])


def test_any_unknown_key_of_run_config_is_warned_once_with_the_closest_key(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    ns = _config(tmp_path, "n_samples_per_promt: 4\nengine_max_turnz: 3\nrollout_temprature: 0.5\nzzz_qqq: 1\nengine_max_turns: 5\n")
    with caplog.at_level(logging.WARNING, logger="engine.settings"):
        for _ in range(2):
            args = settings_args(ns)
            cfg = EngineConfig.from_args(args)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["unknown setting n_samples_per_promt (ignored); did you mean n_samples_per_prompt?",
                    "unknown engine setting engine_max_turnz (ignored); did you mean engine_max_turns?",
                    "unknown setting rollout_temprature (ignored); did you mean rollout_temperature?",
                    "unknown setting zzz_qqq (ignored)"]
    assert cfg.max_turns == 5 and not hasattr(args, "n_samples_per_promt")  # the typo set nothing


def test_slimes_own_keys_are_not_judged_but_engine_keys_are(caplog: pytest.LogCaptureFixture) -> None:
    args = argparse.Namespace(rollout_batch_size=32, n_samples_per_promt=4, engine_gc_freez=False)
    with caplog.at_level(logging.WARNING, logger="engine.settings"):
        EngineConfig.from_args(args)
        EngineConfig.from_args(args)
    assert [r.getMessage() for r in caplog.records] == [
        "unknown engine setting engine_gc_freez (ignored); did you mean engine_gc_freeze?"]


def test_a_declaration_is_checked_when_its_class_is_made() -> None:
    with pytest.raises(TypeError, match=r"Bad.turns: a setting needs help words and a default its own declaration allows"):

        @settings(prefix="engine_bad_")
        class Bad:
            turns: int = setting(0, low=1, high=10, help="turns")

    with pytest.raises(TypeError, match=r"a plugin's settings need a prefix of their own, engine_<name>_; got 'myenv_'"):
        settings(prefix="myenv_")
    with pytest.raises(TypeError, match=r"engine_max_turns is declared twice: by engine.settings.core.EngineConfig and by "):

        @settings(prefix="engine_max_")
        class Clash:
            turns: int = setting(3, low=1, high=10, help="turns")

    with pytest.raises(TypeError, match=r"Kinds.ratio: no setting kind for the annotation 'complex'; declare kind="):

        @settings(prefix="engine_kinds_")
        class Kinds:
            ratio: complex = setting(help="a ratio")

    assert "engine_bad_turns" not in declared_keys() and "engine_max_turns" in keyed(EngineConfig)
    for row in run_rows():  # what every class made here holds
        assert row.help and row.allowed() and row.default_text(), row.key
        assert row.read(None) == row.default, row.key
        if row.run_default is not None:
            assert row.read(row.run_default) == row.run_default, row.key
        assert row.flag is None or isinstance(row.flag, Flag)


def test_a_kind_of_a_plugins_own_reads_and_refuses_in_its_words_and_never_shows_a_secret() -> None:
    def entries(value: object) -> tuple[str, ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and "=" in v for v in value):
            raise ValueError("each entry must be NAME=VALUE")
        return tuple(value)

    @settings(prefix="engine_kindtest_")
    class WithKinds:
        """Kinds of a plugin's own."""

        tokens: tuple[str, ...] = setting((), kind=Kind("a list of NAME=VALUE", entries, quote=False), help="secrets")
        labels: tuple[str, ...] = setting((), kind=Kind("a list of NAME=VALUE", entries), help="labels")

    assert WithKinds(tokens=["a=1"]).tokens == ("a=1",)
    with pytest.raises(SettingsError) as refused:
        WithKinds(tokens=["hunter2"])
    assert str(refused.value) == "engine_kindtest_tokens: each entry must be NAME=VALUE"  # the value is not repeated
    with pytest.raises(SettingsError, match=r"^engine_kindtest_labels must be a list of NAME=VALUE, got \['x'\]$"):
        WithKinds(labels=["x"])
    assert keyed(WithKinds)["engine_kindtest_tokens"].allowed() == "a list of NAME=VALUE"


def test_any_object_with_the_keys_as_attributes_is_read_and_followed() -> None:
    """slime passes an argparse.Namespace (read through its dict); another object is read attribute by attribute."""

    class Args:
        engine_max_turns = 5

        @property
        def engine_max_tool_calls(self) -> int:
            return 2

    args = Args()
    cfg = EngineConfig.from_args(args)
    assert (cfg.max_turns, cfg.max_tool_calls) == (5, 2) and EngineConfig.from_args(args) is cfg
    Args.engine_max_turns = 6
    assert EngineConfig.from_args(args).max_turns == 6
    ns = argparse.Namespace(engine_max_turns=1)
    assert EngineConfig.from_args(ns).max_turns == 1
    ns.engine_max_turns = True  # same value as 1, another type: read again, and refused
    with pytest.raises(SettingsError, match="got True"):
        EngineConfig.from_args(ns)


def test_an_empty_tool_list_offers_no_tool_while_unset_offers_every_tool() -> None:
    # An environment-only episode offers no tool: an empty list must not read as "unset" (every tool).
    assert EngineConfig(tools=()).tools == ()
    assert EngineConfig.from_args(argparse.Namespace(engine_tools=[])).tools == ()
    assert EngineConfig.from_args(argparse.Namespace()).tools is None


# -- a default is written once --------------------------------------------------------------------

_COMMON = {"", "s", "max", "min", "default", "engine", "n", "num", "per", "use", "rollout", "sglang"}
# The same number meaning something else, where the name alone cannot tell: (module, name, value) and why.
_OTHER_MEANINGS = {
    ("engine/local/server/runner.py", "timeout", 120.0): "how long the embedded server may take to start",
    ("engine/local/server/scheduler.py", "timeout", 10.0): "how long the model thread may take to stop",
}


def _words(name: str) -> set[str]:
    return {w for w in re.split(r"[_\W]+", name.lower()) if w not in _COMMON}


def _literal(node: ast.AST) -> Any:
    """A constant, or an expression of constants (`1 << 30`), as its value; None for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        try:
            return ast.literal_eval(node) if isinstance(node, ast.UnaryOp) else eval(compile(ast.Expression(node), "", "eval"), {})
        except Exception:
            return None
    return None


def _fallbacks(tree: ast.AST) -> Iterator[tuple[str, ast.AST, bool]]:
    """(name, value node, strict): a value written for something when nothing else is given.

    Parameters' defaults, class fields' defaults (attrs' `default=` too), getattr/`.get` fallbacks
    and `x or VALUE` (strict: the name's words must all be the setting's); the argument of a call
    (not strict: the function's name shares a word with the setting, as `call_timeout(120.0)`).
    """
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            for arg, d in zip(positional[len(positional) - len(a.defaults):], a.defaults):
                yield arg.arg, d, True
            for arg, kd in zip(a.kwonlyargs, a.kw_defaults):
                if kd is not None:
                    yield arg.arg, kd, True
        elif isinstance(node, ast.ClassDef):
            for st in node.body:
                target = st.targets[0] if isinstance(st, ast.Assign) else st.target if isinstance(st, ast.AnnAssign) else None
                value = getattr(st, "value", None)
                if isinstance(value, ast.Call):
                    value = next((k.value for k in value.keywords if k.arg == "default"),
                                 value.args[0] if value.args and _callee(value) == "setting" else None)
                if isinstance(target, ast.Name) and value is not None:
                    yield target.id, value, True
        elif isinstance(node, ast.Call):
            name = _callee(node)
            if name == "getattr" and len(node.args) == 3 and isinstance(node.args[1], ast.Constant):
                yield str(node.args[1].value), node.args[2], True
            elif name in ("get", "pop", "setdefault") and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
                yield str(node.args[0].value), node.args[1], True
            elif name != "setting":  # a declaration's own literal is counted as its field's (above)
                for arg in node.args:
                    yield name, arg, False
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            for left, right in zip(node.values, node.values[1:]):
                name = left.attr if isinstance(left, ast.Attribute) else left.id if isinstance(left, ast.Name) else ""
                yield name, right, True


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def restated_defaults(sources: dict[str, str], declared: Iterable[Setting]) -> dict[str, list[str]]:
    """Each setting whose default is written in more than one place: key -> the places (path:line name).

    A value too common to tell (0, 1, True, False, None, empty) is not looked for.
    """
    wanted: dict[tuple[type, Any], list[Setting]] = {}
    for row in declared:
        for value in {row.default, row.run_default} - {None}:
            if isinstance(value, bool) or value in (0, 1, "", ()):
                continue
            wanted.setdefault((type(value), value), []).append(row)
    found: dict[str, list[str]] = {}
    for path, text in sources.items():
        for name, node, strict in _fallbacks(ast.parse(text)):
            value = _literal(node)
            try:
                rows_here = wanted.get((type(value), value), [])
            except TypeError:  # an unhashable literal is no setting's default
                continue
            for row in rows_here:
                mine, field = _words(name), _words(row.name)
                named_like = mine & field and (not strict or mine <= field | _words(row.key or ""))
                if named_like and (path, name, value) not in _OTHER_MEANINGS:
                    found.setdefault(row.label, []).append(f"{path}:{node.lineno} {name}")
    return {key: places for key, places in found.items() if len(places) > 1}


def _engine_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted((ROOT / "engine").rglob("*.py"))}


def _shipped_settings() -> list[Setting]:
    load_plugins(())  # the shipped plugins' declarations
    return [r for cls in (EngineConfig, Sampling, *(p for p in plugins() if p.__module__.startswith("engine."))) for r in rows(cls)]


def test_no_setting_default_is_written_twice_in_the_engine() -> None:
    """Every default below reads its declaration (`default_of`, an instance's field, None for "the
    default"); the declaration takes from the sandbox what is the sandbox's own."""
    declared = _shipped_settings()
    assert {"engine_tool_timeout", "engine_max_reply_bytes", "engine_retry_attempts", "engine_user_sim_temperature"} <= {
        r.key for r in declared}
    assert restated_defaults(_engine_sources(), declared) == {}


def test_the_restatement_finder_finds_what_the_issue_found() -> None:
    """A negative control: the restatements this change removed, planted again, are each found."""
    planted = '''
class UserSimulator:
    def __init__(self, url=None, temperature: float = 0.7, timeout: float = 120.0): ...
    def setup(self, settings):
        return UserSimulator(getattr(settings, "tool_timeout", 120.0))

async def execute(self):
    seconds = call_timeout(120.0)

class SGLangClient:
    def __init__(self, request_timeout: float = 1800.0, max_reply_bytes: int = 1 << 30): ...

class RaySettings:
    workers: int = attrs.field(default=4)
'''
    found = restated_defaults({**_engine_sources(), "planted.py": planted}, _shipped_settings())
    assert set(found) == {"engine_tool_timeout", "engine_user_sim_temperature", "engine_request_timeout",
                          "engine_max_reply_bytes", "engine_sandbox_workers"}
    assert sorted(p for p in found["engine_tool_timeout"] if p.startswith("planted.py")) == [
        "planted.py:3 timeout", "planted.py:5 tool_timeout", "planted.py:8 call_timeout"]
    # another meaning is told apart by its name: a worker's start-up wait, a bench's own sizes
    assert restated_defaults({"a.py": "START_TIMEOUT_S = 120.0\nclass S:\n    tool_samples: int = 64\n"}, _shipped_settings()) == {}
