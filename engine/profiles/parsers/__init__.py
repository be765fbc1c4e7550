"""Tool-call formats by SGLang's `--tool-call-parser` names: which text is a call, and its arguments.

Membership: code that reads one model turn's text into content and calls, one family per module.
Parsers plug in by registration, as tools and profiles do:
`register_tool_parser("mine", MyParser())` (or "module:attr", imported on first use) in a
module named in `engine_tool_modules`, then `engine_tool_parser: mine`. Any other SGLang name
works through SGLang's own detector where SGLang is importable.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from typing import Any

from engine.logs import log_once
from engine.profiles.parsers.base import ParsedTurn, Schemas, ToolParser
from engine.profiles.parsers.harmony import HarmonyParser
from engine.profiles.parsers.json_calls import DeepSeekParser, HermesParser, KimiK2Parser, Llama3Parser, MistralParser
from engine.profiles.parsers.pythonic import PythonicParser
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
_REGISTERED: dict[str, ToolParser | str] = {}
_BUILT: dict[str, ToolParser] = {}


def register_tool_parser(name: str, parser: ToolParser | str, *, replace: bool = False) -> None:
    """Make `engine_tool_parser: name` read turns with `parser` (an object with `parse(text, schemas)`,
    or "module:attr" naming one, imported on first use)."""
    if (name in _REGISTERED or name in _NATIVE) and not replace:
        raise ValueError(f"a tool parser named {name!r} is already registered")
    _REGISTERED[name] = parser
    _BUILT.pop(name, None)


def native_parser_names() -> tuple[str, ...]:
    """The names read by the engine itself (SGLang not needed), sorted."""
    return tuple(sorted(set(_NATIVE) | set(_REGISTERED)))


def tool_parser_names() -> tuple[str, ...]:
    """Every name `engine_tool_parser` accepts here: native, registered, and SGLang's where importable."""
    return tuple(sorted(set(native_parser_names()) | set(sglang_parser_names())))


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError (one line listing the known names) otherwise."""
    parser = _BUILT.get(name)
    if parser is not None:
        return parser
    if name in _REGISTERED:
        entry = _REGISTERED[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            entry = entry() if isinstance(entry, type) else entry
        parser = entry
    elif name in _NATIVE:
        parser = _NATIVE[name]()
    elif name in sglang_parser_names():
        parser = SGLangDetectorParser(name)
    else:
        more = "" if sglang_parser_names() else " (SGLang's other names need sglang importable)"
        raise ValueError(f"unknown tool parser {name!r}: known are {', '.join(tool_parser_names())}{more}")
    _BUILT[name] = parser
    return parser


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


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, the rest): `<think>...</think>` blocks (the opening tag may be in the prompt),
    and a block still open at the end of the turn. A call written there is not run."""
    reasoning = ""
    at = text.rfind(_THINK_CLOSE)
    if at >= 0:
        reasoning, text = text[: at + len(_THINK_CLOSE)], text[at + len(_THINK_CLOSE):]
    opened = text.find(_THINK_OPEN)
    if opened >= 0:
        reasoning, text = reasoning + text[opened:], text[:opened]
    return reasoning, text


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
    "DEFAULT", "ParsedTurn", "Schemas", "ToolParser", "default_tool_parser", "detect_tool_parser", "foreign_format",
    "get_tool_parser", "native_parser_names", "register_tool_parser", "split_reasoning", "tool_parser_names",
]
