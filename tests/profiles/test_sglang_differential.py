"""The engine's tool-call parsers against SGLang's own detectors, turn by turn (formats_corpus.py).

SGLang's readings come from `sglang_oracle.py`, run in a scratch venv holding sglang==0.5.23
(.ci/run builds it and sets FSM_SGLANG_ORACLE to the JSON it writes). Without that file the
test skips, saying how to make it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import pytest

from engine.profiles.parsers import get_tool_parser, native_parser_names
from tests.profiles.formats_corpus import BRIDGED, TOOLS, cases

ORACLE = os.environ.get("FSM_SGLANG_ORACLE")
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CASES = cases()


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    if not ORACLE or not os.path.isfile(ORACLE):
        pytest.skip("SGLang's readings are not here: run tests/profiles/sglang_oracle_venv.sh VENV PYTHON, then "
                    "VENV/bin/python tests/profiles/sglang_oracle.py OUT.json and set FSM_SGLANG_ORACLE=OUT.json (.ci/run does)")
    with open(ORACLE, encoding="utf-8") as f:
        data = json.load(f)
    assert data["sglang"] == "0.5.23", "the corpus's expectations were written against SGLang 0.5.23"
    return data


@pytest.fixture(scope="module")
def readings(oracle: dict[str, Any]) -> dict[str, Any]:
    return oracle["readings"]


@pytest.mark.parametrize("name", sorted(BRIDGED))
def test_a_name_the_engine_does_not_read_natively_works_through_sglang(name: str, oracle: dict[str, Any]) -> None:
    """Run by the oracle inside the SGLang venv: `get_tool_parser(name)` there is SGLang's detector."""
    bridged = oracle["bridged"]
    assert "raised" not in bridged, bridged
    assert name not in native_parser_names()
    assert bridged[name]["parser"] == "SGLangDetectorParser"
    assert bridged[name]["calls"] == [["code_interpreter", {"code": "print(6*7)"}, None]]


def _sglang_calls(reading: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["parameters"])) for c in reading["calls"]]


def _sglang_args_parse(reading: dict[str, Any]) -> bool:
    try:
        _sglang_calls(reading)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_engine_reads_the_turn_as_sglang_does(case: dict[str, Any], readings: dict[str, Any]) -> None:
    theirs = readings[case["id"]]
    assert "raised" not in theirs, f"SGLang's detector raised: {theirs['raised']}"
    ours = get_tool_parser(case["parser"]).parse(case["text"], SCHEMAS)
    expect = case["expect"]
    if expect.startswith("agree"):
        assert ours.calls, "a well-formed call must be read"
        assert all(c.error is None for c in ours.calls), ours.calls
        assert [(c.name, c.arguments) for c in ours.calls] == _sglang_calls(theirs)
        if expect == "agree/stop_in_sglang_text":
            assert ours.content == "" and theirs["normal_text"].strip() in ("</s>", "|eot_id|>", "|eom_id|>"), theirs
        else:
            assert ours.content.strip() == theirs["normal_text"].strip()
        return
    if expect == "text":  # no call in it for either: the turn is an answer
        assert ours.calls == () and theirs["calls"] == [], (ours, theirs)
        return
    if expect == "unknown_tool":
        # the engine keeps the call (the loop answers unknown_tool); SGLang drops it or keeps it
        assert [(c.name, c.error) for c in ours.calls] == [("web_search", None)]
        assert [n for n, _ in _sglang_calls(theirs)] in ([], ["web_search"])
        return
    kind, _, sglang = expect.partition("/")
    assert kind == "engine_error"
    assert ours.calls and any(c.error for c in ours.calls), f"the engine must answer an error, read {ours}"
    if sglang == "no_call":  # SGLang would have taken the turn as text: the call lost
        assert theirs["calls"] == [], theirs
    elif sglang == "damaged_call":  # a call comes back, but not the one the model meant
        assert theirs["calls"], theirs
        meant = [tuple(c) for c in case["meant"]]
        assert not _sglang_args_parse(theirs) or _sglang_calls(theirs) != meant, theirs
    elif sglang == "string_kept":
        assert [c.error for c in ours.calls] == ["bad_arguments"] and "'days'" in ours.calls[0].detail
        assert _sglang_calls(theirs) == [("lookup", {"city": "Oslo", "days": "soon"})]
    else:
        raise AssertionError(f"unknown expectation {expect}")


def test_corpus_covers_every_native_family(readings: dict[str, Any]) -> None:
    """N names x M turns, printed for the report; every case read by SGLang."""
    per = Counter(c["parser"] for c in CASES)
    assert len(per) >= 13 and min(per.values()) >= 7
    assert set(readings) == {c["id"] for c in CASES}
    print(f"\n{len(per)} parser names x {len(CASES)} turns ({min(per.values())}-{max(per.values())} each)")
