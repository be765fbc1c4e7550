"""A researcher's tool with settings of its own: declared beside it, under its own prefix, read
from slime's args, `run --config` and `run`'s flags, and handed to its `setup`."""

from __future__ import annotations

from typing import Any

from engine import tools
from engine.settings import Flag, setting, settings


@settings(prefix="engine_stamp_")
class StampSettings:
    """The stamp tool (a test plugin with settings of its own)."""

    text: str = setting("stamped", help="what the tool stamps every document with", flag=Flag("--stamp-text", "TEXT"))
    repeat: int = setting(1, low=1, high=10, help="how many stamps a document gets", flag=Flag("--stamp-repeat"))


class Stamp(tools.Tool):
    name = "stamp"
    description = "Stamp a document."
    Settings = StampSettings

    def __init__(self, settings: StampSettings | None = None) -> None:
        self.settings = settings or StampSettings()

    def setup(self, cfg: Any, settings: StampSettings | None = None) -> Stamp:
        return Stamp(settings)

    async def execute(self, state: Any, document: str) -> str:
        return " ".join([self.settings.text] * self.settings.repeat) + f": {document}"


tools.register(Stamp(), replace=True)
