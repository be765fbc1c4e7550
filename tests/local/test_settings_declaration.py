"""One declaration per setting: EngineConfig, slime's args, the YAML, `run`'s flags and docs/settings.md
are all made from `engine.config.SETTINGS`, and these tests hold them to it."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import attrs
import pytest

import engine.config
from engine.cli import build_parser, flag_type
from engine.config import (DERIVED, SETTING, SETTINGS, Derivation, EngineConfig, Setting, SettingsError, field_sources,
                           flagged_settings, main_settings, readers_of, settings_page)
from engine.run import FLAG_KEYS, RUN_DEFAULTS, SAMPLING_SETTINGS, settings_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    engine.config._warned.clear()
    engine.config._from_args_cache.clear()


def test_the_settings_page_is_the_declarations_rendering() -> None:
    page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert page == settings_page(), "docs/settings.md is stale: run python -m engine settings --out docs/settings.md"
    for key, row in SETTINGS.items():  # every row is on it, with what it accepts
        assert f"| `{key}` | {row.allowed()}" in page


def test_the_settings_command_writes_and_checks_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "settings.md"
    assert main_settings(argparse.Namespace(out=str(out), check=False)) == 0 and out.read_text() == settings_page()
    assert main_settings(argparse.Namespace(out=str(out), check=True)) == 0
    out.write_text(settings_page().replace("model turns per sample", "turns"))
    assert main_settings(argparse.Namespace(out=str(out), check=True)) == 1
    assert "is not current" in capsys.readouterr().err


def test_every_engine_row_is_read_by_a_field_and_every_field_by_its_rows() -> None:
    sources = field_sources()
    for key, row in SETTINGS.items():
        if row.reader == "engine":
            assert readers_of(key), f"{key}: no EngineConfig field reads it"
        else:
            assert not readers_of(key) and key in SAMPLING_SETTINGS, key
    for f in attrs.fields(EngineConfig):
        source = sources.get(f.name)
        assert source is not None, f"EngineConfig.{f.name} is read from no setting"
        if isinstance(source, Derivation):
            assert f.metadata[DERIVED] is source and all(k in SETTINGS for k in source.keys)
        else:  # one row: the field's default is the row's (made from it, or a hand-made field that agrees)
            assert f.default == source.default, f.name
            assert f.metadata.get(SETTING, source) is source


def test_a_direct_config_is_checked_and_converted_by_the_same_rows() -> None:
    with pytest.raises(SettingsError, match=r"^engine_max_turns must be a whole number from 1 to 100000, got 0$"):
        EngineConfig(max_turns=0)
    with pytest.raises(SettingsError, match=r"^engine_abort_status must be one of retry, aborted, got 'xml'$"):
        EngineConfig(abort_status="xml")
    cfg = EngineConfig(tools=["code_interpreter"], tool_timeout=30, max_turns=None)
    assert cfg.tools == ("code_interpreter",) and isinstance(cfg.tool_timeout, float) and cfg.max_turns == 16
    assert EngineConfig(tool_concurrency=10_000).tool_concurrency == 10_000  # a capped row: usable above its cap
    assert EngineConfig.from_args(argparse.Namespace(engine_tool_concurrency=10_000)).tool_concurrency == 4096  # read: lowered


def test_a_derived_field_is_a_small_function_of_its_rows() -> None:
    cfg = EngineConfig.from_args(argparse.Namespace(sglang_router_ip="10.0.0.2", sglang_router_port=3000, max_tokens_per_gpu=4096,
                                                    context_parallel_size=2, sglang_server_concurrency=8, rollout_num_gpus=8,
                                                    rollout_num_gpus_per_engine=2, engine_retry_deadline=None,
                                                    engine_request_timeout=90, rollout_function_path="slime.fully_async_rollout.x"))
    assert (cfg.server_url, cfg.max_context_len, cfg.max_connections) == ("http://10.0.0.2:3000", 8192, 32)
    assert cfg.retry.deadline == 90.0 and cfg.fully_async


def test_the_remembered_config_follows_every_key_a_field_reads() -> None:
    args = argparse.Namespace(rollout_function_path="slime.rollout.sglang_rollout.generate_rollout")
    assert not EngineConfig.from_args(args).fully_async
    args.rollout_function_path = "examples.fully_async.fully_async_rollout.generate_rollout_fully_async"
    assert EngineConfig.from_args(args).fully_async


def _run_parser() -> argparse.ArgumentParser:
    parser = build_parser("fsm-rollout")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def test_every_flag_of_run_is_made_from_its_row() -> None:
    run = _run_parser()
    text = " ".join(run.format_help().split())
    by_option = {o: a for a in run._actions for o in a.option_strings}
    for row in flagged_settings():
        assert row.flag is not None
        action = by_option[row.flag.name]
        assert FLAG_KEYS[action.dest] == row.key and action.default is None
        assert f"[{row.key}] (default: {row.default_text(for_run=True)})" in text
    assert RUN_DEFAULTS == {"sglang_server_concurrency": 64, "engine_retry_attempts": 4, "engine_retry_deadline": 60.0}


@pytest.mark.parametrize("row", [s for s in flagged_settings() if s.kind in (int, float)], ids=lambda s: s.key)
def test_a_flag_refuses_exactly_what_its_row_refuses(row: Setting) -> None:
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
    with caplog.at_level(logging.WARNING, logger="engine.config"):
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
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        EngineConfig.from_args(args)
        EngineConfig.from_args(args)
    assert [r.getMessage() for r in caplog.records] == [
        "unknown engine setting engine_gc_freez (ignored); did you mean engine_gc_freeze?"]


def test_every_rows_default_is_allowed_by_its_own_row() -> None:
    for row in SETTINGS.values():
        assert row.help and row.allowed() and row.default_text(), row.key
        assert row.fits(row.default) and row.read(None) == row.default, row.key
        if row.run_default is not None:
            assert row.read(row.run_default) == row.run_default, row.key


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
