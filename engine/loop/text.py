"""The response text, derived from the response ids and kept up to date turn by turn."""

from __future__ import annotations

from array import array
from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Decodes only what is new, yet stays equal to `decode(all ids)`.

    Byte-level tokenizers may split one character across two turns; decoding the first
    half alone gives U+FFFD. So a tail whose decode ends in U+FFFD is not committed: it is
    decoded again, with the ids that complete it, on the next `sync`.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._committed = ""
        self._done = 0  # ids whose text is in `_committed`

    @property
    def current(self) -> str:
        """The committed text (all of it after a successful `take`)."""
        return self._committed

    def take(self, start: int, end: int, text: str) -> bool:
        """Commit `text`, already decoded by the caller, as the text of ids[start:end].

        Accepted only at a clean boundary: every id before `start` is committed and `text`
        does not end in a split character. Then the turn's ids are not decoded a second time.
        """
        if self._done != start or text.endswith(REPLACEMENT):
            return False
        self._committed += text
        self._done = end
        return True

    def sync(self, ids: array) -> str:
        """The text of `ids`; a shorter `ids` (after TRIM) is decoded again from the start."""
        if len(ids) < self._done:
            self._committed, self._done = "", 0
        tail = self._decode(ids[self._done :].tolist()) if len(ids) > self._done else ""
        if tail.endswith(REPLACEMENT):
            return self._committed + tail
        self._committed += tail
        self._done = len(ids)
        return self._committed
