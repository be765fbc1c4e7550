"""Replay mode: scripted assistant turns, teacher-forced through the model.

A replay file is JSON (a list of entries, or `{"entries": [...]}`) or JSONL (one entry per line):

    {"prompt": "What is 1+1?", "turns": ["Let me compute. <code>print(1+1)</code>",
                                          "The result is 2. Answer: \\boxed{2}<|im_end|>"]}

Matching rule, applied to the request's input decoded with special tokens kept:

1. An entry is a candidate when its `prompt` occurs in the decoded input. Among candidates the
   longest prompt wins (the most specific: a simulated user's instructions over the conversation
   it is shown, a compaction's question over the task's prompt it follows), then the one ending
   latest in the input (a question asked after the prompt), then the first in the file.
2. The turn to play is the one after the last of the entry's turns found after the first
   occurrence of the prompt, each looked for after the one found before it. A turn is "found"
   when its text, stripped of surrounding whitespace and of a trailing `<|im_end|>` /
   `<|endoftext|>`, is there, or its text after a closing `</think>` is; the stripping lets a
   client that re-renders past turns through a chat template (which may drop their reasoning)
   still match. A turn not found is skipped: a compacted context that no longer
   holds the oldest turns goes on from the latest it holds.
3. When the entry's last turn is already present, or no entry matches, the server samples as usual.

The chosen turn is tokenized as written (special-token strings become their ids). When its last
token is not an EOS id, `<|im_end|>` is appended, as a chat model ends its turn; stop strings,
`stop_token_ids` and `max_new_tokens` usually end the turn earlier (for a tool call, the stop string
`</code>` cuts it right after the call).
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

_TURN_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_REASONING_END = "</think>"


def _needle(turn: str) -> str:
    """The part of a turn's text that must appear in the input for the turn to count as done."""
    text = turn.strip()
    changed = True
    while changed:
        changed = False
        for marker in _TURN_END_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)].rstrip()
                changed = True
    return text


def _needles(turn: str) -> tuple[str, ...]:
    """What may show that a turn was played: its text, else its text after its reasoning, which a
    template that drops earlier turns' reasoning (Qwen3's, on a re-rendered history) leaves out."""
    whole = _needle(turn)
    _, closed, after = whole.rpartition(_REASONING_END)
    return (whole, after.strip()) if closed and after.strip() else (whole,)


@attrs.frozen
class ReplayEntry:
    """The scripted assistant turns answering one prompt."""

    prompt: str = attrs.field(validator=attrs.validators.min_len(1))
    turns: tuple[str, ...] = attrs.field(converter=tuple, validator=attrs.validators.min_len(1))


@attrs.frozen
class ReplayScript:
    """All entries of a replay file, and the rule choosing the turn for a request."""

    entries: tuple[ReplayEntry, ...] = attrs.field(converter=tuple)

    def select(self, decoded_input: str) -> tuple[ReplayEntry, int] | None:
        """The matching entry and the index of the turn to play next, or None to sample."""
        best: ReplayEntry | None = None
        best_rank = (-1, -1)
        for entry in self.entries:
            at = decoded_input.find(entry.prompt)
            rank = (len(entry.prompt), at + len(entry.prompt))
            if at >= 0 and rank > best_rank:
                best, best_rank = entry, rank
        if best is None:
            return None
        pos = best_rank[1]
        done = 0
        for k, turn in enumerate(best.turns):
            for needle in _needles(turn):
                found = decoded_input.find(needle, pos) if needle else pos
                if found >= 0:
                    pos = found + len(needle)
                    done = k + 1
                    break
        return (best, done) if done < len(best.turns) else None

    def turn_text(self, decoded_input: str) -> str | None:
        """The scripted text to play for this input, or None when nothing matches."""
        chosen = self.select(decoded_input)
        return None if chosen is None else chosen[0].turns[chosen[1]]


def _entry(raw: Any, where: str) -> ReplayEntry:
    if not isinstance(raw, dict) or not isinstance(raw.get("prompt"), str) or not isinstance(raw.get("turns"), list):
        raise ValueError(f"{where}: a replay entry needs a string 'prompt' and a list 'turns'")
    if not raw["turns"] or not all(isinstance(t, str) for t in raw["turns"]):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
    if not raw["prompt"]:
        raise ValueError(f"{where}: 'prompt' must not be empty")
    return ReplayEntry(prompt=raw["prompt"], turns=raw["turns"])


def load_replay(path: str | os.PathLike[str]) -> ReplayScript:
    """Read a replay script from a JSON or JSONL file (see the module docstring for the format)."""
    with open(path, encoding="utf-8") as f:
        content = f.read()
    try:
        data: Any = json.loads(content)
    except json.JSONDecodeError:
        data = None
    if data is None or isinstance(data, dict) and "prompt" in data:
        # JSONL (a one-line file holding a single entry parses as JSON too).
        lines = [(i, line) for i, line in enumerate(content.splitlines(), 1) if line.strip()]
        return ReplayScript(entries=[_entry(json.loads(line), f"{path}:{i}") for i, line in lines])
    if isinstance(data, dict):
        data = data.get("entries")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of entries, {{'entries': [...]}}, or JSONL")
    return ReplayScript(entries=[_entry(raw, f"{path}[{i}]") for i, raw in enumerate(data)])
