"""Tool-call and reasoning formats by SGLang's names: which text of a turn is reasoning, which a call, and its arguments.

Membership: code that reads one model turn's text into reasoning, content and calls, one family
per module. A turn is split by the reasoning parser (`--reasoning-parser` names, `reasoning`),
then the rest is read by the tool-call parser (`--tool-call-parser` names), as SGLang serves it.
Parsers plug in by registration, as tools and profiles do:
`register_tool_parser("mine", MyParser())` (or "module:attr", imported on first use) in a
module named in `engine_tool_modules`, then `engine_tool_parser: mine`; likewise
`register_reasoning_parser`. Any other SGLang name works through SGLang's own parser where
SGLang is importable.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from engine.logs import log_once
from engine.profiles.base import TurnReading
from engine.profiles.parsers.base import ParsedTurn, Schemas, ToolParser
from engine.profiles.parsers.harmony import HarmonyParser
from engine.profiles.parsers.json_calls import DeepSeekParser, HermesParser, KimiK2Parser, Llama3Parser, MistralParser
from engine.profiles.parsers.pythonic import PythonicParser
from engine.profiles.parsers.registry import ParserRegistry
from engine.profiles.parsers.reasoning import (
    NONE, ReasoningParser, default_reasoning_parser, detect_reasoning_parser, get_reasoning_parser, opens_reasoning,
    reasoning_parser_names, register_reasoning_parser,
)
from engine.profiles.parsers.sglang import SGLangDetectorParser, sglang_parser_names
from engine.profiles.parsers.tagged import GlmParser, MiniMaxM2Parser, Qwen3CoderParser

log = logging.getLogger(__name__)
DEFAULT = "hermes"

_NATIVE: dict[str, Callable[[], ToolParser]] = {
    "hermes": lambda: HermesParser("hermes"),
    "qwen25": lambda: HermesParser("qwen25"),
    "qwen": lambda: HermesParser("qwen"),
    "qwen3_coder": lambda: Qwen3CoderParser("qwen3_coder"),
    "step3p5": lambda: Qwen3CoderParser("step3p5"),
    "nanbeige": lambda: Qwen3CoderParser("nanbeige"),
    "glm45": lambda: GlmParser("glm45"),
    "glm": lambda: GlmParser("glm"),
    "glm47": lambda: GlmParser("glm47"),
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "deepseekv3": lambda: DeepSeekParser("deepseekv3", v31=False),
    "deepseekv31": lambda: DeepSeekParser("deepseekv31", v31=True),
    "kimi_k2": KimiK2Parser,
    "gpt-oss": HarmonyParser,
    "minimax-m2": MiniMaxM2Parser,
}
_TOOL_PARSERS: ParserRegistry[ToolParser] = ParserRegistry("tool parser", _NATIVE, sglang_parser_names, SGLangDetectorParser)


def register_tool_parser(name: str, parser: ToolParser | str, *, replace: bool = False) -> None:
    """Make `engine_tool_parser: name` read turns with `parser` (an object with `parse(text, schemas)`,
    or "module:attr" naming one, imported on first use)."""
    _TOOL_PARSERS.register(name, parser, replace=replace)


def native_parser_names() -> tuple[str, ...]:
    """The names read by the engine itself (SGLang not needed), sorted."""
    return _TOOL_PARSERS.native_names()


def tool_parser_names() -> tuple[str, ...]:
    """Every name `engine_tool_parser` accepts here: native, registered, and SGLang's where importable."""
    return _TOOL_PARSERS.names()


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError (one line listing the known names) otherwise."""
    return _TOOL_PARSERS.get(name)


# Markers of each family in a chat template, most specific first: the first found names the parser.
_TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("<minimax:tool_call>", "minimax-m2"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<|constrain|>", "gpt-oss"),
    ("<function=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
)


def detect_tool_parser(template: str | None) -> str | None:
    """The parser a chat template's tool-call markup names, or None when it is not clear."""
    if not template:
        return None
    for marker, name in _TEMPLATE_MARKERS:
        if marker in template:
            return name
    if "<arg_key>" in template:
        # GLM-4.7 and later write the name and the first key back to back; 4.5/4.6 put a newline
        # between, as their templates' instructions show ("<tool_call>{function-name}\n<arg_key>")
        if "{function-name}<arg_key>" in template:
            return "glm47"
        if "{function-name}\n<arg_key>" in template or re.search(r"<tool_call>'\s*\+\s*[\w.]+\s*}}\s*\n", template):
            return "glm45"
        return "glm47" if re.search(r"<tool_call>'\s*\+\s*[\w.]+\s*-?}}\s*(?:{%[^%]*%})?\s*<arg_key>", template) else "glm45"
    if "<｜tool▁calls▁begin｜>" in template:
        return "deepseekv3" if "```json" in template else "deepseekv31"
    if "<tool_call>" in template:
        return "qwen" if "<|im_start|>" in template else "hermes"
    return None


def default_tool_parser(tokenizer: Any) -> str:
    """The parser for `tokenizer`'s chat template, else hermes; the choice is logged once."""
    template = getattr(tokenizer, "chat_template", None)
    found = detect_tool_parser(template if isinstance(template, str) else None)
    name = found or DEFAULT
    how = "from the chat template" if found else "the default: the chat template names no known format"
    log_once(f"tool parser {name} ({how}); set engine_tool_parser to choose", logging.INFO, log)
    return name


def _family(parser: ToolParser) -> tuple[str, Any]:
    """Parsers of one family read the same text (hermes and qwen25, glm45 and glm47)."""
    return type(parser).__name__, getattr(parser, "v31", None)


def read_turn(text: str, tool_parser: ToolParser, reasoning: ReasoningParser | None, schemas: Schemas, *,
              forced: bool = False) -> TurnReading:
    """One model turn as SGLang serves it: the reasoning split off (`forced`: the prompt opened it),
    then calls and content read from the rest."""
    thought, rest = reasoning.split(text, forced) if reasoning is not None else ("", text)
    parsed = tool_parser.parse(rest, schemas)
    return TurnReading(thought, parsed.content, parsed.calls)


def foreign_format(text: str, configured: str, schemas: Schemas, *, offered: bool = False) -> str | None:
    """The native family whose well-formed call `text` holds, when the configured parser read none.

    Such a turn is read as text (the answer), as configured; this names it so runs can count it.
    `offered`: only a reading whose calls all name tools in `schemas` counts (the stronger evidence
    asked before a block the configured parser found malformed is taken for another family's).
    """
    mine = _family(get_tool_parser(configured))
    for name in ("hermes", "qwen3_coder", "glm47", "minimax-m2", "deepseekv3", "deepseekv31", "kimi_k2", "gpt-oss",
                 "mistral", "llama3", "pythonic"):
        parser = get_tool_parser(name)
        if _family(parser) == mine:
            continue
        try:
            parsed = parser.parse(text, schemas)
        except Exception:
            continue
        if parsed.calls and all(c.error is None and (not offered or c.name in schemas) for c in parsed.calls):
            return name
    return None


__all__ = [
    "DEFAULT", "NONE", "ParsedTurn", "ReasoningParser", "Schemas", "ToolParser", "default_reasoning_parser",
    "default_tool_parser", "detect_reasoning_parser", "detect_tool_parser", "foreign_format", "get_reasoning_parser",
    "get_tool_parser", "native_parser_names", "opens_reasoning", "read_turn", "reasoning_parser_names", "register_reasoning_parser",
    "register_tool_parser", "tool_parser_names",
]
