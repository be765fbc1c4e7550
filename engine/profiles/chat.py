"""The `chat` profile: the tokenizer's own chat template; reasoning and tool calls in the formats
`engine_reasoning_parser` and `engine_tool_parser` name.

A turn is read as SGLang serves it (`read_turn`): the reasoning parser of that SGLang name
splits off the reasoning (thinking is forced where the template's generation prompt opens it),
then the tool-call parser reads the rest (`engine.profiles.parsers`; defaults: the ones the
chat template's markup names, else no reasoning and hermes). A call inside the reasoning is not
run. A turn without a call is the final answer; one that holds a call in another family's
format is an answer too, but marked (`Turn.foreign`) so runs count it, even where that call
shares the configured family's tags (a GLM body in hermes's `<tool_call>`): a block the
configured parser cannot read but another family reads whole is that family's call.

The prompt is `apply_chat_template(messages, tools=..., add_generation_prompt=True)`, with the
template kwargs the settings give (`apply_chat_template_kwargs`, slime's own: `enable_thinking`,
...) in every render, the glue learnt below included, as the server renders a chat request.
After a model turn, only the appended delta is tokenized: the template's glue around the
tool messages (closing the turn, the tool responses, opening the next assistant turn),
never the model's own tokens, which stay exactly the server's. The glue tokens get mask 0.

The delta is learnt from the template itself: it renders an assistant turn with a tool
call, once alone and once followed by tool messages; what the second adds after the
turn's text is the glue, so any template that renders tool messages works (MiniMax's
refuses tool messages after a turn without calls). A template that shows a result's call
(Mistral's call id) gets the model's calls in that turn, rendered per observation. Whether the
incremental token stream
equals a full render is checked once per tokenizer (`template_drift`) on a conversation
in the template's own rendering of each family's calls, and reported when it does not:
such a template rewrites past turns (drops their reasoning, say).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any, Literal

from engine import tools
from engine.logs import warn_once
from engine.profiles import parsers
from engine.profiles.base import CallResult, ToolCall, Turn, TurnReading
from engine.profiles.retool import ANSWER_RE, parse_tool_call_json
from engine.profiles.tokenizer import Codec
from engine.settings.core import check_template_kwargs

log = logging.getLogger(__name__)
_SENTINEL = "@@assistant-turn-sentinel@@"
_USER_SLOT = "@@user-turn-slot@@"
_RESULT_SLOT = "@@tool-result-slot@@"
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

    def __init__(self, tokenizer: Any, tool_parser: str | None = None, reasoning_parser: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the chat profile needs a tokenizer with a chat template")
        # What the template is rendered with besides the messages (enable_thinking, ...), as the
        # server renders a chat request and slime its dataset (--apply-chat-template-kwargs).
        self.template_kwargs = check_template_kwargs(template_kwargs or {})
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser or parsers.default_tool_parser(tokenizer)
        self.parser = parsers.get_tool_parser(self.tool_parser)  # an unknown name: ValueError listing the known
        self.reasoning_parser = reasoning_parser or parsers.default_reasoning_parser(tokenizer)
        self.reasoning = parsers.get_reasoning_parser(self.reasoning_parser)  # None for "none"
        # Whether every turn starts inside the reasoning: the template's generation prompt opens it
        # (Qwen3.5, GLM-4.7, DeepSeek-V3.1 with thinking), as SGLang forces thinking for such a request.
        try:
            prompt = self.render([_PROBE_USER], add_generation_prompt=True)
        except Exception:  # a template that cannot render a lone user message: the glue below says so
            prompt = ""
        self.thinking_forced = parsers.opens_reasoning(prompt, self.reasoning)
        # Thinking switched off (enable_thinking: false): the generation prompt closes an empty
        # reasoning, so the model's turns hold none; the template checks below write theirs so.
        end = getattr(self.reasoning, "end", None)
        self.thinking_off = bool(end) and prompt.rstrip().endswith(end.rstrip())
        self.codec = Codec(tokenizer)
        self._glue: tuple[dict[str, Any], str, Form] | None = None  # the turn tool_delta renders, its text from the sentinel on
        self._reasoning_rule: EarlierReasoning | None = None  # learnt on first use (`earlier_reasoning`)
        self._asking: dict[str, tuple[list[int], list[int]]] = {}  # `ask_after_results`, per question
        self._alike: dict[str, bool] = {}  # `renders_alike`, per request kwargs
        self.shows_calls = False  # whether the template shows a result's call (name, id): then the glue is per turn
        self.eos = tokenizer.eos_token
        self.eos_id = tokenizer.convert_tokens_to_ids(self.eos)
        # The token that ends an assistant turn followed by tool results, as the template writes it
        # (Qwen: <|im_end|>, GLM: <|observation|>, DeepSeek: its EOS); a model that emitted it keeps it.
        self.closer = self._closer()
        self.closer_id = tokenizer.convert_tokens_to_ids(self.closer) if self.closer else None
        # Every token that closes a turn with calls: the template's, and the family's others the vocabulary holds.
        self.closer_ids = frozenset({self.closer_id} if self.closer_id is not None else ()) | self._turn_end_ids()
        self.drift = template_drift(self)
        if self.drift is not None:  # once per process, not per profile
            warn_once(f"chat template check (parser {self.tool_parser}): {self.drift}", log)

    def render(self, messages: list[dict[str, Any]], **options: Any) -> str:
        """The chat template's text for `messages` (`tools`, `add_generation_prompt` in `options`),
        rendered with the profile's template kwargs: every render of the profile goes through here."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **options, **self.template_kwargs)

    def render_prompt(self, prompt: Any, tools: list[dict[str, Any]]) -> list[int]:
        text = self.render(prompt_messages(prompt), tools=tools or None, add_generation_prompt=True)
        return self.encode(text)

    def renders_alike(self, kwargs: dict[str, Any]) -> bool:
        """Whether template kwargs a request names itself (a chat request's `chat_template_kwargs`)
        render as this profile's do: a probe (a tool offered, an earlier answer with reasoning, the
        generation prompt) rendered with this profile's kwargs and with them overlaid by `kwargs`.
        ValueError for kwargs that are no template variables (`check_template_kwargs`)."""
        asked = {**self.template_kwargs, **check_template_kwargs(kwargs)}
        key = json.dumps(asked, sort_keys=True, default=repr)
        if key not in self._alike:
            options: dict[str, Any] = {"tools": [_PROBE_TOOL], "add_generation_prompt": True}
            mine = self.render(_PROBE_TALK, **options)
            theirs = self.tokenizer.apply_chat_template(_PROBE_TALK, tokenize=False, **options, **asked)
            if len(self._alike) >= 64:  # what harnesses send is a setting or two: a bound, not a cache policy
                self._alike.clear()
            self._alike[key] = theirs == mine
        return self._alike[key]

    def read_turn(self, text: str, *, forced: bool | None = None, schemas: dict[str, Any] | None = None) -> TurnReading:
        """One model turn as SGLang serves it: (reasoning, content, calls).

        The reasoning parser splits off the reasoning, the tool-call parser reads the calls and the
        content from the rest; a call that could not be read is a `ToolCall` with `error` set. The
        content ends without the special tokens that end the turn (its closing token, an EOS), as a
        server's chat API leaves them out. `forced`: whether the prompt opened the reasoning
        (default: as this template's generation prompt does); `schemas`: tool name -> `parameters`,
        what arguments are typed by (default: the registered tools'). The one reader of a turn for
        what renders it again: a front door's answer, the conversation of a long rollout.
        """
        reading = parsers.read_turn(text, self.parser, self.reasoning, registered_schemas() if schemas is None else schemas,
                                    forced=self.thinking_forced if forced is None else forced)
        return reading._replace(content=self.strip_turn_end(reading.content))

    def split_reasoning(self, text: str, forced: bool | None = None) -> tuple[str, str]:
        """(the reasoning, the rest) of a model turn, by this profile's reasoning parser (none: no reasoning)."""
        if self.reasoning is None:
            return "", text
        return self.reasoning.split(text, self.thinking_forced if forced is None else forced)

    def strip_turn_end(self, text: str) -> str:
        """`text` without the special tokens that end it (the turn's closing token, an EOS)."""
        tail = self.codec.special_tail
        return text if tail is None else tail.sub("", text)

    def parse_turn(self, text: str) -> Turn:
        """The turn's calls in the configured format; none: the answer (marked if another format's call is there)."""
        _, acting = self.split_reasoning(text)
        schemas = registered_schemas()
        parsed = self.parser.parse(acting, schemas)
        foreign = None
        if not parsed.calls or all(c.error == "malformed_call" for c in parsed.calls):
            # None read, or only blocks this format cannot read: another family's well-formed call
            # (GLM's `<tool_call>name<arg_key>...` under hermes) is that family's, not a broken one of ours.
            foreign = parsers.foreign_format(acting, self.tool_parser, schemas, offered=bool(parsed.calls))
        if parsed.calls and foreign is None:
            return Turn("tool", calls=parsed.calls)
        answer = ANSWER_RE.search(text)
        return Turn("answer", answer=answer.group(1).strip() if answer else None, foreign=foreign)

    def observation_ids(self, turn: Turn, results: list[CallResult], last_token: int | None = None) -> list[int]:
        """The template's tokens between this turn and the next assistant turn."""
        contents = result_contents(results)
        # The template's glue keeps its special tokens; what the tools printed is plain text
        # (a printed <|im_end|> must not close the turn): each special-token string inside a
        # tool's text is stood in for by a placeholder the template leaves alone.
        held = _Held(self.codec.special_pattern)
        delta = self.tool_delta([held.hold(c) for c in contents], [r.call for r in results])
        closed = last_token is None or last_token in self.closer_ids
        text = delta[len(self.closer):] if closed and self.closer else delta
        return held.encode(self, text)

    def follow_ids(self, messages: list[dict[str, Any]], last_token: int | None = None,
                   calls: list[ToolCall] | None = None) -> list[int]:
        """The template's tokens after a model turn for the messages appended to it (tool results,
        a user turn, a system reminder, any run of them), up to the next assistant turn's start.

        The model's turn is never rendered again: the messages follow a stand-in turn (one that
        makes a call when a tool message answers it, else plain text), and what the template
        writes after that turn's text is the delta, as `observation_ids` learns it. The tool
        messages answer `calls` (the turn's, by their ids) where the template shows a result's
        call, else the stand-in's. Contents are plain text (a special token in them stays text);
        the template's markup keeps its special tokens. A turn the model closed itself keeps
        its closing token, once. Raises what the template raises for messages it cannot render.
        """
        held = _Held(self.codec.special_pattern)
        sent = [dict(m, content=held.hold(m["content"])) if isinstance(m.get("content"), str) else dict(m) for m in messages]
        if any(m.get("role") == "tool" for m in sent):
            glue = self._learnt_glue()
            if calls and self.shows_calls:
                made = [(c.name or "tool", c.id or f"call{i:05d}", c.arguments if not c.error else {}) for i, c in enumerate(calls)]
                try:
                    glue = glue_turn(self, made, forms=(self._glue[2],))
                except ValueError:  # the template refuses the model's calls: the stand-in's
                    pass
            turn, tail, _ = glue
            made_calls = turn.get("tool_calls") or []
            ids = {c["id"] for c in made_calls}
            answered = 0
            for m in sent:
                if m.get("role") == "tool" and made_calls and m.get("tool_call_id") not in ids:
                    call = made_calls[min(answered, len(made_calls) - 1)]  # answers the stand-in's calls in order
                    m["tool_call_id"], m["name"] = call["id"], call["function"]["name"]
                if m.get("role") == "tool":
                    answered += 1
            full = self.render([_PROBE_USER, turn, *sent], add_generation_prompt=True)
            at = full.find(tail)
            if at < 0:
                raise ValueError("the chat template renders an assistant turn differently once these messages follow it")
            delta = full[at + len(tail):]
            closed = last_token is None or last_token in self.closer_ids
            if closed and self.closer and delta.startswith(self.closer):
                delta = delta[len(self.closer):]
            return held.encode(self, delta)
        turn = {"role": "assistant", "content": _SENTINEL}
        full = self.render([_PROBE_USER, turn, *sent], add_generation_prompt=True)
        at = full.find(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template does not show an assistant turn's text once these messages follow it")
        ids = held.encode(self, full[at + len(_SENTINEL):])
        if ids and last_token is not None and ids[0] == last_token:  # the model closed its turn itself
            ids = ids[1:]
        return ids

    def call_form(self) -> tuple[bool, bool, bool]:
        """How this template wants an assistant turn with calls: (arguments as JSON text, content
        None, calls shown at all); learnt from the template once."""
        return self._learnt_glue()[2]

    def _learnt_glue(self) -> tuple[dict[str, Any], str, Form]:
        """The stand-in turn tool results follow (learnt from the template on first use)."""
        if self._glue is None:
            self.tool_delta(["x"])
        assert self._glue is not None
        return self._glue

    def _turn_end_ids(self) -> frozenset[int]:
        """Ids of the parser's other turn-ending tokens (`turn_ends`) that are special tokens here."""
        specials = self.codec.special_pattern
        found = [t for t in getattr(self.parser, "turn_ends", ()) if specials is not None and specials.fullmatch(t)]
        return frozenset(self.tokenizer.convert_tokens_to_ids(found))

    def _closer(self) -> str | None:
        """The special token the template puts right after an assistant turn's text, before tool results."""
        specials = self.codec.special_pattern
        delta = self.tool_delta(["x"])
        match = specials.match(delta) if specials is not None else None
        return match.group() if match else None

    def tool_delta(self, contents: list[str], calls: list[ToolCall] | None = None) -> str:
        """Text the template puts after an assistant turn's text for these tool messages, its closing
        token included. The messages answer `calls` (their names and ids, where the format wrote
        ids) when the template shows those with a result (Mistral's call ids); else a stand-in."""
        if self._glue is None:
            self._glue = glue_turn(self, _PROBE_CALLS)
            self.shows_calls = self._delta(["x"], self._glue) != self._delta(["x"], glue_turn(self, _OTHER_CALLS))
        glue = self._glue
        if calls and self.shows_calls:  # two more renders per observation, only for such templates
            made = [(c.name or "tool", c.id or f"call{i:05d}", c.arguments if not c.error else {}) for i, c in enumerate(calls)]
            try:
                glue = glue_turn(self, made, forms=(self._glue[2],))
            except ValueError:  # the template refuses the model's calls (an id it finds malformed): the stand-in's
                glue = self._glue
        return self._delta(contents, glue)

    def _delta(self, contents: list[str], glue: tuple[dict[str, Any], str, Form]) -> str:
        turn, tail, _ = glue
        messages = [_PROBE_USER, turn, *tool_messages(turn, contents)]
        full = self.render(messages, add_generation_prompt=True)
        at = full.find(tail)
        if at < 0:
            raise ValueError("the chat template renders an assistant turn differently once tool messages follow it")
        return full[at + len(tail):]

    # -- the conversation rendered again (engine.profiles.history) -------------------------------
    def earlier_reasoning(self) -> EarlierReasoning:
        """What the template keeps of an earlier turn's reasoning when it renders the conversation
        again: "kept", "until_user" (until a user message follows the turn: Qwen3, Qwen3.5, GLM-4.7)
        or "dropped" (none but the turn it prompts for). Learnt from the template once, as the glue
        is: a probe turn's reasoning is looked for in its renders followed by a tool result, and by
        a user message."""
        if self._reasoning_rule is None:
            self._reasoning_rule = _reasoning_rule(self)
        return self._reasoning_rule

    def assistant_message(self, text: str) -> dict[str, Any]:
        """A model turn (its text as sampled) as this template's assistant message: what a server's
        chat API hands back for it (`read_turn`; a call that could not be read is left out), and
        renders again on the next call."""
        reading = self.read_turn(text)
        reasoning, content = reading.reasoning.strip(), reading.content.strip()
        calls = [c for c in reading.calls if not c.error]
        if not calls:
            return assistant_turn((False, False, False), reasoning, content, [])
        form = self.call_form()
        made = [(c.name, c.id or f"call{i:05d}", c.arguments) for i, c in enumerate(calls)]
        message = assistant_turn(form, reasoning, content, made)
        if form[1] and content:  # a template that wants no content beside calls still shows the model's
            message["content"] = content
        return message

    def render_messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        plain_from: int = 0) -> list[int]:
        """Ids of `messages` as the template renders them for the next assistant turn. From message
        `plain_from` on, what is not the model's (tool results, user turns) is plain text, as the
        engine appended it: a special token's string printed by a tool stays text."""
        held = _Held(self.codec.special_pattern)
        sent = [dict(m, content=held.hold(m["content"]))
                if i >= plain_from and m.get("role") != "assistant" and isinstance(m.get("content"), str) else m
                for i, m in enumerate(messages)]
        text = self.render(sent, tools=tools or None, add_generation_prompt=True)
        return held.encode(self, text)

    def ask_after_results(self, question: str) -> tuple[list[int], list[int]]:
        """How a user message joins a sequence that ends with tool results: (the template's
        generation prompt, which such a sequence ends with, to cut; the ids that replace it: the
        user message with `question` as plain text, then the generation prompt again). Learnt from
        what the template writes after a tool result, alone and with a user message following;
        ValueError for a template whose tool result reads otherwise once a user message follows it."""
        known = self._asking.get(question)
        if known is not None:
            return known
        self.tool_delta(["x"])
        assert self._glue is not None
        turn = self._glue[0]
        convo = [_PROBE_USER, turn, *tool_messages(turn, [_RESULT_SLOT])]
        render = self.render
        tails = [text[text.rindex(_RESULT_SLOT) + len(_RESULT_SLOT):] for text in (
            render(convo), render(convo, add_generation_prompt=True),
            render([*convo, {"role": "user", "content": _USER_SLOT}], add_generation_prompt=True))]
        closed, ready, asked = tails
        if not (ready.startswith(closed) and asked.startswith(closed) and _USER_SLOT in asked):
            raise ValueError("the chat template renders a tool result differently once a user message follows it")
        before, after = asked[len(closed):].split(_USER_SLOT, 1)
        found = self.encode(ready[len(closed):]), self.encode(before) + self.codec.encode_plain(question) + self.encode(after)
        if len(self._asking) < 8:
            self._asking[question] = found
        return found

    def user_turn_ids(self, text: str, last_token: int | None = None) -> list[int]:
        """An environment's reply as the next user turn (mask 0): the template's tokens from the end
        of this assistant turn to the start of the next, around one user message. The reply is
        plain text (a special token in it stays text); the template's markup keeps its specials."""
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _SENTINEL},
            {"role": "user", "content": _USER_SLOT},
        ]
        full = self.render(messages, add_generation_prompt=True)
        before, after = full[full.index(_SENTINEL) + len(_SENTINEL):].split(_USER_SLOT, 1)
        head = self.encode(before)
        if head and last_token == head[0]:  # the model closed its turn itself; a stop string did not
            head = head[1:]
        return head + self.codec.encode_plain(text) + self.encode(after)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids)


class _Held:
    """Special-token strings in message contents, stood in for by placeholders the template
    leaves alone, so the contents encode as plain text and the template's markup as its tokens."""

    def __init__(self, specials: re.Pattern[str] | None) -> None:
        self.specials = specials
        self.nonce = uuid.uuid4().hex[:12]
        self.found: list[str] = []

    def _stand_in(self, match: re.Match[str]) -> str:
        self.found.append(match.group())
        return f"\ue000{self.nonce}:{len(self.found) - 1}\ue001"

    def hold(self, text: str) -> str:
        """`text` with each special-token string replaced by its placeholder."""
        return self.specials.sub(self._stand_in, text) if self.specials is not None else text

    def encode(self, profile: ChatProfile, text: str) -> list[int]:
        """Ids of rendered `text`: the template's parts as encoded, the held strings as plain text."""
        if not self.found:
            return profile.encode(text)
        ids: list[int] = []
        for i, part in enumerate(re.split(f"\ue000{self.nonce}:(\\d+)\ue001", text)):
            ids += profile.encode(part) if i % 2 == 0 else profile.codec.encode_plain(self.found[int(part)])
        return ids


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
NO_USABLE_CALL = "Error: the turn had no usable tool call"
EarlierReasoning = Literal["kept", "until_user", "dropped"]
_REASONING_PROBE = "@@earlier-reasoning-probe@@"


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """A sample's prompt as chat messages: its own list, or its text as one user message."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def result_contents(results: list[CallResult]) -> list[str]:
    """What the tool messages after a turn hold: each answer's text (a note when the turn had no usable call)."""
    return [r.text for r in results] or [NO_USABLE_CALL]


def _reasoning_rule(profile: ChatProfile) -> EarlierReasoning:
    """Which earlier reasoning the template renders again (see `ChatProfile.earlier_reasoning`).
    A template that cannot render the probes is taken to keep it: nothing is rendered again."""
    try:
        profile.tool_delta(["x"])
        assert profile._glue is not None
        turn = assistant_turn(profile._glue[2], _REASONING_PROBE, "Let me check.", _PROBE_CALLS)
        after_tool = profile.render([_PROBE_USER, turn, *tool_messages(turn, ["42"])], add_generation_prompt=True)
        answer = {"role": "assistant", "content": "It is 42.", "reasoning_content": _REASONING_PROBE}
        after_user = profile.render(
            [_PROBE_USER, answer, {"role": "user", "content": "And 6 * 8?"}], add_generation_prompt=True)
    except Exception:
        return "kept"
    if _REASONING_PROBE not in after_tool:
        return "dropped"
    return "kept" if _REASONING_PROBE in after_user else "until_user"


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
    text = profile.render(convo, add_generation_prompt=True)
    return profile.encode(text)


_PROBE_USER = {"role": "user", "content": "What is 6 * 7? Use the tool."}
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "code_interpreter", "description": "Run Python code and return what it prints.",
                 "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}},
}
# `renders_alike`'s conversation: an earlier answer with its reasoning (which templates keep or drop
# by their thinking variables), then the question the generation prompt answers
_PROBE_TALK = [{"role": "user", "content": "Hi."},
               {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."}, _PROBE_USER]
# How templates want an assistant turn with calls, most usual first: arguments as an object or as
# JSON text (DeepSeek concatenates them), content given or None (DeepSeek-V3 renders calls only
# without content); last, content alone (a template that renders no `tool_calls`).
Form = tuple[bool, bool, bool]  # (arguments as text, content None, with calls)
_FORMS: tuple[Form, ...] = ((False, False, True), (True, False, True), (False, True, True), (True, True, True),
                            (False, False, False))
Call = tuple[str, str, Any]  # (name, id, arguments)
_PROBE_CALLS: list[Call] = [("code_interpreter", "call00000", {"code": "print(1)"})]  # 9 alphanumerics, as Mistral's ids
_OTHER_CALLS: list[Call] = [("other_tool", "call99999", {"code": "print(1)"})]


def code_calls(codes: list[str], first_id: int = 0) -> list[Call]:
    """code_interpreter calls of these codes, with ids."""
    return [("code_interpreter", f"call{first_id + i:05d}", {"code": c}) for i, c in enumerate(codes)]


def assistant_turn(form: Form, reasoning: str, content: str, calls: list[Call]) -> dict[str, Any]:
    """An assistant message making these calls, in one of `_FORMS`."""
    as_text, no_content, with_calls = form
    message: dict[str, Any] = {"role": "assistant", "content": None if no_content else content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if with_calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a) if as_text else a}}
            for n, i, a in calls
        ]
    return message


def tool_messages(turn: dict[str, Any], contents: list[str]) -> list[dict[str, Any]]:
    """One tool message per content, answering the turn's calls in order (its name and id; a
    surplus result, the last call's)."""
    calls = turn.get("tool_calls") or ()
    if not calls:
        return [{"role": "tool", "content": c} for c in contents]
    return [{"role": "tool", "tool_call_id": calls[min(i, len(calls) - 1)]["id"],
             "name": calls[min(i, len(calls) - 1)]["function"]["name"], "content": c} for i, c in enumerate(contents)]


def turn_end(profile: ChatProfile, rendered: str) -> int:
    """Where the assistant turn that ends `rendered` stops being the model's text: before the
    special token the template closes it with (Qwen `<|im_end|>`, DeepSeek's EOS, MiniMax `[e~[`),
    or at the end (GLM closes a turn with the next role's token)."""
    specials = profile.codec.special_pattern
    last = None
    if specials is not None:
        for last in specials.finditer(rendered):
            pass
    return last.start() if last is not None and not rendered[last.end():].strip() else len(rendered)


def glue_turn(profile: ChatProfile, calls: list[Call], forms: tuple[Form, ...] = _FORMS) -> tuple[dict[str, Any], str, Form]:
    """The assistant turn `tool_delta` renders before the tool messages, making `calls`, in the
    first form the template renders both alone and followed by a tool message; its text from the
    content (a sentinel; without content, the generation prompt's end) to the turn's end (the calls
    as the template writes them), the glue being what follows that text; and the form. What a
    template rewrites before the content (reasoning) is moot."""
    errors = []
    prompt = None
    for form in forms:
        turn = assistant_turn(form, "", _SENTINEL, calls)
        try:
            alone = profile.render([_PROBE_USER, turn])
            full = profile.render([_PROBE_USER, turn, *tool_messages(turn, ["y"])], add_generation_prompt=True)
            if form[1] and prompt is None:
                prompt = profile.render([_PROBE_USER], add_generation_prompt=True)
        except Exception as exc:  # this template wants another form
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        at = alone.find(_SENTINEL) if not form[1] else (len(prompt) if prompt and alone.startswith(prompt) else -1)
        tail = alone[at:turn_end(profile, alone)] if at >= 0 else ""
        if tail and tail in full:
            return turn, tail, form
        errors.append("the turn renders differently once a tool message follows it")
    raise ValueError(f"the chat template cannot render tool results after an assistant turn: {errors[-1] if errors else 'no form'}")


def template_drift(profile: ChatProfile) -> str | None:
    """None when the engine's incremental ids equal a full render of a two-call conversation.

    The conversation is written the way the template itself renders each assistant turn with
    its calls (so every family is checked in its own format), the first form of `_FORMS` whose
    call the configured parser reads. Otherwise a sentence: that the template writes no call
    the parser reads, or the first token where the ids part, so a user sees at start-up that
    this template rewrites history (the engine's ids stay the server's).
    """
    try:
        return _drift(profile)
    except Exception as exc:  # a template that cannot render the conversation at all
        return f"the check could not render its conversation ({type(exc).__name__}: {exc})"


def _render(profile: ChatProfile, messages: list[dict[str, Any]], prompt: bool) -> str:
    return profile.render(messages, tools=[_PROBE_TOOL], add_generation_prompt=prompt)


def _model_text(profile: ChatProfile, before: list[dict[str, Any]], turn: dict[str, Any]) -> str:
    """The assistant turn's text as the template writes it, after the generation prompt, without its closing token."""
    prompt, rendered = _render(profile, before, True), _render(profile, [*before, turn], False)
    if not rendered.startswith(prompt):
        at = next((i for i, (a, b) in enumerate(zip(prompt, rendered)) if a != b), len(prompt))
        raise _Parted(f"the template rewrites the turn it prompts for: the prompt goes on {prompt[at:at + 30]!r}, "
                      f"the turn rendered after it {rendered[at:at + 30]!r}")
    return rendered[len(prompt):turn_end(profile, rendered)]


def _without_empty_reasoning(profile: ChatProfile, text: str) -> str:
    """`text` without the empty reasoning blocks a generation prompt with thinking off writes."""
    start, end = getattr(profile.reasoning, "start", ""), getattr(profile.reasoning, "end", "")
    return re.sub(re.escape(start.strip()) + r"\s*" + re.escape(end.strip()) + r"\s*", "", text) if start and end else text


class _Parted(Exception):
    """The template renders the conversation so that no token stream can follow it incrementally."""


def _drift(profile: ChatProfile) -> str | None:
    schemas = {"code_interpreter": _PROBE_TOOL["function"]["parameters"]}
    shown = None
    thought = ("", "") if profile.thinking_off else ("I should use the tool.", "Once more, twice.")
    for form in _FORMS[:-1]:
        first = assistant_turn(form, thought[0], "Let me check.", code_calls(["print(6 * 7)"]))
        second = assistant_turn(form, thought[1], "", code_calls(["print(6 * 7)", "print('é')"], first_id=1))
        try:
            text = _model_text(profile, [_PROBE_USER], first)
        except _Parted as exc:
            return str(exc)
        except Exception:  # this template wants another form
            continue
        shown = text
        calls = profile.parser.parse(profile.split_reasoning(text)[1], schemas).calls
        if [(c.name, c.arguments, c.error) for c in calls] == [("code_interpreter", {"code": "print(6 * 7)"}, None)]:
            break
    else:
        if shown is None:
            return "the chat template renders no assistant turn with tool calls"
        return (f"the chat template writes no tool call the {profile.tool_parser} parser reads "
                f"(an assistant turn with one renders as {shown[-120:]!r})")
    results = [["42"], ["42", "again"]]
    convo: list[dict[str, Any]] = [_PROBE_USER]
    ours = profile.encode(_render(profile, convo, True))
    end = profile.closer_id if profile.closer_id is not None else profile.eos_id
    for turn, outputs in zip((first, second), results):
        try:
            text = _model_text(profile, convo, turn)
        except _Parted as exc:
            return str(exc)
        ours += profile.encode(text) + [end]
        made = [ToolCall(c["function"]["name"], id=c["id"]) for c in turn["tool_calls"]]
        ours += profile.observation_ids(Turn("tool"), [CallResult(made[min(i, len(made) - 1)], o) for i, o in enumerate(outputs)], end)
        convo += [turn, *tool_messages(turn, outputs)]
    theirs = profile.encode(_render(profile, convo, True))
    if ours == theirs or profile.thinking_off and _without_empty_reasoning(profile, profile.decode(ours)) == \
            _without_empty_reasoning(profile, profile.decode(theirs)):
        return None  # thinking off: the full render leaves out earlier turns' empty reasoning, nothing else
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (
        f"token {at}: incremental {profile.decode(ours[at:at + 8])!r} vs full render {profile.decode(theirs[at:at + 8])!r}"
    )
