"""A researcher's tool in its own module: registration is all it takes to join the machine."""

from __future__ import annotations

from engine import tools


@tools.tool(replace=True)
async def word_count(text: str) -> str:
    """Count the words of a text."""
    return str(len(text.split()))
