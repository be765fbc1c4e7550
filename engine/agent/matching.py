"""Whether a call's history extends what the session sampled, and if not, how it parts from it.

A session knows its segment's history as the engine holds it (`transcript`): the messages the
segment's prompt was rendered from, then each turn as the model wrote it (the `ModelAnswer`
made of its tokens) and the messages the harness added after it. A call's history extends
that when it begins with every message of it, the model's turns matched by the configured
matcher, and adds at least one message after the last turn. Anything else is a break, named:

- `history_contradicts`: a tool result answers a call no assistant message of the history made;
- `reasoning_dropped`: a model turn came back with its text and calls but not its reasoning
  (only the `exact` matcher asks for the reasoning back; the others take its absence);
- `turn_rewritten`: a model turn came back with other text or calls;
- `history_forked`: the history parts at its first message (another conversation: a sub-agent),
  stops at or before the last turn (a regeneration), or goes on otherwise from a message that differs;
- `history_compacted`: the history is shorter than the transcript and parts after its first
  message (earlier turns dropped or summarised).

Matchers (`engine_agent_matcher`), from strict to loose, for the model's own turns only (every
other message must come back as it was sent):
- `exact`: text, reasoning, and each call's id, name and arguments as written;
- `json_calls` (the default): text (surrounding white space aside), reasoning where the harness
  sends it, calls by name with arguments equal as JSON (`{"a": 1}` is `{ "a":1 }`), ids where sent;
- `role_content`: the role and the text alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Literal

import attrs

from engine.agent.calls import CallMade, Message

Matcher = Literal["exact", "json_calls", "role_content"]
MATCHERS: tuple[str, ...] = ("exact", "json_calls", "role_content")


@attrs.frozen
class Match:
    """A call's history against the transcript: `added` (it extends), or the break's `reason`."""

    extends: bool
    added: tuple[Message, ...] = ()
    reason: str | None = None
    at: int = 0  # where the history parts from the transcript (a break)


def _arguments(text: str) -> Any:
    """Arguments as JSON values, or the text itself when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # nested past the parser's stack: compared as text
        return text


def _calls_same(ours: Sequence[CallMade], theirs: Sequence[CallMade], exact: bool) -> bool:
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        if a.name != b.name:
            return False
        if exact:
            if a.arguments != b.arguments or a.id != b.id:
                return False
        elif (b.id and a.id != b.id) or (a.arguments != b.arguments and _arguments(a.arguments) != _arguments(b.arguments)):
            return False
    return True


def turn_matches(ours: Message, theirs: Message, matcher: str) -> str:
    """How the harness's copy of a model turn compares with the turn the model wrote: "same",
    "reasoning_dropped" (text and calls the same, the reasoning left out where `exact` asks for
    it back) or "turn_rewritten"."""
    if theirs.role != "assistant":
        return "turn_rewritten"
    if matcher == "role_content":
        return "same" if ours.text().strip() == theirs.text().strip() else "turn_rewritten"
    exact = matcher == "exact"
    text_same = ours.text() == theirs.text() if exact else ours.text().strip() == theirs.text().strip()
    if not (text_same and _calls_same(ours.calls, theirs.calls, exact)):
        return "turn_rewritten"
    mine, given = (ours.reasoning or "").strip(), (theirs.reasoning or "").strip()
    if given == mine:
        return "same"
    if not given:
        return "reasoning_dropped" if exact else "same"
    return "turn_rewritten"


def same_message(a: Message, b: Message) -> bool:
    """Two messages the harness sent are the same one: role, text, images, calls, what they answer.
    A text sent once as a string and once as one text part is the same text; a tool's name may be
    sent or not."""
    return (a.role == b.role and a.text() == b.text() and _images(a) == _images(b) and a.calls == b.calls
            and a.call_id == b.call_id and a.error == b.error and (a.reasoning or "") == (b.reasoning or ""))


def _images(m: Message) -> tuple[str | None, ...]:
    return () if isinstance(m.content, str) else tuple(p.image for p in m.content if p.kind == "image")


def contradiction(history: Sequence[Message], start: int = 0) -> int | None:
    """The index (from `start` on) of the first tool result answering a call that no assistant
    message before it made (its id, or any call when it names none); None when it holds together."""
    made: set[str] = set()
    any_call = False
    for i, m in enumerate(history):
        if m.role == "assistant":
            for c in m.calls:
                made.add(c.id)
                any_call = True
        elif m.role == "tool" and i >= start and (not any_call or (m.call_id and m.call_id not in made)):
            return i
    return None


def match_history(history: Sequence[Message], transcript: Sequence[Message], model_turns: AbstractSet[int],
                  matcher: str, made: AbstractSet[str] | None = None) -> Match:
    """Match a call's history onto the transcript (`model_turns`: the transcript's indices of the
    model's own turns, compared by `matcher`; every other message by equality). What matched the
    transcript was taken before; a contradiction in what follows is named first. `made`: the call
    ids of the transcript's assistant messages, when the caller keeps them (then an extending
    history's check reads only what it added)."""
    match = _prefix(history, transcript, model_turns, matcher)
    if match.extends and made is not None:
        wrong = _contradiction_after(match.added, made, any_call=bool(made) or any(
            m.calls for m in transcript if m.role == "assistant"))
        wrong = None if wrong is None else len(transcript) + wrong
    else:
        wrong = contradiction(history, len(transcript) if match.extends else match.at)
    if wrong is not None:
        return Match(False, reason="history_contradicts", at=wrong)
    return match


def _contradiction_after(added: Sequence[Message], made: AbstractSet[str], any_call: bool) -> int | None:
    ids = set(made)
    for i, m in enumerate(added):
        if m.role == "assistant":
            ids.update(c.id for c in m.calls)
            any_call = any_call or bool(m.calls)
        elif m.role == "tool" and (not any_call or (m.call_id and m.call_id not in ids)):
            return i
    return None


def _prefix(history: Sequence[Message], transcript: Sequence[Message], model_turns: AbstractSet[int], matcher: str) -> Match:
    n = len(transcript)
    for i in range(min(n, len(history))):
        ours, theirs = transcript[i], history[i]
        if ours is theirs or ours == theirs:  # the usual case: sent back as it was (the door reuses what it read)
            continue
        if i in model_turns:
            verdict = turn_matches(ours, theirs, matcher)
            if verdict == "same":
                continue
            if theirs.role == "assistant":
                return Match(False, reason=verdict, at=i)
        elif same_message(ours, theirs):
            continue
        if i == 0:
            return Match(False, reason="history_forked", at=0)
        return Match(False, reason="history_compacted" if len(history) < n else "history_forked", at=i)
    if len(history) <= n:  # the transcript's own start, nothing new: a regeneration
        return Match(False, reason="history_forked", at=len(history))
    return Match(True, added=tuple(history[n:]))
