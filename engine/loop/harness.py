"""What an agent's session is to the loop: the `Harness` the HARNESS state's step talks to.

The harness (Claude Code, the OpenAI Agents SDK, a script) runs its own loop and tools; it asks
the model through the agent front door, and each of its calls is a turn of the sample's machine.
The session behind the door (`engine.agent.sessions`) is the `Harness` here: given the rollout
after GENERATE appended a turn, it answers the call that waits for that turn, then waits for
what the harness does next and says it as a `HarnessEvent` (its next call, matched onto what
was sampled, or the end of the session). The loop knows no protocol and no message: only that.
"""

from __future__ import annotations

from typing import Protocol

from engine.machine.rollout import HarnessEvent, Rollout


class Harness(Protocol):
    """An agent's session, as the machine's HARNESS state sees it."""

    async def exchange(self, r: Rollout) -> HarnessEvent:
        """Answer the waiting call with `r`'s last turn; return the harness's next call or its end."""
        ...
