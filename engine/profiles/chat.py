"""The `chat` profile: the tokenizer's own chat template; tool calls in the format `engine_tool_parser` names.

Calls are read by the parser of that SGLang name (`engine.profiles.parsers`; default: the one
the chat template's markup names, else hermes). A call inside `<think>...</think>` is not
run. A turn without a call is the final answer; one that holds a call in another family's
format is an answer too, but marked (`Turn.foreign`) so runs count it.

The prompt is `apply_chat_template(messages, tools=..., add_generation_prompt=True)`.
After a model turn, only the appended delta is tokenized: the template's glue around the
tool messages (closing the turn, the tool responses, opening the next assistant turn),
never the model's own tokens, which stay exactly the server's. The glue tokens get mask 0.

The delta is learnt from the template itself, by rendering a conversation around a
sentinel assistant turn, so any template that renders tool messages works. Whether the
incremental token stream equals a full render is checked once per tokenizer
(`template_drift`) and reported: Qwen3's template, for one, rewrites past turns that
hold `<think>` blocks.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from engine import tools
from engine.profiles import parsers
from engine.profiles.base import CallResult, ToolCall, Turn
from engine.profiles.retool import ANSWER_RE, parse_tool_call_json
from engine.profiles.tokenizer import Codec

log = logging.getLogger(__name__)
_SENTINEL = "@@assistant-turn-sentinel@@"
_USER_SLOT = "@@user-turn-slot@@"
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes_turn(text: str) -> Turn:
    """Every `<tool_call>{json}</tool_call>` of the turn; a turn with none is the final answer."""
    calls = tuple(parse_tool_call_json(body) for body in _TOOL_CALL_RE.findall(text))
    if "<tool_call>" in text and not calls:  # opened, never closed
        calls = (ToolCall("", error="malformed_call", detail="<tool_call> is not closed by </tool_call>"),)
    if calls:
        return Turn("tool", calls=calls)
    answer = ANSWER_RE.search(text)
    return Turn("answer", answer=answer.group(1).strip() if answer else None)


class ChatProfile:
    """Prompts and tool responses rendered by the tokenizer's chat template."""

    name = "chat"
    withheld_tools = ()  # every registered tool is offered
    renders_sample_schemas = True  # a dataset's own tool schemas (slime's --tool-key) are shown as given

    def __init__(self, tokenizer: Any, tool_parser: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the chat profile needs a tokenizer with a chat template")
        self.tool_parser = tool_parser or parsers.default_tool_parser(tokenizer)
        self.parser = parsers.get_tool_parser(self.tool_parser)  # an unknown name: ValueError listing the known
        self.tokenizer = tokenizer
        self.codec = Codec(tokenizer)
        self.eos = tokenizer.eos_token
        self.eos_id = tokenizer.convert_tokens_to_ids(self.eos)
        # The token that ends an assistant turn followed by tool results, as the template writes it
        # (Qwen: <|im_end|>, GLM: <|observation|>, DeepSeek: its EOS); a model that emitted it keeps it.
        self.closer = self._closer()
        self.closer_id = tokenizer.convert_tokens_to_ids(self.closer) if self.closer else None
        self.drift = template_drift(self)
        if self.drift is not None:
            log.warning("chat template drift for this tokenizer: %s", self.drift)

    def render_prompt(self, prompt: Any, tools: list[dict[str, Any]]) -> list[int]:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def parse_turn(self, text: str) -> Turn:
        """The turn's calls in the configured format; none: the answer (marked if another format's call is there)."""
        _, acting = parsers.split_reasoning(text) if self.parser.reasoning else ("", text)
        schemas = registered_schemas()
        parsed = self.parser.parse(acting, schemas)
        if parsed.calls:
            return Turn("tool", calls=parsed.calls)
        answer = ANSWER_RE.search(text)
        foreign = parsers.foreign_format(acting, self.tool_parser, schemas)
        return Turn("answer", answer=answer.group(1).strip() if answer else None, foreign=foreign)

    def observation_ids(self, turn: Turn, results: list[CallResult], last_token: int | None = None) -> list[int]:
        """The template's tokens between this turn and the next assistant turn."""
        contents = [r.text for r in results] or ["Error: the turn had no usable tool call"]
        # The template's glue keeps its special tokens; what the tools printed is plain text
        # (a printed <|im_end|> must not close the turn): each special-token string inside a
        # tool's text is stood in for by a placeholder the template leaves alone.
        nonce = uuid.uuid4().hex[:12]
        found: list[str] = []

        def hold(match: re.Match[str]) -> str:
            found.append(match.group())
            return f"\ue000{nonce}:{len(found) - 1}\ue001"

        specials = self.codec.special_pattern
        held = [specials.sub(hold, c) for c in contents] if specials is not None else contents
        delta = self.tool_delta(held)
        closed = last_token is None or last_token == self.closer_id
        text = delta[len(self.closer):] if closed and self.closer else delta
        if not found:
            return self.encode(text)
        ids: list[int] = []
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
        for i, part in enumerate(parts):
            ids += self.encode(part) if i % 2 == 0 else self.codec.encode_plain(found[int(part)])
        return ids

    def _closer(self) -> str | None:
        """The special token the template puts right after an assistant turn's text, before tool results."""
        specials = self.codec.special_pattern
        delta = self.tool_delta(["x"])
        match = specials.match(delta) if specials is not None else None
        return match.group() if match else None

    def tool_delta(self, contents: list[str]) -> str:
        """Text the template puts after an assistant turn's text for these tool messages, its closing token included."""
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _SENTINEL},
            *({"role": "tool", "content": c} for c in contents),
        ]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return full[full.index(_SENTINEL) + len(_SENTINEL):]

    def user_turn_ids(self, text: str, last_token: int | None = None) -> list[int]:
        """An environment's reply as the next user turn (mask 0): the template's tokens from the end
        of this assistant turn to the start of the next, around one user message. The reply is
        plain text (a special token in it stays text); the template's markup keeps its specials."""
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _SENTINEL},
            {"role": "user", "content": _USER_SLOT},
        ]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, after = full[full.index(_SENTINEL) + len(_SENTINEL):].split(_USER_SLOT, 1)
        head = self.encode(before)
        if head and last_token == head[0]:  # the model closed its turn itself; a stop string did not
            head = head[1:]
        return head + self.codec.encode_plain(text) + self.encode(after)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)


def registered_schemas() -> dict[str, Any]:
    """Tool name -> the registered tool's `parameters` schema (what parsers type arguments by);
    rebuilt only when the registry changes."""
    version = tools.registry.version()
    if _SCHEMAS[0] != version:
        found: dict[str, Any] = {}
        for name in tools.names():
            try:
                found[name] = tools.get(name).schema()["function"]["parameters"]  # type: ignore[union-attr]
            except Exception:  # a tool whose schema() fails: its arguments stay as written
                found[name] = {}
        _SCHEMAS[:] = [version, found]
    return _SCHEMAS[1]


_SCHEMAS: list[Any] = [None, {}]


def incremental_ids(profile: ChatProfile, messages: list[dict[str, Any]], turns: list[tuple[str, list[str]]]) -> list[int]:
    """Token ids as the engine builds them: prompt, then each model turn and its tool delta."""
    ids = profile.render_prompt(messages, [])
    for assistant_text, tool_texts in turns:
        ids += profile.encode(assistant_text) + [profile.closer_id if profile.closer_id is not None else profile.eos_id]
        results = [CallResult(ToolCall("t"), t) for t in tool_texts]
        ids += profile.observation_ids(Turn("tool"), results)
    return ids


def full_render_ids(profile: ChatProfile, messages: list[dict[str, Any]], turns: list[tuple[str, list[str]]]) -> list[int]:
    """The same conversation rendered whole by the template, ready for the next turn."""
    convo = list(messages)
    for assistant_text, tool_texts in turns:
        convo.append({"role": "assistant", "content": assistant_text})
        convo += [{"role": "tool", "content": t} for t in tool_texts]
    text = profile.tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    return profile.encode(text)


def template_drift(profile: ChatProfile) -> str | None:
    """None when delta tokenization equals a full render on a canned two-call conversation.

    Otherwise a sentence naming the first token where they part, so a user sees at
    start-up that this template rewrites history (the engine's ids stay the server's).
    """
    call = json.dumps({"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}})
    messages = [{"role": "user", "content": "What is 6 * 7? Use the tool."}]
    prompt = profile.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    opened = prompt.rstrip().endswith("<think>")  # Qwen3.5, GLM-4.7: the prompt opens the reasoning
    think = "" if opened else "<think>\n"
    turns = [
        (f"{think}I should use the tool.\n</think>\n\nLet me check.\n<tool_call>\n{call}\n</tool_call>", ["42"]),
        (f"<tool_call>\n{call}\n</tool_call>", ["42", "again"]),
    ]
    ours, theirs = incremental_ids(profile, messages, turns), full_render_ids(profile, messages, turns)
    if ours == theirs:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (
        f"token {at}: incremental {profile.decode(ours[at:at + 8])!r} vs full render {profile.decode(theirs[at:at + 8])!r}"
    )
