#!/usr/bin/env python3
"""SGLang's own reading of the format corpus, written as JSON: the differential test's oracle.

Runs inside a scratch venv holding sglang==0.5.23 (built by `tools/sglang_oracle_venv.sh`;
SGLang's pins conflict with the project's, so it never goes into the project's venv). It reads
`tests/profiles/formats_corpus.py` three ways: each tool-call case with SGLang's function-call
detector of its parser name, each typed-value case the same way, and each reasoning case as
SGLang serves a chat completion (its reasoning parser first, forced as the prompt says, then the
detector on what is left). SGLang's readings import nothing of the engine; then, for names the
engine reads only through SGLang, the engine's own bridge is run here too (the one place both
are importable) and its reading kept.

Usage (from the checkout): VENV/bin/python tools/sglang_oracle.py OUT.json
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the checkout itself: the project venv's editable install is a .pth this venv does not process
sys.path.insert(0, ROOT)

from tests.profiles.formats_corpus import (  # noqa: E402
    BRIDGED, BRIDGED_REASONING, TOOL_SETS, cases, reasoning_cases, typed_cases,
)


def main(out_path: str) -> int:
    """Read every case with SGLang's parsers; write {"readings", "typed", "served", "bridged"}."""
    logging.disable(logging.CRITICAL)  # the detectors log every malformed case
    started = time.perf_counter()
    import sglang
    from sglang.srt.entrypoints.openai.protocol import Tool

    tools = {name: [Tool.model_validate(t) for t in ts] for name, ts in TOOL_SETS.items()}
    readings = {c["id"]: detect(tools[c["tools"]], c["parser"], c["text"]) for c in cases()}
    typed = {c["id"]: detect(tools[c["tools"]], c["parser"], c["text"]) for c in typed_cases()}
    served = {c["id"]: serve(tools["base"], c["reasoning"], c["parser"], c["forced"], c["text"]) for c in reasoning_cases()}
    data = {"sglang": sglang.__version__, "readings": readings, "typed": typed, "served": served, "bridged": bridged()}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
    print(f"sglang {sglang.__version__}: {len(readings)} turns, {len(typed)} typed values, {len(served)} served turns read "
          f"in {time.perf_counter() - started:.1f} s -> {out_path}")
    return 0


def detect(tools: list[Any], parser: str, text: str) -> dict[str, Any]:
    """SGLang's detector on one turn: whether it sees a call, its normal text and calls."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    reader = FunctionCallParser(tools, parser)  # one per text: detectors keep state
    try:
        found = reader.has_tool_call(text)
        normal, calls = reader.parse_non_stream(text)
    except Exception as exc:  # the oracle records a detector that raises; the test reports it
        return {"raised": f"{type(exc).__name__}: {exc}"}
    return {"has_tool_call": found, "normal_text": normal, "calls": [{"name": c.name, "parameters": c.parameters} for c in calls]}


def serve(tools: list[Any], reasoning: str, parser: str, forced: bool, text: str) -> dict[str, Any]:
    """A chat completion's message as SGLang serves it: reasoning_content, content, tool_calls."""
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    try:
        thought, normal = ReasoningParser(reasoning, stream_reasoning=False, force_reasoning=forced).parse_non_stream(text)
    except Exception as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    read = detect(tools, parser, normal or "")
    if "raised" in read:
        return read
    content = read["normal_text"] if read["has_tool_call"] else (normal or "")
    return {"reasoning": thought or "", "content": content, "calls": read["calls"] if read["has_tool_call"] else []}


def bridged() -> dict[str, Any]:
    """The engine's bridge to SGLang, for the names it does not read natively."""
    try:
        from engine.profiles.parsers import get_reasoning_parser, get_tool_parser

        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SETS["base"]}
        out: dict[str, Any] = {}
        for name, text in BRIDGED.items():
            read = get_tool_parser(name).parse(text, schemas)
            out[name] = {"parser": type(get_tool_parser(name)).__name__, "content": read.content,
                         "calls": [[c.name, c.arguments, c.error] for c in read.calls]}
        for name, (text, *_) in BRIDGED_REASONING.items():
            parser = get_reasoning_parser(name)
            out[f"reasoning:{name}"] = {"parser": type(parser).__name__, "start": parser.start,  # type: ignore[union-attr]
                                        "split": list(parser.split(text, False))}  # type: ignore[union-attr]
        return out
    except Exception as exc:  # the test reports it
        return {"raised": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
