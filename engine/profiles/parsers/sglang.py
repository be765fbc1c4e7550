"""SGLang's own detectors, for a `--tool-call-parser` name the engine does not read natively.

Imported lazily: SGLang is in every slime image, but not a dependency of the engine.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from engine.profiles.base import ToolCall
from engine.profiles.parsers.base import ParsedTurn, Schemas, json_call, malformed


@functools.lru_cache(maxsize=1)
def sglang_parser_names() -> tuple[str, ...]:
    """SGLang's parser names, () when SGLang cannot be imported."""
    try:
        from sglang.srt.function_call.function_call_parser import FunctionCallParser
    except Exception:  # not installed, or its import chain fails: no SGLang names
        return ()
    return tuple(sorted(FunctionCallParser.ToolCallParserEnum))


class SGLangDetectorParser:
    """A parser that asks SGLang's detector. Its calls are as SGLang reads them (unknown tools dropped)."""


    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, schemas: Schemas) -> ParsedTurn:
        from sglang.srt.entrypoints.openai.protocol import Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        tools = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}}) for n, p in schemas.items()]
        try:
            parser = FunctionCallParser(tools, self.name)
            if not parser.has_tool_call(text):
                return ParsedTurn(text.strip())
            content, items = parser.parse_non_stream(text)
        except Exception as exc:  # the detector's bug is the model's error observation, not a crash
            return ParsedTurn(text.strip(), (malformed(f"the {self.name} detector failed: {type(exc).__name__}: {exc}"),))
        calls: list[ToolCall] = []
        for item in items:
            try:
                arguments: Any = json.loads(item.parameters or "{}")
            except ValueError as exc:
                calls.append(malformed(f"the arguments of {item.name} are not valid JSON: {exc}", item.name or ""))
                continue
            calls.append(json_call(item.name, arguments))
        if not calls:  # SGLang saw a call and lost it: tell the model rather than take it as an answer
            calls.append(malformed(f"the {self.name} tool call could not be read"))
        return ParsedTurn((content or "").strip(), tuple(calls))
