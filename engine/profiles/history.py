"""The conversation a sample's context holds, as the chat template's messages.

While a template only appends, the engine never renders what the model wrote again: an
observation is the template's delta glued onto the sampled tokens. Two things need the
conversation as messages all the same (docs/long-rollouts.md):

* a template that drops earlier turns' reasoning when it renders a conversation again (Qwen3,
  Qwen3.5 and GLM-4.7 keep a turn's reasoning only until a user message follows it): served,
  each turn's prompt is the template's own render, so the engine renders it where reasoning
  would be dropped (`History.follow`) and starts a new segment when that render does not
  extend the sequence sampled so far;
* compaction: a new segment's prompt is the original prompt, a summary and the latest turns,
  rendered by the template (`History.compacted`).

`History` holds the prompt's messages, a summary where one was written, and one `Exchange`
per model turn: its text as sampled and what answered it (tool results, or a user turn). A
turn is read into an assistant message only when first rendered, and kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from engine.profiles.chat import ChatProfile, tool_messages

# How a compacted segment's prompt shows the summary: a user message after the original prompt.
SUMMARY_HEADER = "A summary of the conversation so far, written by you:\n\n"


@attrs.define(eq=False, slots=True)
class Exchange:
    """One model turn and what answered it: tool results, or a user turn (an environment's reply)."""

    text: str  # the turn as sampled, decoded
    reasoning: bool  # it holds a reasoning block (one the template may drop when it renders it again)
    results: tuple[str, ...] | None = None  # the tool messages' contents after it
    user: str | None = None  # the user turn after it
    message: dict[str, Any] | None = None  # the turn as an assistant message, once rendered

    def messages(self, profile: ChatProfile) -> list[dict[str, Any]]:
        """The turn and what answered it, as the template's messages."""
        if self.message is None:
            self.message = profile.assistant_message(self.text)
        out = [self.message]
        if self.results is not None:
            out += tool_messages(self.message, list(self.results))
        if self.user is not None:
            out.append({"role": "user", "content": self.user})
        return out


@attrs.define(eq=False, slots=True)
class History:
    """The conversation of a sample's open context: its prompt, a summary, its exchanges."""

    prompt: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    summary: str | None = None
    exchanges: list[Exchange] = attrs.field(factory=list)
    since_user: int = 0  # the first exchange after the last user message

    def messages(self, profile: ChatProfile, extra: Sequence[dict[str, Any]] = ()) -> tuple[list[dict[str, Any]], int]:
        """The conversation as messages (then `extra`), and where what is not the prompt begins."""
        out = list(self.prompt)
        if self.summary is not None:
            out.append({"role": "user", "content": SUMMARY_HEADER + self.summary})
        start = len(self.prompt)
        for exchange in self.exchanges:
            out += exchange.messages(profile)
        return out + list(extra), start

    def render(self, profile: ChatProfile, extra: Sequence[dict[str, Any]] = ()) -> list[int]:
        """The next prompt as the template renders the conversation (then `extra`)."""
        messages, start = self.messages(profile, extra)
        return profile.render_messages(messages, list(self.tools), plain_from=start)

    def add(self, profile: ChatProfile, text: str, *, results: Sequence[str] | None = None, user: str | None = None) -> None:
        """A model turn and what answered it, as the engine appended them."""
        reasoning = bool(profile.split_reasoning(text)[0])
        self.exchanges.append(Exchange(text, reasoning, tuple(results) if results is not None else None, user))

    def may_rerender(self, rule: str) -> bool:
        """Whether the template's render of the conversation may now differ from the sequence:
        it drops the reasoning of a turn the sequence holds (`ChatProfile.earlier_reasoning`)."""
        if rule == "kept" or not self.exchanges:
            return False
        last = self.exchanges[-1]
        if rule == "dropped":
            return last.reasoning
        return last.user is not None and any(e.reasoning for e in self.exchanges[self.since_user:])

    def follow(self, profile: ChatProfile, rule: str) -> list[int] | None:
        """After `add`: the next prompt as the template renders the conversation, where it may drop
        reasoning the sequence holds (else None: the delta the engine glued on is the render). The
        caller compares it with the sequence: an extension is glued on, anything else starts a segment."""
        rerender = self.may_rerender(rule)
        if self.exchanges and self.exchanges[-1].user is not None:
            self.since_user = len(self.exchanges)
        return self.render(profile) if rerender else None

    def compacted(self, summary: str | None, keep: int) -> History:
        """The conversation of a compacted segment: the prompt, the summary (None: the one it had),
        the latest `keep` exchanges."""
        kept = self.exchanges[len(self.exchanges) - keep:] if keep > 0 else []
        return History(self.prompt, self.tools, self.summary if summary is None else summary, list(kept), 0)


def extends(rendered: Sequence[int], sequence: Sequence[int]) -> bool:
    """Whether `rendered` is `sequence` followed by more (or equal to it)."""
    return len(rendered) >= len(sequence) and list(rendered[: len(sequence)]) == list(sequence)
