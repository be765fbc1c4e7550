"""Reasoning formats by SGLang's `--reasoning-parser` names: where a model turn's reasoning ends.

A reasoning parser splits a turn into (reasoning, the rest) before the tool-call parser reads the
rest, as SGLang serves a turn: a call written inside the reasoning is reasoning, not a call.
Each native reader finds the end as SGLang's reasoning parser of that name does:

- the turn reasons from its start when thinking is *forced*: the chat template's generation
  prompt opened the reasoning tag (Qwen3.5 `<think>\\n`, GLM-4.7 `<think>`, DeepSeek-V3.1 with
  thinking), or the format always reasons (`deepseek-r1`, `qwen3-thinking`, `minimax`); else
  only when the turn writes the opening tag itself;
- reasoning ends at the first closing tag; with none, at the format's tool-call token where it
  has one (a call may interrupt reasoning left open: Qwen, GLM, Kimi K2), else the turn is all
  reasoning;
- gpt-oss reasons in harmony's analysis channel.

Any other SGLang name is read through SGLang's own parser where `sglang` is importable;
`register_reasoning_parser` plugs in a format of one's own; `none` reads no reasoning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import attrs

from engine.profiles.parsers.registry import ParserRegistry

log = logging.getLogger(__name__)
NONE = "none"


class ReasoningParser(Protocol):
    """One family's reasoning format, under an SGLang `--reasoning-parser` name."""

    name: str
    start: str  # the opening tag: a generation prompt that ends with it forces the turn to reason

    def split(self, text: str, forced: bool) -> tuple[str, str]:
        """(reasoning, the rest) of one model turn; `forced`: the prompt opened the reasoning."""
        ...


@attrs.frozen
class TaggedReasoning:
    """Reasoning between two tags, as SGLang's base reasoning detector reads it."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    tool_start: str | None = None  # a token that ends reasoning left open (the family's tool-call token)
    always: bool = False  # reasons whatever the prompt (its opening tag is never written)
    label: str = ""  # what follows the opening tag and is not reasoning (Gemma 4's "thought\n")

    def split(self, text: str, forced: bool) -> tuple[str, str]:
        if not (forced or self.always or self.start in text):
            return "", text
        head = self.start + self.label
        while text.startswith(head):
            text = text[len(head):]
        at = text.find(self.end)
        if at >= 0:
            return text[:at], text[at + len(self.end):]
        at = text.find(self.tool_start) if self.tool_start else -1
        if at >= 0:  # a call ends the reasoning the model left open; the call is the rest
            return text[:at], text[at:]
        return text, ""  # cut before its end: all reasoning


@attrs.frozen
class HarmonyReasoning:
    """gpt-oss: the analysis channel's messages are the reasoning; every other message is the rest,
    markup and all (the tool parser reads the channels). A message to a recipient is never reasoning."""

    name: str = "gpt-oss"
    start: str = "<|channel|>analysis<|message|>"

    def split(self, text: str, forced: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        rest: list[str] = []
        for chunk in _HARMONY_START.split(text):
            header, sep, body = chunk.partition("<|message|>")
            channel = _CHANNEL.search(header)
            if sep and channel is not None and channel.group(1) == "analysis" and "to=" not in header:
                reasoning.append(_HARMONY_END.split(body, 1)[0])
            else:
                rest.append(chunk)
        return "".join(reasoning), "".join(rest)


_HARMONY_START = re.compile(r"(?=<\|start\|>)")
_HARMONY_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


@attrs.frozen
class OpenedReasoning:
    """`minimax-append-think`: no split; the turn is the rest with the prompt's opening tag put back."""

    name: str = "minimax-append-think"
    start: str = "<think>"

    def split(self, text: str, forced: bool) -> tuple[str, str]:
        return "", self.start + text


class SGLangReasoning:
    """SGLang's own reasoning parser of a name the engine does not read natively."""

    def __init__(self, name: str) -> None:
        self.name = name
        # its opening tag, so a generation prompt that ends with it forces the turn (MiniMax-M3's <mm:think>)
        self.start = getattr(self._parser(False).detector, "think_start_token", "") or ""

    def _parser(self, forced: bool) -> Any:
        from sglang.srt.parser.reasoning_parser import ReasoningParser as SGLangParser

        return SGLangParser(self.name, stream_reasoning=False, force_reasoning=forced)

    def split(self, text: str, forced: bool) -> tuple[str, str]:
        reasoning, rest = self._parser(forced).parse_non_stream(text)
        return reasoning or "", rest or ""


_QWEN = {"tool_start": "<tool_call>"}
_NATIVE: dict[str, Callable[[], ReasoningParser]] = {
    **{n: partial(TaggedReasoning, n, **_QWEN) for n in (
        "qwen3", "deepseek-v3", "glm45", "nanbeige", "interns1", "dots", "mimo", "poolside_v1", "nemotron_3")},
    **{n: partial(TaggedReasoning, n, always=True, **_QWEN) for n in ("qwen3-thinking", "minimax")},
    **{n: partial(TaggedReasoning, n, always=True) for n in ("deepseek-r1", "step3", "step3p5", "gigachat35")},
    **{n: partial(TaggedReasoning, n) for n in ("deepseek-v4", "deepseek-v41")},
    "kimi": partial(TaggedReasoning, "kimi", start="◁think▷", end="◁/think▷"),
    "kimi_k2": partial(TaggedReasoning, "kimi_k2", tool_start="<|tool_calls_section_begin|>"),
    "mistral": partial(TaggedReasoning, "mistral", start="[THINK]", end="[/THINK]"),
    "gemma4": partial(TaggedReasoning, "gemma4", start="<|channel>", end="<channel|>", label="thought\n"),
    "gpt-oss": HarmonyReasoning,
    "minimax-append-think": OpenedReasoning,
}


def sglang_reasoning_names() -> tuple[str, ...]:
    """SGLang's reasoning parser names, () when SGLang cannot be imported."""
    try:
        from sglang.srt.parser.reasoning_parser import ReasoningParser as SGLangParser
    except Exception:  # not installed, or its import chain fails: no SGLang names
        return ()
    return tuple(sorted(SGLangParser.DetectorMap))


_REASONING_PARSERS: ParserRegistry[ReasoningParser] = ParserRegistry(
    "reasoning parser", _NATIVE, sglang_reasoning_names, SGLangReasoning, reserved=(NONE,))


def register_reasoning_parser(name: str, parser: ReasoningParser | str, *, replace: bool = False) -> None:
    """Make `engine_reasoning_parser: name` split turns with `parser` (an object with `split(text, forced)`,
    or "module:attr" naming one, imported on first use)."""
    _REASONING_PARSERS.register(name, parser, replace=replace)


def native_reasoning_names() -> tuple[str, ...]:
    """The names read by the engine itself (SGLang not needed), `none` included, sorted."""
    return _REASONING_PARSERS.native_names()


def reasoning_parser_names() -> tuple[str, ...]:
    """Every name `engine_reasoning_parser` accepts here."""
    return _REASONING_PARSERS.names()


def get_reasoning_parser(name: str) -> ReasoningParser | None:
    """The reasoning parser registered as `name` (None for `none`); ValueError (one line listing the
    known names) otherwise."""
    return None if name == NONE else _REASONING_PARSERS.get(name)


def detect_reasoning_parser(template: str | None) -> str:
    """The reasoning parser a chat template's markup names, as SGLang's template detection names
    it for the families the engine reads; `none` when the template shows no reasoning."""
    if not template:
        return NONE
    if "<|channel|>" in template:
        return "gpt-oss"
    if "◁think▷" in template:
        return "kimi"
    if "[THINK]" in template:
        return "mistral"
    if "<|tool_calls_section_begin|>" in template:
        return "kimi_k2"
    if "<minimax:tool_call>" in template:
        return "minimax"
    if "<think>" not in template and "</think>" not in template:
        return NONE
    if "<arg_key>" in template:
        return "glm45"
    if "enable_thinking" in template:  # Qwen3, Qwen3.5: thinking switched by enable_thinking
        return "qwen3"
    if "<｜Assistant｜>" in template and re.search(r"\bthinking\b", template):
        return "deepseek-v3"  # DeepSeek-V3.1: switched by `thinking`, off unless asked
    return "deepseek-r1"  # R1, QwQ, and any other template with think tags: it always reasons


def default_reasoning_parser(tokenizer: Any) -> str:
    """The reasoning parser for `tokenizer`'s chat template (`none` when it shows no reasoning); logged once."""
    template = getattr(tokenizer, "chat_template", None)
    name = detect_reasoning_parser(template if isinstance(template, str) else None)
    line = f"reasoning parser {name} (from the chat template); set engine_reasoning_parser to choose"
    if line not in _LOGGED:
        _LOGGED.add(line)
        log.info(line)
    return name


_LOGGED: set[str] = set()


def opens_reasoning(prompt: str, parser: ReasoningParser | None) -> bool:
    """Whether a generation prompt forces the next turn to reason: it ends with the opening tag
    (whitespace aside), or the format always reasons."""
    if parser is None:
        return False
    if getattr(parser, "always", False):
        return True
    start = getattr(parser, "start", "")
    return bool(start) and prompt.rstrip().endswith(start.rstrip())
